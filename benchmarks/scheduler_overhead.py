"""Stream-management overhead of the heap PIFO against the sorted-list ABS, as streams scale.

Mirrors chapter 2 of Chuppala (2024) ("PIFO Scalability Benchmarks"): every stream gets a priority
from 1 to 10 (seeded random) and carries 10 KB, sent in packets of 1200 bytes. All streams are
opened at once (added in arrival order); then, per packet, the connection pops one stream, serves
it one packet's worth, and requeues it, or removes it once its last byte is out. Both policies
serve the streams in the same order (higher priority first, FCFS within a level), so they do the
same operations and only the data structure differs:
  abs   a list kept sorted with bisect.insort, popped with list.pop(0): both shift the list, O(n)
  pifo  a binary heap with lazy deletion: O(log n); a pop and the requeue of the same stream
        are one heapreplace, and none at all when its rank is unchanged
Both run the same bookkeeping (transport.schedulers._RankScheduler: one packed int rank per
stream, built at add; no spec, arrival or popped-set lookups per call), so what differs is the
data structure alone.

Only the scheduler calls are timed (add, pop, requeue, remove), each on its own with
time.perf_counter; the cost of an empty perf_counter interval is calibrated first and subtracted
(it is printed). The garbage collector is off while a run is timed, as in timeit. Rounds
alternate which policy runs first, so drift on a noisy machine touches both alike; the table
shows medians over rounds.

    python -m benchmarks.scheduler_overhead [--sizes 1000 10000 100000] [--rounds 3] [--seed 0]
                                            [--packets-per-stream N] [--out results/]
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.common import machine, timer_overhead_s
from transport.schedulers import StreamSpec, make_scheduler

ROOT = Path(__file__).resolve().parent.parent

STREAM_BYTES = 10_000  # 10 KB per stream, as in the thesis
PACKET_BYTES = 1200
LINK_BPS = 5e6  # the thesis's 5 Mbps: only sets the virtual clock passed as `now`
POLICIES = ("pifo", "abs")
OPS = ("add", "pop", "requeue", "remove")


@dataclass
class Run:
    policy: str
    streams: int
    seconds: dict[str, float]  # per operation kind, timer overhead subtracted
    counts: dict[str, int]

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def ops(self) -> int:
        return sum(self.counts.values())


def run_once(policy: str, priorities: list[int], packets_per_stream: int, overhead_s: float) -> Run:
    """All streams added, then one pop/serve/requeue per packet until every stream is done."""
    n = len(priorities)
    specs = [StreamSpec(priority=p) for p in priorities]
    left = [packets_per_stream] * n
    tick = PACKET_BYTES * 8 / LINK_BPS
    scheduler = make_scheduler(policy)
    add = pop = requeue = remove = 0.0
    n_pop = n_requeue = n_remove = 0
    pc = time.perf_counter
    now = 0.0

    gc.collect()
    gc.disable()
    try:
        for stream_id in range(n):
            spec = specs[stream_id]
            t0 = pc()
            scheduler.add(stream_id, spec)
            add += pc() - t0
        while True:
            t0 = pc()
            popped = scheduler.pop(now)
            pop += pc() - t0
            n_pop += 1
            if popped is None:
                break
            now += tick
            left[popped] -= 1
            if left[popped]:
                t0 = pc()
                scheduler.requeue(popped, PACKET_BYTES, now)
                requeue += pc() - t0
                n_requeue += 1
            else:
                t0 = pc()
                scheduler.remove(popped)
                remove += pc() - t0
                n_remove += 1
    finally:
        gc.enable()
    assert n_remove == n and len(scheduler) == 0, "every stream must finish"
    counts = {"add": n, "pop": n_pop, "requeue": n_requeue, "remove": n_remove}
    raw = {"add": add, "pop": pop, "requeue": requeue, "remove": remove}
    seconds = {k: max(0.0, raw[k] - counts[k] * overhead_s) for k in OPS}
    return Run(policy, n, seconds, counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--packets-per-stream",
        type=int,
        default=math.ceil(STREAM_BYTES / PACKET_BYTES),
        help="packets each stream is served (default: all of its 10 KB, i.e. 9)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()

    where = machine()
    overhead_s = timer_overhead_s()
    print(f"machine: {where}")
    print(
        f"workload: {STREAM_BYTES} B per stream, {PACKET_BYTES} B packets -> "
        f"{args.packets_per_stream} packets per stream, priorities 1-10 (seed {args.seed}), "
        f"{args.rounds} rounds, medians shown"
    )
    print(f"timer: an empty perf_counter interval costs {overhead_s * 1e9:.0f} ns, subtracted")

    workloads = {
        n: [random.Random(f"{args.seed}/{n}").randint(1, 10) for _ in range(n)] for n in args.sizes
    }
    runs: dict[tuple[str, int], list[Run]] = {(p, n): [] for p in POLICIES for n in args.sizes}
    bar = tqdm(total=args.rounds * len(args.sizes) * len(POLICIES), unit="run")
    started = time.perf_counter()
    for r in range(args.rounds):
        order = POLICIES if r % 2 == 0 else POLICIES[::-1]
        for n in args.sizes:
            for policy in order:
                bar.set_description(f"round {r + 1} {policy} {n}")
                runs[policy, n].append(
                    run_once(policy, workloads[n], args.packets_per_stream, overhead_s)
                )
                bar.update()
    bar.close()
    wall = time.perf_counter() - started

    rows = []
    for n in args.sizes:
        for policy in POLICIES:
            rs = runs[policy, n]
            totals = [r.total_s for r in rs]
            ops = rs[0].ops
            row = {
                "streams": n,
                "scheduler": policy,
                "packets_per_stream": args.packets_per_stream,
                "bytes_per_stream": STREAM_BYTES,
                "ops": ops,
                "rounds": len(rs),
                "total_s_median": statistics.median(totals),
                "total_s_min": min(totals),
                "total_s_max": max(totals),
                "ns_per_op_median": statistics.median(totals) / ops * 1e9,
                "us_per_stream_median": statistics.median(totals) / n * 1e6,
            }
            for op in OPS:
                row[f"{op}_ns_median"] = (
                    statistics.median(r.seconds[op] for r in rs) / rs[0].counts[op] * 1e9
                )
            row["timer_overhead_ns"] = overhead_s * 1e9
            row["machine"] = where
            rows.append(row)
        pifo, abs_ = rows[-2], rows[-1]
        ratio = abs_["total_s_median"] / pifo["total_s_median"]
        pifo["ratio_abs_over_pifo"] = abs_["ratio_abs_over_pifo"] = ratio

    header = (
        f"{'streams':>8} {'ops':>9} {'pifo s':>9} {'abs s':>9} {'pifo ns/op':>11} "
        f"{'abs ns/op':>10} {'abs/pifo':>9}"
    )
    print()
    print(header)
    print("-" * len(header))
    for i in range(0, len(rows), 2):
        pifo, abs_ = rows[i], rows[i + 1]
        print(
            f"{pifo['streams']:>8} {pifo['ops']:>9} {pifo['total_s_median']:>9.4f} "
            f"{abs_['total_s_median']:>9.4f} {pifo['ns_per_op_median']:>11.0f} "
            f"{abs_['ns_per_op_median']:>10.0f} {pifo['ratio_abs_over_pifo']:>8.2f}x"
        )
    print()
    print("ns per operation, by kind (medians):")
    print(f"{'streams':>8} {'scheduler':>9} " + " ".join(f"{op:>8}" for op in OPS))
    for row in rows:
        print(
            f"{row['streams']:>8} {row['scheduler']:>9} "
            + " ".join(f"{row[f'{op}_ns_median']:>8.0f}" for op in OPS)
        )
    print(f"\nwall time {wall:.1f} s")

    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "scheduler_overhead.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    png_path = args.out / "scheduler_overhead.png"
    plot(rows, args, where, png_path)
    print(f"wrote {csv_path} and {png_path}")


def plot(rows: list[dict], args: argparse.Namespace, where: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, label, marker in (
        ("abs", "ABS, sorted list (insort, pop(0))", "s"),
        ("pifo", "PIFO, binary heap", "o"),
    ):
        mine = [r for r in rows if r["scheduler"] == policy]
        ax.plot(
            [r["streams"] for r in mine],
            [r["us_per_stream_median"] for r in mine],
            marker=marker,
            label=label,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("streams opened at once")
    ax.set_ylabel("stream-management time per stream (µs, log)")
    ax.set_title(
        f"Scheduler overhead: add + {args.packets_per_stream}x(pop, requeue/remove) per stream\n"
        f"median of {args.rounds} rounds; {where.split(', ', 1)[1]}",
        fontsize=8,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()
