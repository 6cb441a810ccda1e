"""`python -m experiments.eloquent_sim`: Chatterbox's Figures 5 and 6 on the real QUIC stack, in
virtual time.

A real aioquic client and server, with HTTP/3 and datagrams on, talk through a simulated link
(`netsim.simlink`) with bursty Gilbert-Elliott loss, one chain per direction (or, with
`--ack-loss none`, on the downlink only). The server answers one chat request with the event
stream that `serving.api` renders, one event every 100 ms for 30 s, on the HTTP/3 response stream,
which QUIC delivers reliably and in order. Server and client run Eloquent through the same
lanes as the live server and client (`transport.eloquent.driver`), so these datagrams are the
live ones byte for byte. The schemes differ in what is sent beside the stream:
- `stream`: nothing; a lost packet is repaired by QUIC's retransmission.
- `dup-k`: each event's text (token-sized, with the envelope until acknowledged) in k datagrams,
  each in its own packet; no repeats.
- `el-events`: the first Eloquent sender built here: whole events, at most 10 a datagram, re-sent
  after 200 ms without a new event (Algorithm 1).
- `el-paper`: the same with token-sized positions: the paper's sender, T = 10.
- `el-room`: no cap on the count; the payload's room alone limits the repeats.
- `el-window`: room, and only tokens generated within 2·RTT + L are repeated.
- `el-tail`: room, and the unacknowledged tail is re-sent every 50 ms while ACKs are missing,
  even while new tokens flow.
- `el-allow`: room, and the server's datagrams may exceed QUIC's congestion window by one
  packet while they wait for it (`ScheduledQuicConnection.datagram_allowance`).
- `eloquent`: room, window, tail and allowance together: what the server runs.
The client renders the longest contiguous prefix from whichever path delivers first.

Metrics (Chatterbox's §4): the stall ratio (time in inter-render gaps over 200 ms, over the
session, from the first token's generation to the last render); the share of late tokens (rendered
over 400 ms after generation); the redundancy rate, two ways: in payload (datagram payload bytes,
the bytes a scheme adds beside the stream, over the tokens' text bytes) and on the wire (every UDP
byte sent toward the client, headers and the stream's JSON included, over the text bytes); and the
median tokens a datagram carried. Loss patterns are given as mean durations (Chatterbox's p and q
are ambiguous):

    default  good 1000 ms, lossy 200 ms at 90% loss, 100 ms slots: ~15% loss (p=0.9, q=0.5)
    frequent good  200 ms, lossy 200 ms at 90% loss: ~45% loss       (p=0.5, q=0.5)
    long     good 1000 ms, lossy 500 ms at 90% loss: ~30% loss       (p=0.9, q=0.8)

Writes results/eloquent_sim.csv and .png and prints the table with the targets' checks.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent
from tqdm import tqdm

from experiments.harness.output import write_csv
from netsim.link import GilbertElliott, LinkConfig
from netsim.simlink import SimulatedPath
from serving.engines.base import TokenDelta
from serving.render import Shape
from transport.connection import adopt
from transport.eloquent import (
    DATAGRAM_ALLOWANCE,
    HEADER,
    EloquentReceiver,
    EloquentSender,
    ReceiverLane,
    SenderLane,
)
from transport.eloquent.driver import datagram_sender, withdraw
from transport.eloquent.sse import split_text
from transport.tls import ensure_certificate
from workloads.examples import corpus
from workloads.summary import late_share, stall_ratio

LOSS_PATTERNS = {
    "default": GilbertElliott(good_slots=10, bad_slots=2),
    "frequent": GilbertElliott(good_slots=2, bad_slots=2),
    "long": GilbertElliott(good_slots=10, bad_slots=5),
}
BASE = {"window": False, "tail_resend": False, "min_gap": 0.0}
SENDERS: dict[str, dict[str, Any]] = {
    "el-events": BASE | {"max_repeats": 9, "envelopes": 0},
    "el-paper": BASE | {"max_repeats": 9},
    "el-room": BASE,
    "el-window": BASE | {"window": True},
    "el-tail": BASE | {"tail_resend": True},
    "el-allow": BASE | {"allowance": DATAGRAM_ALLOWANCE},
    "eloquent": {"allowance": DATAGRAM_ALLOWANCE},
}
"""Each Eloquent variant's sender settings, beside EloquentSender's defaults (the server's),
and `allowance`, the server connection's `datagram_allowance`."""
SCHEMES = ("stream", "dup-2", "dup-3", "dup-4", "dup-5", *SENDERS)
TOKEN_GAP_S = 0.1


def words(n: int) -> list[str]:
    """n word-sized tokens of English text, as an LLM would stream them."""
    corpus_words = corpus().split()
    return [" " + corpus_words[i % len(corpus_words)] for i in range(n)]


def server_events(texts: list[str]) -> list[bytes]:
    """The event stream `serving.api` sends for a chat completion of these tokens, byte for
    byte: its own renderer, fed a generation that yields them."""

    class Generation:
        request = SimpleNamespace(request_id="chatcmpl-0123456789abcdef0123456789abcdef")
        model = "opt-1.3b"
        replica = SimpleNamespace(name="opt-1.3b-0")

        async def __aiter__(self) -> AsyncIterator[TokenDelta]:
            for i, text in enumerate(texts):
                last = i == len(texts) - 1
                yield TokenDelta(text, 1, 0, finish_reason="length" if last else None)

    async def collect() -> list[bytes]:
        shape = Shape(Generation(), chat=True)  # type: ignore[arg-type]
        shape.created = 1_700_000_000  # a fixed time of the right length: the same bytes always
        return [event.encode() async for event in shape.sse(include_usage=False)]

    return asyncio.run(collect())


class _PathClock:
    """The simulated link's clock, as a `transport.eloquent.Clock`."""

    def __init__(self, path: SimulatedPath) -> None:
        self._path = path

    def time(self) -> float:
        return self._path.now

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        self._path.call_at(when, lambda now: callback())


@dataclass
class Session:
    """One response of `count` tokens over a lossy link, in virtual time."""

    scheme: str
    link: LinkConfig
    certificate: tuple[Path, Path]
    count: int = 300
    generated: list[float] = field(default_factory=list)
    text_bytes: int = 0
    datagram_bytes: int = 0
    wire_before: int = 0
    died: bool = False
    _dup_queued: list[bytes] = field(default_factory=list)

    def run(self, timeout: float = 600.0) -> None:
        client_config = QuicConfiguration(
            is_client=True, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536
        )
        client_config.verify_mode = 0
        self.client = QuicConnection(configuration=client_config)
        server_config = QuicConfiguration(
            is_client=False, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536
        )
        server_config.load_cert_chain(*map(str, self.certificate))
        self.server = adopt(
            QuicConnection(
                configuration=server_config,
                original_destination_connection_id=self.client.original_destination_connection_id,
            ),
            "fcfs",
        )
        self.client_h3 = H3Connection(self.client, enable_webtransport=True)
        self.server_h3 = H3Connection(self.server, enable_webtransport=True)
        self.events = server_events(words(self.count))
        self.path = SimulatedPath(self.client, self.server, self.link, self._on_event)
        clock = _PathClock(self.path)
        self.path.run(until=lambda: self.client._handshake_complete, timeout=timeout)
        self.stream_id = self.client.get_next_available_stream_id()
        self.body: list[bytes] = []
        self.receiver = EloquentReceiver()
        to_server = datagram_sender(self.client, self.client_h3, self.stream_id)
        self.client_lane = ReceiverLane(self.receiver, to_server, clock, self.body.append)
        self.sender: EloquentSender | None = None
        if self.scheme != "stream":
            settings = dict(SENDERS.get(self.scheme, {"max_repeats": 0}))
            self.server.datagram_allowance = settings.pop("allowance", 0)
            self.sender = EloquentSender(**settings)
            self._to_client = datagram_sender(self.server, self.server_h3, self.stream_id)
            self.server_lane = SenderLane(
                self.sender, self._server_datagram, clock, self._server_rtt
            )
        self.client_h3.send_headers(
            self.stream_id,
            [
                (b":method", b"POST"),
                (b":scheme", b"https"),
                (b":authority", b"sim"),
                (b":path", b"/v1/chat/completions"),
                (HEADER, b"1"),
            ],
            end_stream=True,
        )
        self.path.run(
            until=lambda: self.died or self.receiver.next_position >= self.count, timeout=timeout
        )
        self.end = self.path.now

    def _server_rtt(self) -> float | None:
        loss = self.server._loss
        return loss._rtt_smoothed if loss._rtt_initialized else None

    def _server_datagram(self, payload: bytes) -> None:
        if self.scheme.startswith("dup-"):
            # Copies must not supersede each other: each goes in a packet of its own, or the
            # copies would die together. The last token's copies still waiting for the window
            # are dropped, as Eloquent's superseded datagrams are (`datagram_sender`): queued
            # behind a shut window they would fill every probe and starve the stream.
            for frame in self._dup_queued:
                withdraw(self.server, frame)
            self._dup_queued = []
            for _ in range(int(self.scheme.removeprefix("dup-"))):
                self.path.transmit()
                self.datagram_bytes += len(payload)
                self.server_h3.send_datagram(self.stream_id, payload)
                self._dup_queued.append(self.server._datagrams_pending[-1])
            return
        self.datagram_bytes += len(payload)
        self._to_client(payload)

    def _on_event(self, connection: QuicConnection, event: QuicEvent, now: float) -> None:
        if isinstance(event, ConnectionTerminated):
            # Under long bursts QUIC's backed-off probes can go unanswered past its idle timeout
            # and the connection dies: the session ends there, its missing tokens never shown.
            self.died = True
        h3 = self.server_h3 if connection is self.server else self.client_h3
        for h3_event in h3.handle_event(event):
            if connection is self.server:
                self._server_event(h3_event, now)
            else:
                self._client_event(h3_event)

    def _server_event(self, event: H3Event, now: float) -> None:
        if isinstance(event, HeadersReceived):
            eloquent = [(HEADER, b"1")] if self.sender is not None else []
            self.server_h3.send_headers(
                event.stream_id,
                [(b":status", b"200"), (b"content-type", b"text/event-stream"), *eloquent],
            )
            for i in range(len(self.events)):
                self.path.call_at(now + i * TOKEN_GAP_S, partial(self._generate, i))
        elif isinstance(event, DatagramReceived) and self.sender is not None:
            self.server_lane.datagram(event.data)

    def _generate(self, i: int, now: float) -> None:
        if i == 0:  # bytes before the first token (the handshake, the request) are not its cost
            self.wire_before = self.path.bytes_sent[1]
        event = self.events[i]
        last = i == len(self.events) - 1
        if i < self.count:
            self.generated.append(now)
            cut = split_text(event)
            assert cut is not None
            self.text_bytes += len(cut[1])
        self.server_h3.send_data(self.stream_id, event, end_stream=last)
        if self.sender is not None:
            self.server_lane.body(event, ended=last)

    def _client_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            if (HEADER, b"1") in event.headers:
                self.client_lane.activate()
        elif isinstance(event, DataReceived):
            self.client_lane.stream(event.data)
            if event.stream_ended:
                self.client_lane.end()
        elif isinstance(event, DatagramReceived) and self.scheme != "stream":
            self.client_lane.datagram(event.data)

    def metrics(self) -> dict[str, float]:
        rendered = self.receiver.render_times()[: self.count]
        missing = len(self.generated) - len(rendered)
        # A session that died waits from its last render to its end: that wait is a stall too.
        shown = rendered + [self.end] * (missing > 0)
        end = max(shown[-1], self.generated[-1])
        wire = self.path.bytes_sent[1] - self.wire_before
        entries = self.sender.stats.entries if self.sender is not None else []
        return {
            "stall_ratio": stall_ratio(shown, end, session_start=self.generated[0]),
            "late_share": late_share(self.generated, [*rendered, *[None] * missing]),
            "died": float(self.died),
            "payload_redundancy": self.datagram_bytes / self.text_bytes,
            "wire_redundancy": (wire - self.text_bytes) / self.text_bytes,
            "tokens_per_datagram": float(np.median(entries)) if entries else 0.0,
            "mean_delay_s": float(np.mean(np.subtract(rendered, self.generated[: len(rendered)]))),
            "losses": sum(self.path.losses),
            "mismatches": self.receiver.stats.mismatches,
        }


def loss_limit(link: LinkConfig, count: int, size: int = 120) -> float:
    """The stall ratio of an ideal sender over this link's downlink: every token that has not
    got through yet goes in one packet per token, with no congestion control and no ACKs to
    lose. What no scheme that sends once per token can beat on this loss process."""
    _, down = link.directions()
    renders: list[float] = []
    behind = 0
    for i in range(count):
        behind += 1
        arrival = down.admit(size, 1.0 + i * TOKEN_GAP_S)
        if arrival is not None:
            renders += [arrival] * behind
            behind = 0
    if not renders:
        return 1.0
    end = max(renders[-1], 1.0 + (count - 1) * TOKEN_GAP_S)
    return stall_ratio(renders, end, session_start=1.0)


def run_session(job: tuple[str, str, float, int, str, float, int, tuple[Path, Path]]) -> dict:
    pattern, ack_loss, rtt, seed, scheme, rate_mbps, count, certificate = job
    bursts = LOSS_PATTERNS[pattern]
    link = LinkConfig(rate_bps=rate_mbps * 1e6, delay_s=rtt / 2, bursts=bursts, seed=seed)
    if ack_loss == "none":  # the uplink loses nothing; the downlink keeps its chain
        link = link.replace(bursts=None, downlink=link)
    session = Session(scheme, link, certificate, count)
    session.run()
    key = {"pattern": pattern, "ack_loss": ack_loss, "rtt_ms": int(rtt * 1000)}
    limit = {"loss_limit": loss_limit(link, count)} if scheme == "stream" else {}
    return key | {"scheme": scheme, "seed": seed} | session.metrics() | limit


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.eloquent_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=30.0, help="generation time per session")
    parser.add_argument(
        "--rtts",
        type=lambda s: [float(v) for v in s.split(",")],
        default=[0.1, 0.2, 0.4],
        help="seconds, comma-separated",
    )
    parser.add_argument("--patterns", nargs="+", default=list(LOSS_PATTERNS))
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    parser.add_argument("--rate-mbps", type=float, default=10.0)
    parser.add_argument(
        "--ack-loss",
        nargs="+",
        choices=("both", "none"),
        default=["both", "none"],
        help="both: the uplink (ACKs) loses packets as the downlink does; none: downlink only",
    )
    parser.add_argument("--jobs", type=int, default=max(1, multiprocessing.cpu_count()))
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    count = int(args.seconds / TOKEN_GAP_S)
    cases = [
        (p, a, r)
        for a in args.ack_loss
        for p in args.patterns
        for r in args.rtts
        if p == "default" or r == max(args.rtts)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        certificate = ensure_certificate(Path(tmp), deterministic=True)
        jobs = [
            (p, a, r, seed, scheme, args.rate_mbps, count, certificate)
            for p, a, r in cases
            for scheme in args.schemes
            for seed in range(args.sessions)
        ]
        with multiprocessing.Pool(args.jobs) as pool:
            rows = list(tqdm(pool.imap(run_session, jobs), total=len(jobs), unit="session"))
    write_csv(args.results / "eloquent_sim.csv", rows)
    summary = report(rows, cases, args.schemes)
    plot(summary, cases, args.schemes, args.results / "eloquent_sim.png")
    print(f"wrote {args.results / 'eloquent_sim.csv'} and .png")
    return 0


Case = tuple[str, str, float]
"""(loss pattern, ACK loss, RTT in seconds)."""


def report(rows: list[dict], cases: list[Case], schemes: list[str]) -> dict:
    keys = ("stall_ratio", "late_share", "payload_redundancy", "wire_redundancy",
            "tokens_per_datagram", "died")  # fmt: skip
    summary = {}
    for pattern, ack_loss, rtt in cases:
        where = "both ways" if ack_loss == "both" else "on the downlink only"
        print(
            f"\n{pattern} loss ({LOSS_PATTERNS[pattern].mean_loss:.0%} mean) {where}, RTT "
            f"{rtt * 1000:.0f} ms: means over sessions"
        )
        print(
            f"{'scheme':>10} {'stall':>8} {'late':>8} {'redund. payload':>16} {'wire':>8} "
            f"{'tokens/dgram':>13} {'died':>6}"
        )
        for scheme in schemes:
            group = [r for r in rows if (r["pattern"], r["ack_loss"], r["rtt_ms"], r["scheme"])
                     == (pattern, ack_loss, int(rtt * 1000), scheme)]  # fmt: skip
            means = {k: float(np.mean([r[k] for r in group])) for k in keys}
            summary[pattern, ack_loss, rtt, scheme] = means
            print(
                f"{scheme:>10} {means['stall_ratio']:>8.2%} {means['late_share']:>8.2%} "
                f"{means['payload_redundancy']:>16.2f} {means['wire_redundancy']:>8.2f} "
                f"{means['tokens_per_datagram']:>13.1f} {means['died']:>6.0%}"
            )
        if "stream" in schemes:
            limit = float(np.mean([r["loss_limit"] for r in rows if "loss_limit" in r and
                                   (r["pattern"], r["ack_loss"], r["rtt_ms"])
                                   == (pattern, ack_loss, int(rtt * 1000))]))  # fmt: skip
            base = summary[pattern, ack_loss, rtt, "stream"]
            print(f"  the loss process's limit (one packet a token, no congestion control): "
                  f"{limit:.2%}, {change({'s': limit}, {'s': base['stall_ratio']}, 's')} "
                  "against the stream")  # fmt: skip
        if {"stream", "eloquent"} <= set(schemes):
            el = summary[pattern, ack_loss, rtt, "eloquent"]
            dups = [s for s in schemes if s.startswith("dup-")]
            line = (
                f"  eloquent vs stream: stall {change(el, base, 'stall_ratio')}, "
                f"late tokens {change(el, base, 'late_share')}"
            )
            if dups:
                best = min(dups, key=lambda s: summary[pattern, ack_loss, rtt, s]["stall_ratio"])
                other = summary[pattern, ack_loss, rtt, best]
                line += (
                    f"; vs best duplication ({best}): stall "
                    f"{change(el, other, 'stall_ratio')}, payload redundancy "
                    f"{el['payload_redundancy']:.2f} vs {other['payload_redundancy']:.2f}"
                )
            print(line)
    return summary


def change(new: dict, old: dict, key: str) -> str:
    if old[key] == 0:
        return "n/a (baseline 0)"
    return f"{(new[key] - old[key]) / old[key]:+.1%}"


def plot(summary: dict, cases: list[Case], schemes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({a for _, a, _ in cases})
    columns = [(p, r) for p, r in dict.fromkeys((p, r) for p, _, r in cases)]
    fig, axes = plt.subplots(
        len(rows), len(columns), figsize=(4 * len(columns), 4 * len(rows)), squeeze=False
    )
    for pattern, ack_loss, rtt in cases:
        ax = axes[rows.index(ack_loss)][columns.index((pattern, rtt))]
        for scheme in schemes:
            m = summary[pattern, ack_loss, rtt, scheme]
            ax.scatter(m["payload_redundancy"], m["stall_ratio"] * 100, label=scheme, s=40)
        ax.set(
            xlabel="redundancy (datagram payload / text)",
            ylabel="stall ratio (%)",
            title=f"{pattern}, RTT {rtt * 1000:.0f} ms, ACK loss: {ack_loss}",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
