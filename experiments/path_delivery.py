"""`python -m experiments.path_delivery`: the router's analytic network model (`router.paths`)
against the packet-level one, per path of a mix.

Packet level: each response on a QUIC connection of its own (real aioquic, its ends with a few
RTT samples and then idle, as between a client's turns) over its own copy of the path's link
(`netsim.link`, driven in virtual time by `netsim.simlink`): the request goes up, and the
server writes each token's SSE event at the time the simulated engine made it. The client times
the whole request and every token. That is a client per request, as the router's simulator has
it.

Analytic: `router.paths.PathModel.sample`, many draws for each of the same responses.

Delivery time: the network's share of the time the client waits for its last token, (last token
at the client - request sent) - (last token made - request at the server). The table prints its
mean per path both ways, their ratio, and the parts (uplink, first token, last token).

    python -m experiments.path_delivery                  # the `mixed` mix, 200 responses a path
    python -m experiments.path_delivery --responses 50   # quicker
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent, StreamDataReceived
from tqdm import tqdm

from config import DEFAULT_PATH, load
from config.schema import PathSpec
from experiments.harness.output import write_csv
from netsim.link import GilbertElliott, LinkConfig
from netsim.simlink import SimulatedPath
from router.paths import (
    END_BYTES,
    HEAD_BYTES,
    PROMPT_BYTES_PER_TOKEN,
    TOKEN_BYTES,
    NetworkTime,
    PathModel,
)
from transport.connection import ScheduledQuicConnection
from transport.http3 import Http3Settings
from transport.tls import ensure_certificate

CONGESTION_CONTROL = "cubic"
PINGS, PING_EVERY_S = 3, 0.5
"""After its handshake, each end of a connection pings this many times, this far apart..."""
IDLE_S = 2.5
"""...then the connection is idle this long before the request: past CUBIC's 2 s, after which
aioquic starts its window afresh."""


@dataclass(frozen=True)
class Response:
    """What the server makes of one request: its prompt, and when it writes each token, from the
    request's arrival there."""

    prompt_tokens: int
    first_s: float
    step_s: float
    tokens: int

    @property
    def last_s(self) -> float:
        return self.first_s + self.step_s * (self.tokens - 1)


def responses(count: int, seed: int) -> list[Response]:
    """Responses like the paper deployment's: a prompt of 20 to 1,500 tokens, 32 to 128 output
    tokens, a TTFT of 10 to 300 ms and a step of 2 to 60 ms (OPT-125M alone to OPT-6.7B busy)."""
    rng = np.random.default_rng(seed)
    return [
        Response(
            int(rng.choice([40, 200, 1500])),
            float(rng.uniform(0.01, 0.3)),
            float(np.exp(rng.uniform(np.log(0.002), np.log(0.06)))),
            int(rng.integers(32, 129)),
        )
        for _ in range(count)
    ]


def link_of(path: PathSpec, seed: int) -> LinkConfig:
    """The link model's form of a path of models.yaml (its queue large enough never to drop)."""
    bursts = GilbertElliott(**path.bursts.model_dump()) if path.bursts is not None else None
    return LinkConfig(
        rate_bps=path.rate_bps,
        delay_s=path.rtt_s / 2,
        loss=path.loss,
        bursts=bursts,
        seed=seed,
        queue_bytes=1 << 20,
    )


def packet_level(
    path: PathSpec, response: Response, seed: int, cert: tuple[Path, Path]
) -> NetworkTime:
    """One response over its own connection and link, in virtual time."""
    config = QuicConfiguration(
        is_client=True, alpn_protocols=["h3"], congestion_control_algorithm=CONGESTION_CONTROL
    )
    config.verify_mode = 0
    client = ScheduledQuicConnection(configuration=config, scheduler="fcfs")
    settings = Http3Settings(str(cert[0]), str(cert[1]), congestion_control=CONGESTION_CONTROL)
    server = ScheduledQuicConnection(
        configuration=settings.quic_configuration(),
        original_destination_connection_id=client.original_destination_connection_id,
        scheduler="fcfs",
    )
    up_size = HEAD_BYTES + round(response.prompt_tokens * PROMPT_BYTES_PER_TOKEN)
    sizes = [TOKEN_BYTES] * response.tokens
    sizes[0] += HEAD_BYTES
    sizes[-1] += END_BYTES
    marks = np.cumsum(sizes)
    seen = {"up": 0, "down": 0}
    times: dict[str, float] = {}
    arrivals: list[float] = []

    def on_event(connection: object, event: QuicEvent, now: float) -> None:
        if not isinstance(event, StreamDataReceived):
            return
        if connection is server:
            seen["up"] += len(event.data)
            if seen["up"] >= up_size and "arrived" not in times:
                times["arrived"] = now
                for k in range(response.tokens):
                    link.call_at(now + response.first_s + k * response.step_s, write(k))
        else:
            seen["down"] += len(event.data)
            while len(arrivals) < len(marks) and marks[len(arrivals)] <= seen["down"]:
                arrivals.append(now)

    def write(k: int) -> Callable[[float], None]:
        def send(now: float) -> None:
            server.send_stream_data(stream, bytes(sizes[k]), k == response.tokens - 1)

        return send

    def ping(end: ScheduledQuicConnection) -> Callable[[float], None]:
        return lambda now: end.send_ping(0)

    link = SimulatedPath(client, server, link_of(path, seed), on_event)
    link.run(until=lambda: client._handshake_complete)
    # A client's connection between turns: both ends have RTT samples (from pings, as earlier
    # turns would give), and it has been idle long enough that CUBIC starts afresh.
    ready = link.now + IDLE_S + PINGS * PING_EVERY_S
    for k in range(PINGS):
        for end in (client, server):
            link.call_at(link.now + k * PING_EVERY_S, ping(end))
    link.call_at(ready, lambda now: None)
    link.run(until=lambda: link.now >= ready)
    stream = client.get_next_available_stream_id()
    sent = link.now
    client.send_stream_data(stream, bytes(up_size), True)
    link.run(until=lambda: len(arrivals) == response.tokens, timeout=sent + 600)
    arrived = times["arrived"]
    first_made = arrived + response.first_s
    last_made = arrived + response.last_s
    return NetworkTime(arrived - sent, arrivals[0] - first_made, arrivals[-1] - last_made)


def compare(
    path: PathSpec, count: int, seed: int, cert: tuple[Path, Path], draws: int = 50
) -> tuple[np.ndarray, np.ndarray]:
    """(packet-level, analytic) network times of `count` responses: rows of (uplink, first,
    last); the analytic row of each response is the mean of `draws` draws."""
    model = PathModel(path)
    rng = np.random.default_rng([seed, 1])
    measured, modelled = [], []
    for i, r in enumerate(responses(count, seed)):
        measured.append(packet_level(path, r, seed * 100_000 + i, cert))
        samples = [
            model.sample(rng, r.prompt_tokens, r.first_s, r.last_s, r.tokens) for _ in range(draws)
        ]
        modelled.append(np.mean(samples, axis=0))
    return np.array(measured), np.array(modelled)


def delivery(times: np.ndarray) -> np.ndarray:
    """Each response's delivery time: uplink plus the last token's lag."""
    return times[:, 0] + times[:, 2]


def bootstrap_ci(values: np.ndarray, seed: int, draws: int = 2000) -> tuple[float, float]:
    """The 95% bootstrap interval of the mean: on a heavy-tailed path (bad), a few hundred
    responses pin the packet-level mean down to a few tens of percent at best."""
    rng = np.random.default_rng(seed)
    means = [values[rng.integers(0, len(values), len(values))].mean() for _ in range(draws)]
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.path_delivery",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--mix", default="mixed")
    parser.add_argument("--responses", type=int, default=200, help="per path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    mixes = load(args.config).path_mixes
    if args.mix not in mixes:
        parser.error(f"unknown path mix {args.mix!r} (known: {', '.join(mixes)})")
    cert = ensure_certificate()
    rows = []
    print(f"{'path':>6} {'packet level (95% CI)':>24} {'analytic':>9} {'ratio':>6}   "
          "uplink / first / last (packet level | analytic)")  # fmt: skip
    for name, path in tqdm(mixes[args.mix].paths.items(), unit="path", leave=False):
        measured, modelled = compare(path, args.responses, args.seed, cert)
        a, b = delivery(measured).mean(), delivery(modelled).mean()
        low, high = bootstrap_ci(delivery(measured), args.seed)
        parts = " / ".join(f"{x * 1e3:.1f}" for x in measured.mean(axis=0))
        model_parts = " / ".join(f"{x * 1e3:.1f}" for x in modelled.mean(axis=0))
        verdict = "within 10%" if abs(b / a - 1) <= 0.1 else "MISS 10%"
        tqdm.write(f"{name:>6} {a * 1e3:>8.1f} ms ({low * 1e3:.0f}-{high * 1e3:.0f}) "
                   f"{b * 1e3:>6.1f} ms {b / a:>6.3f}   {parts} | {model_parts} ms"
                   f"  {verdict}")  # fmt: skip
        rows.append({"path": name, "packet_level_s": a, "packet_level_ci95": (low, high),
                     "analytic_s": b, "ratio": b / a})  # fmt: skip
    out = args.results / f"path_delivery-{args.mix}.csv"
    write_csv(out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
