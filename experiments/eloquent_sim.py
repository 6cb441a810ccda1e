"""`python -m experiments.eloquent_sim`: seed 002 Figures 5 and 6 on the real QUIC stack, in
virtual time.

A real aioquic client and server, with HTTP/3 and datagrams on, talk through a simulated link
(`transport.simlink`) with bursty Gilbert-Elliott loss, one chain per direction. The server
answers one request by generating a token every 100 ms for 30 s. Every token goes on the HTTP/3
response stream, which QUIC delivers reliably and in order; the schemes differ in what else is
sent:
- `stream`: nothing else; a lost packet is repaired by QUIC's retransmission.
- `dup-k`: each token also in k datagrams, each in its own packet.
- `eloquent`: the token, with the earlier unacknowledged ones, in one datagram
  (`transport.eloquent`, the paper's 10 tokens a packet); unacknowledged ones are re-sent after
  200 ms without a new token, and the client acknowledges by datagram.
The client renders the longest contiguous prefix from whichever path delivers first.

Metrics (seed 002 §4): the stall ratio (time in inter-render gaps over 200 ms, over the session,
from the first token's generation to the last render); the share of late tokens (rendered over
400 ms after generation); the redundancy rate, counted two ways: on the wire (every UDP byte
sent toward the client, headers included, over the token bytes) and in payload (stream bytes
once plus datagram payloads, over the token bytes; QUIC's own retransmissions are in the wire
count only). Loss patterns are given as mean durations (the seed's p and q are ambiguous):

    default  good 1000 ms, lossy 200 ms at 90% loss, 100 ms slots: ~15% loss (p=0.9, q=0.5)
    frequent good  200 ms, lossy 200 ms at 90% loss: ~45% loss       (p=0.5, q=0.5)
    long     good 1000 ms, lossy 500 ms at 90% loss: ~30% loss       (p=0.9, q=0.8)

Writes results/eloquent_sim.csv and .png and prints the table with the targets' checks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from aioquic.buffer import Buffer, size_uint_var
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent
from tqdm import tqdm

from experiments.output import write_csv
from transport.eloquent import (
    EloquentReceiver,
    EloquentSender,
    TokenEntry,
    Tokens,
    late_share,
    stall_ratio,
)
from transport.link import GilbertElliott, LinkConfig
from transport.simlink import SimulatedPath
from transport.tls import ensure_certificate
from workloads.examples import corpus

LOSS_PATTERNS = {
    "default": GilbertElliott(good_slots=10, bad_slots=2),
    "frequent": GilbertElliott(good_slots=2, bad_slots=2),
    "long": GilbertElliott(good_slots=10, bad_slots=5),
}
SCHEMES = ("stream", "dup-2", "dup-3", "dup-4", "dup-5", "eloquent")
TOKEN_GAP_S = 0.1
PAPER_T = 10
"""Tokens per packet in seed 002 (§4.1), the new one included."""


def tokens(n: int) -> list[bytes]:
    """n word-sized tokens of English text, as an LLM would stream them."""
    words = corpus().split()
    return [(" " + words[i % len(words)]).encode() for i in range(n)]


def _frame(data: bytes) -> bytes:
    """A token on the stream: varint length, then the bytes, so the client can cut them apart."""
    buf = Buffer(capacity=size_uint_var(len(data)) + len(data))
    buf.push_uint_var(len(data))
    buf.push_bytes(data)
    return buf.data


@dataclass
class Session:
    """One response of `count` tokens over a lossy link, in virtual time."""

    scheme: str
    link: LinkConfig
    certificate: tuple[Path, Path]
    count: int = 300
    generated: list[float] = field(default_factory=list)
    token_bytes: int = 0
    datagram_bytes: int = 0
    stream_bytes: int = 0
    wire_before: int = 0
    died: bool = False

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
        self.server = QuicConnection(
            configuration=server_config,
            original_destination_connection_id=self.client.original_destination_connection_id,
        )
        self.client_h3 = H3Connection(self.client, enable_webtransport=True)
        self.server_h3 = H3Connection(self.server, enable_webtransport=True)
        self.receiver = EloquentReceiver()
        self.sender = EloquentSender(max_repeats=PAPER_T - 1)
        self._pending = b""
        self._position = 0
        self._timer_at: float | None = None
        self.path = SimulatedPath(self.client, self.server, self.link, self._on_event)
        self.path.run(until=lambda: self.client._handshake_complete, timeout=timeout)
        self.stream_id = self.client.get_next_available_stream_id()
        self.client_h3.send_headers(
            self.stream_id,
            [
                (b":method", b"POST"),
                (b":scheme", b"https"),
                (b":authority", b"sim"),
                (b":path", b"/v1/chat/completions"),
                (b"x-eloquent", b"1"),
            ],
            end_stream=True,
        )
        self.path.run(
            until=lambda: self.died or self.receiver.next_position >= self.count, timeout=timeout
        )
        self.end = self.path.now

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
                self._client_event(h3_event, now)

    def _server_event(self, event: H3Event, now: float) -> None:
        if isinstance(event, HeadersReceived):
            self.server_h3.send_headers(event.stream_id, [(b":status", b"200")])
            self.text = tokens(self.count)
            start = now
            for i in range(self.count):
                self.path.call_at(start + i * TOKEN_GAP_S, lambda at, i=i: self._generate(i, at))
        elif isinstance(event, DatagramReceived) and self.scheme == "eloquent":
            self.sender.on_ack(event.data, now)
            self._arm(now)

    def _generate(self, i: int, now: float) -> None:
        if i == 0:  # bytes before the first token (the handshake, the request) are not its cost
            self.wire_before = self.path.bytes_sent[1]
        data = self.text[i]
        self.generated.append(now)
        self.token_bytes += len(data)
        framed = _frame(data)
        self.stream_bytes += len(framed)
        self.server_h3.send_data(self.stream_id, framed, end_stream=i == self.count - 1)
        if self.scheme.startswith("dup-"):
            payload = Tokens((TokenEntry(i, data),)).encode()
            for _ in range(int(self.scheme.removeprefix("dup-"))):
                self.path.transmit()  # each copy in a packet of its own, or copies die together
                self._datagram(payload)
        elif self.scheme == "eloquent":
            for payload in self.sender.on_tokens(data, now):
                self._datagram(payload)
            if i == self.count - 1:
                self.sender.finish()
            self._arm(now)

    def _datagram(self, payload: bytes) -> None:
        self.datagram_bytes += len(payload)
        self.server_h3.send_datagram(self.stream_id, payload)

    def _arm(self, now: float) -> None:
        """Keep one application timer pending for the sender's next re-send."""
        due = self.sender.timer()
        if due is None or (self._timer_at is not None and self._timer_at <= due):
            return
        self._timer_at = due
        self.path.call_at(due, self._fire)

    def _fire(self, now: float) -> None:
        self._timer_at = None
        for payload in self.sender.on_timer(now):
            self._datagram(payload)
        self._arm(now)

    def _client_event(self, event: H3Event, now: float) -> None:
        if isinstance(event, DataReceived):
            self._pending += event.data
            buf = Buffer(data=self._pending)
            while not buf.eof():
                start = buf.tell()
                try:
                    data = buf.pull_bytes(buf.pull_uint_var())
                except Exception:  # a token cut across two stream deliveries
                    buf.seek(start)
                    break
                ack = self.receiver.on_stream_delta(self._position, data, now)
                self._position += 1
                if ack is not None and self.scheme == "eloquent":
                    self.client_h3.send_datagram(self.stream_id, ack)
            self._pending = self._pending[buf.tell() :]
        elif isinstance(event, DatagramReceived) and self.scheme != "stream":
            ack = self.receiver.on_datagram(event.data, now)
            if self.scheme == "eloquent":
                self.client_h3.send_datagram(self.stream_id, ack)

    def metrics(self) -> dict[str, float]:
        rendered = self.receiver.render_times()
        missing = len(self.generated) - len(rendered)
        # A session that died waits from its last render to its end: that wait is a stall too.
        shown = rendered + [self.end] * (missing > 0)
        end = max(shown[-1], self.generated[-1])
        wire = self.path.bytes_sent[1] - self.wire_before
        return {
            "stall_ratio": stall_ratio(shown, end, session_start=self.generated[0]),
            "late_share": late_share(self.generated, [*rendered, *[None] * missing]),
            "died": float(self.died),
            "wire_redundancy": (wire - self.token_bytes) / self.token_bytes,
            "payload_redundancy": (self.stream_bytes + self.datagram_bytes - self.token_bytes)
            / self.token_bytes,
            "mean_delay_s": float(np.mean(np.subtract(rendered, self.generated[: len(rendered)]))),
            "losses": sum(self.path.losses),
        }


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
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    count = int(args.seconds / TOKEN_GAP_S)
    cases = [
        (p, r) for p in args.patterns for r in args.rtts if p == "default" or r == max(args.rtts)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        certificate = ensure_certificate(Path(tmp), deterministic=True)
        total = len(cases) * len(args.schemes) * args.sessions
        with tqdm(total=total, unit="session") as bar:
            for pattern, rtt in cases:
                for scheme in args.schemes:
                    for seed in range(args.sessions):
                        link = LinkConfig(
                            rate_bps=args.rate_mbps * 1e6,
                            delay_s=rtt / 2,
                            bursts=LOSS_PATTERNS[pattern],
                            seed=seed,
                        )
                        session = Session(scheme, link, certificate, count)
                        session.run()
                        rows.append(
                            {
                                "pattern": pattern,
                                "rtt_ms": int(rtt * 1000),
                                "scheme": scheme,
                                "seed": seed,
                            }
                            | session.metrics()
                        )
                        bar.update(1)
    write_csv(args.results / "eloquent_sim.csv", rows)
    summary = report(rows, cases, args.schemes)
    plot(summary, cases, args.schemes, args.results / "eloquent_sim.png")
    print(f"wrote {args.results / 'eloquent_sim.csv'} and .png")
    return 0


def report(rows: list[dict], cases: list[tuple[str, float]], schemes: list[str]) -> dict:
    keys = ("stall_ratio", "late_share", "payload_redundancy", "wire_redundancy", "died")
    summary = {}
    for pattern, rtt in cases:
        print(
            f"\n{pattern} loss ({LOSS_PATTERNS[pattern].mean_loss:.0%} mean), RTT "
            f"{rtt * 1000:.0f} ms: means over sessions"
        )
        print(
            f"{'scheme':>10} {'stall':>8} {'late':>8} {'redund. payload':>16} {'wire':>8} "
            f"{'died':>6}"
        )
        for scheme in schemes:
            group = [r for r in rows if r["pattern"] == pattern and r["rtt_ms"] == int(rtt * 1000)
                     and r["scheme"] == scheme]  # fmt: skip
            means = {k: float(np.mean([r[k] for r in group])) for k in keys}
            summary[pattern, rtt, scheme] = means
            print(
                f"{scheme:>10} {means['stall_ratio']:>8.2%} {means['late_share']:>8.2%} "
                f"{means['payload_redundancy']:>16.2f} {means['wire_redundancy']:>8.2f} "
                f"{means['died']:>6.0%}"
            )
        if {"stream", "eloquent"} <= set(schemes):
            el = summary[pattern, rtt, "eloquent"]
            base = summary[pattern, rtt, "stream"]
            dups = [s for s in schemes if s.startswith("dup-")]
            line = (
                f"  eloquent vs stream: stall {change(el, base, 'stall_ratio')}, "
                f"late tokens {change(el, base, 'late_share')}"
            )
            if dups:
                best = min(dups, key=lambda s: summary[pattern, rtt, s]["stall_ratio"])
                other = summary[pattern, rtt, best]
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


def plot(summary: dict, cases: list[tuple[str, float]], schemes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 4), squeeze=False)
    for ax, (pattern, rtt) in zip(axes[0], cases, strict=True):
        for scheme in schemes:
            m = summary[pattern, rtt, scheme]
            ax.scatter(m["payload_redundancy"], m["stall_ratio"] * 100, label=scheme, s=40)
        ax.set(
            xlabel="redundancy (payload)",
            ylabel="stall ratio (%)",
            title=f"{pattern}, RTT {rtt * 1000:.0f} ms",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
