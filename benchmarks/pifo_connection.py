"""Stream-management overhead of PIFO against the sorted-list ABS, through a real connection.

`scheduler_overhead.py` times the two schedulers alone. Here the same workload (chapter 2 of
Chuppala (2024): every stream a priority from 1 to 10, seeded random, and 10 KB) goes through a
real aioquic connection pair: a client `ScheduledQuicConnection` opens all N streams at once, each
tagged with `set_stream_spec` and written in full with end_stream, and sends them to a server over
`netsim.simlink.SimulatedPath` in virtual time. The client's scheduler is `abs` or `pifo`; the
server (untimed, `fcfs`) answers each finished request with an empty end_stream, as a response
would, so that every stream closes on both sides and the client's connection removes it from its
scheduler, as it does in service. A run ends when the server has received every byte and the
client's scheduler is empty.

Choices, and why:
- link: 5 Mbit/s, 25 ms one way, no loss, 64 KB drop-tail queue (netsim.link's defaults, the
  thesis's rate). Time is virtual, so the rate does not make a run slower to wait for; the wall
  time goes on Python work per packet, and the packet count barely depends on the rate.
- packets: 9,000-byte datagrams (a jumbo frame; `--datagram-bytes`), 2 per 10 KB stream,
  rather than aioquic's 1,200 (9 per stream, as scheduler_overhead.py counts). Every packet
  the client builds walks all N streams twice, in Python (aioquic's stream-limits pass, and
  ScheduledQuicConnection's scan for streams with bytes), so a run costs about N x packets:
  on a 2-core Xeon, 10,000 streams took 13 minutes a run at 1,200 bytes (one pifo run: 761 s,
  the scheduler 0.9% of it), 3 at 9,000. The scheduler's share is small either way (README).
- stream limits: the server advertises N bidirectional streams (aioquic's default is 128,
  raised only as streams close), and connection credit for all the bytes, so all N streams
  are open and competing from the start, as in the standalone benchmark.
- timing: only the calls the connection makes to its scheduler are timed (add, pop, requeue,
  remove, update, expired, next_deadline and `in`), each on its own with time.perf_counter,
  minus the calibrated cost of an empty interval, as in scheduler_overhead.py. The run's
  wall time and the time in the client's `datagrams_to_send` (which builds every packet:
  aioquic's walk of every stream per packet, ScheduledQuicConnection's scan for streams with
  bytes, and the scheduler) are reported beside it. The garbage collector is off while a run
  is timed. Rounds alternate which policy runs first; the table shows medians.
- sanity: both policies must complete the streams (end_stream received at the server) in the
  same order, in every round; the simulation is deterministic, so they do.

    python -m benchmarks.pifo_connection [--sizes 1000 10000] [--rounds 3] [--seed 0]
                                         [--rate-mbps 5] [--datagram-bytes 9000]
                                         [--out results/pifo_connection/]
"""

from __future__ import annotations

import argparse
import csv
import gc
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent, StreamDataReceived
from tqdm import tqdm

from benchmarks.common import machine, timer_overhead_s
from netsim.link import LinkConfig
from netsim.simlink import SimulatedPath
from transport.connection import ScheduledQuicConnection
from transport.schedulers import Scheduler, StreamSpec, make_scheduler
from transport.tls import ensure_certificate

ROOT = Path(__file__).resolve().parent.parent

STREAM_BYTES = 10_000  # 10 KB per stream, as in the thesis
POLICIES = ("pifo", "abs")
OPS = ("add", "pop", "requeue", "remove", "update", "expired", "next_deadline", "contains")


@dataclass
class Run:
    policy: str
    streams: int
    seconds: dict[str, float]  # scheduler time per operation kind, timer overhead subtracted
    counts: dict[str, int]
    wall_s: float  # opening the streams and running until every one is closed
    send_s: float  # in the client's datagrams_to_send (packet building, scheduler included)
    client_datagrams: int
    virtual_s: float  # link time the transfer took
    order: list[int]  # stream ids in the order the server received their end_stream
    max_rss_mb: float

    @property
    def scheduler_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def ops(self) -> int:
        return sum(self.counts.values())


class Timings:
    """Accumulated perf_counter intervals and call counts, per scheduler operation."""

    def __init__(self) -> None:
        self.raw = dict.fromkeys(OPS, 0.0)
        self.counts = dict.fromkeys(OPS, 0)

    def seconds(self, overhead_s: float) -> dict[str, float]:
        return {op: max(0.0, self.raw[op] - self.counts[op] * overhead_s) for op in OPS}


def instrument(scheduler: Scheduler) -> Timings:
    """Time every call the connection makes to `scheduler`, each on its own.

    The methods are replaced on the instance, which the connection reaches through
    `self.scheduler.<name>`, so the connection code runs unchanged. Each wrapper has the exact
    signature the connection calls with (positional arguments, no *args to unpack inside the
    interval), so an interval holds the call itself, as in scheduler_overhead.py. `in` is a
    dunder, looked up on the type, so it goes through a one-off subclass instead. abs and pifo
    never call their own public methods, so nothing is counted twice."""
    t = Timings()
    raw, counts = t.raw, t.counts
    pc = time.perf_counter
    add, pop, requeue = scheduler.add, scheduler.pop, scheduler.requeue
    remove, update = scheduler.remove, scheduler.update
    expired, next_deadline = scheduler.expired, scheduler.next_deadline

    def timed_add(stream_id: int, spec: StreamSpec) -> None:
        t0 = pc()
        add(stream_id, spec)
        t1 = pc()
        raw["add"] += t1 - t0
        counts["add"] += 1

    def timed_pop(now: float) -> int | None:
        t0 = pc()
        stream_id = pop(now)
        t1 = pc()
        raw["pop"] += t1 - t0
        counts["pop"] += 1
        return stream_id

    def timed_requeue(stream_id: int, sent: int, now: float) -> None:
        t0 = pc()
        requeue(stream_id, sent, now)
        t1 = pc()
        raw["requeue"] += t1 - t0
        counts["requeue"] += 1

    def timed_remove(stream_id: int) -> None:
        t0 = pc()
        remove(stream_id)
        t1 = pc()
        raw["remove"] += t1 - t0
        counts["remove"] += 1

    def timed_update(stream_id: int, spec: StreamSpec) -> None:
        t0 = pc()
        update(stream_id, spec)
        t1 = pc()
        raw["update"] += t1 - t0
        counts["update"] += 1

    def timed_expired(now: float) -> list[int]:
        t0 = pc()
        result = expired(now)
        t1 = pc()
        raw["expired"] += t1 - t0
        counts["expired"] += 1
        return result

    def timed_next_deadline() -> float | None:
        t0 = pc()
        result = next_deadline()
        t1 = pc()
        raw["next_deadline"] += t1 - t0
        counts["next_deadline"] += 1
        return result

    base = type(scheduler)
    contains = base.__contains__

    def timed_contains(self: Scheduler, stream_id: object) -> bool:
        t0 = pc()
        result = contains(self, stream_id)
        t1 = pc()
        raw["contains"] += t1 - t0
        counts["contains"] += 1
        return result

    scheduler.__class__ = type(f"Timed{base.__name__}", (base,), {"__contains__": timed_contains})
    wrappers: dict[str, Callable[..., Any]] = {
        "add": timed_add,
        "pop": timed_pop,
        "requeue": timed_requeue,
        "remove": timed_remove,
        "update": timed_update,
        "expired": timed_expired,
        "next_deadline": timed_next_deadline,
    }
    for name, wrapper in wrappers.items():
        setattr(scheduler, name, wrapper)
    return t


def run_once(
    policy: str,
    priorities: list[int],
    certificate: tuple[Path, Path],
    link: LinkConfig,
    overhead_s: float,
    datagram_bytes: int,
) -> Run:
    """One connection pair; the client opens every stream at once and sends it in full."""
    n = len(priorities)
    client_config = QuicConfiguration(
        is_client=True, alpn_protocols=["bench"], max_datagram_size=datagram_bytes
    )
    client_config.verify_mode = 0
    scheduler = make_scheduler(policy)
    client = ScheduledQuicConnection(configuration=client_config, scheduler=scheduler)
    server_config = QuicConfiguration(
        is_client=False,
        alpn_protocols=["bench"],
        # Credit for every byte, so flow control never holds a stream back.
        max_data=n * STREAM_BYTES + 2**20,
        max_stream_data=2**20,
    )
    server_config.load_cert_chain(*map(str, certificate))
    server = ScheduledQuicConnection(
        configuration=server_config,
        original_destination_connection_id=client.original_destination_connection_id,
        scheduler="fcfs",
    )
    # aioquic lets a peer open 128 bidirectional streams and raises that by one per stream
    # closed; there is no configuration option, and the limit goes out in the transport
    # parameters at the handshake, so it is set before that: all N streams open at once.
    server._local_max_streams_bidi.value = n

    received: dict[int, int] = {}
    order: list[int] = []

    def on_event(connection: QuicConnection, event: QuicEvent, now: float) -> None:
        if connection is server and isinstance(event, StreamDataReceived):
            received[event.stream_id] = received.get(event.stream_id, 0) + len(event.data)
            if event.end_stream:
                order.append(event.stream_id)
                # The response: an empty end_stream closes the stream on both sides, so the
                # client discards it and removes it from its scheduler.
                server.send_stream_data(event.stream_id, b"", end_stream=True)

    path = SimulatedPath(client, server, link, on_event)
    path.run(until=lambda: client._handshake_complete)

    timings = instrument(scheduler)
    send_s = 0.0
    datagrams = 0
    datagrams_to_send = client.datagrams_to_send
    pc = time.perf_counter

    def timed_datagrams_to_send(now: float) -> list[tuple[bytes, Any]]:
        nonlocal send_s, datagrams
        t0 = pc()
        result = datagrams_to_send(now)
        send_s += pc() - t0
        datagrams += len(result)
        return result

    client.datagrams_to_send = timed_datagrams_to_send  # type: ignore[method-assign]

    payload = b"x" * STREAM_BYTES
    specs = [StreamSpec(priority=p) for p in priorities]
    # Generous: the transfer needs n * 10 KB / rate of link time, plus slow start.
    timeout = path.now + 3 * n * STREAM_BYTES * 8 / link.rate_bps + 60
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        start_virtual = path.now
        for spec in specs:
            stream_id = client.get_next_available_stream_id()
            client.set_stream_spec(stream_id, spec)  # before the stream exists: kept for add
            client.send_stream_data(stream_id, payload, end_stream=True)
        path.run(until=lambda: len(order) == n and len(scheduler) == 0, timeout=timeout)
        wall = time.perf_counter() - started
    finally:
        gc.enable()
    assert len(received) == n, "every stream arrives"
    assert all(b == STREAM_BYTES for b in received.values()), "every byte arrives"
    return Run(
        policy,
        n,
        timings.seconds(overhead_s),
        dict(timings.counts),
        wall,
        send_s,
        datagrams,
        path.now - start_virtual,
        order,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate-mbps", type=float, default=5.0)
    parser.add_argument("--datagram-bytes", type=int, default=9000)
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one way")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "pifo_connection")
    args = parser.parse_args()

    where = machine()
    overhead_s = timer_overhead_s()
    link = LinkConfig(rate_bps=args.rate_mbps * 1e6, delay_s=args.delay_ms / 1e3, seed=args.seed)
    print(f"machine: {where}")
    print(
        f"workload: {STREAM_BYTES} B per stream, priorities 1-10 (seed {args.seed}), all opened "
        f"at once on the client; link {args.rate_mbps:g} Mbit/s, {args.delay_ms:g} ms one way, "
        f"no loss, {link.queue_bytes // 1024} KB queue; {args.datagram_bytes} B datagrams; "
        f"{args.rounds} rounds, medians shown"
    )
    print(f"timer: an empty perf_counter interval costs {overhead_s * 1e9:.0f} ns, subtracted")

    # Same generator as scheduler_overhead.py, so the two benchmarks see the same priorities.
    workloads = {
        n: [random.Random(f"{args.seed}/{n}").randint(1, 10) for _ in range(n)] for n in args.sizes
    }
    runs: dict[tuple[str, int], list[Run]] = {(p, n): [] for p in POLICIES for n in args.sizes}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as certs:
        # Ed25519: fixed-size signatures, so every handshake (and run) is the same.
        certificate = ensure_certificate(Path(certs), deterministic=True)
        bar = tqdm(total=args.rounds * len(args.sizes) * len(POLICIES), unit="run")
        for r in range(args.rounds):
            order = POLICIES if r % 2 == 0 else POLICIES[::-1]
            for n in args.sizes:
                for policy in order:
                    bar.set_description(f"round {r + 1} {policy} {n}")
                    runs[policy, n].append(
                        run_once(
                            policy, workloads[n], certificate, link, overhead_s, args.datagram_bytes
                        )
                    )
                    bar.update()
        bar.close()
    total_wall = time.perf_counter() - started

    rows = []
    for n in args.sizes:
        reference = runs["pifo", n][0].order
        same_order = all(r.order == reference for p in POLICIES for r in runs[p, n])
        for policy in POLICIES:
            rs = runs[policy, n]
            sched = statistics.median(r.scheduler_s for r in rs)
            wall = statistics.median(r.wall_s for r in rs)
            send = statistics.median(r.send_s for r in rs)
            row: dict[str, Any] = {
                "streams": n,
                "scheduler": policy,
                "bytes_per_stream": STREAM_BYTES,
                "rate_mbps": args.rate_mbps,
                "datagram_bytes": args.datagram_bytes,
                "rounds": len(rs),
                "ops": rs[0].ops,
                "client_datagrams": rs[0].client_datagrams,
                "virtual_s": rs[0].virtual_s,
                "scheduler_s_median": sched,
                "scheduler_s_min": min(r.scheduler_s for r in rs),
                "scheduler_s_max": max(r.scheduler_s for r in rs),
                "wall_s_median": wall,
                "client_send_s_median": send,
                "scheduler_share_of_wall": sched / wall,
                "scheduler_share_of_client_send": sched / send,
                "same_completion_order": same_order,
            }
            for op in OPS:
                count = rs[0].counts[op]
                row[f"{op}_count"] = count
                row[f"{op}_ns_median"] = (
                    statistics.median(r.seconds[op] for r in rs) / count * 1e9 if count else 0.0
                )
            row["max_rss_mb"] = max(r.max_rss_mb for r in rs)
            row["timer_overhead_ns"] = overhead_s * 1e9
            row["machine"] = where
            rows.append(row)
        pifo, abs_ = rows[-2], rows[-1]
        ratio = abs_["scheduler_s_median"] / pifo["scheduler_s_median"]
        pifo["ratio_abs_over_pifo"] = abs_["ratio_abs_over_pifo"] = ratio

    header = (
        f"{'streams':>8} {'sched ops':>10} {'abs ms':>9} {'pifo ms':>9} {'abs/pifo':>9} "
        f"{'abs wall s':>11} {'pifo wall s':>12} {'abs share':>10} {'pifo share':>11} "
        f"{'same order':>11}"
    )
    print()
    print(header)
    print("-" * len(header))
    for i in range(0, len(rows), 2):
        pifo, abs_ = rows[i], rows[i + 1]
        print(
            f"{pifo['streams']:>8} {pifo['ops']:>10} {abs_['scheduler_s_median'] * 1e3:>9.1f} "
            f"{pifo['scheduler_s_median'] * 1e3:>9.1f} {pifo['ratio_abs_over_pifo']:>8.2f}x "
            f"{abs_['wall_s_median']:>11.1f} {pifo['wall_s_median']:>12.1f} "
            f"{abs_['scheduler_share_of_wall']:>10.2%} {pifo['scheduler_share_of_wall']:>11.2%} "
            f"{'yes' if pifo['same_completion_order'] else 'NO':>11}"
        )
    print()
    print("where the wall time goes (medians): the client's datagrams_to_send builds every packet")
    print(
        f"{'streams':>8} {'scheduler':>9} {'datagrams':>10} {'virtual s':>10} {'wall s':>8} "
        f"{'client send s':>14} {'sched/send':>11} {'max RSS MB':>11}"
    )
    for row in rows:
        print(
            f"{row['streams']:>8} {row['scheduler']:>9} {row['client_datagrams']:>10} "
            f"{row['virtual_s']:>10.1f} {row['wall_s_median']:>8.1f} "
            f"{row['client_send_s_median']:>14.1f} {row['scheduler_share_of_client_send']:>11.2%} "
            f"{row['max_rss_mb']:>11.0f}"
        )
    print()
    shown = [op for op in OPS if rows[0][f"{op}_count"]]
    print("ns per operation, by kind (medians); calls per run in brackets:")
    print(f"{'streams':>8} {'scheduler':>9} " + " ".join(f"{op:>18}" for op in shown))
    for row in rows:
        cells = [f"{row[f'{op}_ns_median']:.0f} [{row[f'{op}_count']}]" for op in shown]
        print(f"{row['streams']:>8} {row['scheduler']:>9} " + " ".join(f"{c:>18}" for c in cells))
    print(f"\nwall time {total_wall:.1f} s")

    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "pifo_connection.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {csv_path}")


if __name__ == "__main__":
    main()
