"""The MASQUE experiments of Chuppala (2024), chapter 2, over the link emulator's chain topology.

    client namespace --[access link]-- proxy namespace --[backhaul]-- target namespace

The client runs one `MasqueClient` (one QUIC connection to the proxy, each tunnel a stream on it,
ordered by the outer scheduler) and, through each tunnel, an inner HTTP/3 connection
(`Http3Client`, its streams ordered by its own scheduler: round-robin) to an echo server on the
target (`experiments.transport_micro`'s, HTTP/3). The proxy is `MasqueProxy`, in capsule mode,
ordering the tunnels' downloads with the same outer scheduler by their `priority` header. Every
process is its own: client, proxy and target each run in their own namespace.

1. tunnels: 100 tunnels at once, each one inner connection echoing 10 KB; the access link is
   5 Mbit/s, 1.5% loss, 50 ms. A tunnel completes if its echo is back within 8 s of the tunnel's
   CONNECT. Outer fcfs against rr. The thesis: FCFS 17%, RR 68%; everything done in about 24 s
   against 15 s.
2. nested: 10 tunnels with outer priorities 1 to 10 (10 most urgent), opened at once in a seeded
   random order, each 30 inner streams of 1 KB echoed; 5 Mbit/s, 0.5% loss, 50 ms. Outer rr,
   fcfs or abs; inner rr. The RTT of an inner stream runs from its request to its last echoed
   byte. The thesis: under ABS the groups were nearly ordered by priority, about 4,000 ms mean RTT.
3. pifo: `benchmarks.pifo_connection` (stream-management time of the heap against the sorted
   list over a real aioquic connection, 1,000 and 10,000 streams of 10 KB, priorities 1 to 10)
   and `benchmarks.scheduler_overhead`. The thesis: 9.87 ms against 35.2 ms at 1,000 streams.

Choices the thesis leaves open, and ours:
- The loss and delay are on the client-proxy link (the thesis's `tc` link), 25 ms each way; the
  backhaul to the target is 1 Gbit/s and 0.5 ms each way, lossless.
- Capsule mode (RFC 9297 DATAGRAM capsules on the tunnel's stream), as the thesis's tunnels were
  streams: that is what the outer scheduler orders. HTTP/3 datagrams bypass any scheduler.
- Priorities 1 to 10 on the client's streams as they are; towards the proxy as RFC 9218
  urgencies, which have eight levels: u = round((10 - p) * 7 / 9), so 8 and 7, and 4 and 3,
  share one at the proxy.
- QUIC runs CUBIC everywhere (as `experiments.transport_micro`, for the thesis's quic-go).
- An inner connection or request that has not finished 60 s after it started counts as failed.

    sudo .venv/bin/python -m experiments.masque                 # all three, 3 seeds: 15 min
    sudo .venv/bin/python -m experiments.masque --quick         # 1 seed, smaller
    python -m experiments.masque --report                       # tables and plots again

Results go to results/masque/. It needs root (network namespaces), as `netsim.netem` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypedDict

import numpy as np
from tqdm import tqdm

from experiments.harness.output import write_csv
from experiments.transport_micro import CONGESTION_CONTROL, H3_PORT, mean_ci, serve
from netsim.link import LinkConfig
from netsim.netem import Netem, NetemError, check_can_run
from transport.client import Http3Client
from transport.masque import AllowList
from transport.masque.proxy import MasqueProxy
from transport.masque.tunnel import MasqueClient
from transport.schedulers import StreamSpec
from transport.tls import ensure_certificate

OUT = Path("results/masque")
ROOT = Path(__file__).resolve().parent.parent
KEY = "masque-experiment-key"
PROXY_PORT = 4433
BACKHAUL = LinkConfig(rate_bps=1e9, delay_s=0.0005, queue_bytes=4 * 2**20)
GIVE_UP_S = 60.0


@dataclass(frozen=True)
class Setup:
    name: str
    link: LinkConfig
    schedulers: tuple[str, ...]
    tunnels: int
    streams: int
    """Inner streams per tunnel."""
    size: int
    """Bytes each way per inner stream."""


SETUPS = {
    "tunnels": Setup(
        "tunnels", LinkConfig(rate_bps=5e6, delay_s=0.025, loss=0.015), ("fcfs", "rr"), 100, 1,
        10_000,
    ),
    "nested": Setup(
        "nested", LinkConfig(rate_bps=5e6, delay_s=0.025, loss=0.005), ("rr", "fcfs", "abs"), 10,
        30, 1_000,
    ),
}  # fmt: skip
DEADLINE_S = 8.0
"""The tunnel experiment's: from a tunnel's CONNECT to its echo's last byte."""
THESIS = {
    "tunnels": "completion by 8 s: FCFS 17%, RR 68% (4x); all done in ~24 s (FCFS), ~15 s (RR)",
    "nested": "under ABS the groups nearly ordered by priority, ~4,000 ms mean RTT at the top",
    "pifo": "1,000 streams: 9.87 ms (PIFO) against 35.2 ms (sorted list), 3.6x",
}


@dataclass
class Record:
    group: int
    """The tunnel's index (tunnels) or its priority, 1 to 10 (nested)."""
    stream: int
    latency_s: float | None
    """tunnels: from the tunnel's CONNECT to the last echoed byte; nested: from the inner
    request to its last echoed byte. None if it failed."""
    error: str | None = None
    packets_up: int = 0
    """The tunnel's inner QUIC packets sent and received (on the group's first stream only)."""
    packets_down: int = 0
    handshake_s: float | None = None
    """From the tunnel's CONNECT until its inner connection's handshake was done."""


def thesis_urgency(priority: int) -> int:
    """The thesis's priority (1 to 10, 10 most urgent) as an RFC 9218 urgency (0 most urgent)."""
    return round((10 - priority) * 7 / 9)


# -- the proxy's and the client's roles, each run in its own namespace ---------------------------


async def proxy(scheduler: str, target: str) -> None:
    cert, key = ensure_certificate()
    async with MasqueProxy(
        {KEY: AllowList.parse([target])}, certfile=cert, keyfile=key, host="0.0.0.0",
        port=PROXY_PORT, scheduler=scheduler, congestion_control=CONGESTION_CONTROL,
    ):  # fmt: skip
        await asyncio.Event().wait()


async def _echo(inner: Http3Client, size: int) -> None:
    response = await inner.request("POST", "/echo", {}, bytes(size))
    echoed = await response.read()
    if response.status != 200 or len(echoed) != size:
        raise RuntimeError(f"status {response.status}, {len(echoed)} bytes back")


async def client(
    setup: Setup, scheduler: str, seed: int, proxy_host: str, target: str
) -> list[Record]:
    target_host, _, port = target.rpartition(":")
    target_port = int(port)
    await _wait_ready(proxy_host, target_host, target_port)
    records: list[Record] = []
    order = list(range(1, setup.tunnels + 1))
    random.Random(seed).shuffle(order)
    async with MasqueClient(
        proxy_host, PROXY_PORT, key=KEY, verify=False, scheduler=scheduler,
        congestion_control=CONGESTION_CONTROL,
    ) as masque:  # fmt: skip

        async def tunnel(group: int) -> None:
            start = time.monotonic()
            spec = StreamSpec(priority=group) if setup.name == "nested" else None
            urgency = thesis_urgency(group) if setup.name == "nested" else None
            opened = None
            try:
                opened = await masque.open_tunnel(
                    target_host, target_port, urgency=urgency, spec=spec
                )
                host, port = opened.local_address
                async with Http3Client(
                    host, port, verify=False, scheduler="rr", server_name=target_host,
                    congestion_control=CONGESTION_CONTROL,
                ) as inner:  # fmt: skip
                    handshake = time.monotonic() - start

                    async def stream(index: int) -> None:
                        began = start if setup.name == "tunnels" else time.monotonic()
                        try:
                            await _echo(inner, setup.size)
                            latency, error = time.monotonic() - began, None
                        except Exception as failed:
                            latency, error = None, _name(failed)
                        records.append(Record(group, index, latency, error, handshake_s=handshake))

                    await asyncio.gather(*(stream(i) for i in range(setup.streams)))
                    # Counted before the inner connection closes, whatever its close does.
                    first = next(r for r in records if r.group == group and r.stream == 0)
                    first.packets_up = opened.sent_capsules + opened.sent_datagrams
                    first.packets_down = opened.received_capsules + opened.received_datagrams
            except Exception as error:  # the tunnel or the inner handshake failed
                print(f"tunnel {group}: {_name(error)}", file=sys.stderr)
                done = {r.stream for r in records if r.group == group}
                records.extend(
                    Record(group, i, None, _name(error))
                    for i in range(setup.streams) if i not in done
                )  # fmt: skip
            finally:
                if opened is not None:
                    await opened.aclose()

        async def bounded(group: int) -> None:
            try:
                await asyncio.wait_for(tunnel(group), GIVE_UP_S)
            except TimeoutError:
                done = {r.stream for r in records if r.group == group}
                records.extend(
                    Record(group, i, None, "gave up") for i in range(setup.streams) if i not in done
                )

        await asyncio.gather(*(bounded(group) for group in order))
    return records


def _name(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:200]


async def _wait_ready(proxy_host: str, target_host: str, target_port: int) -> None:
    """The proxy and the target start in their namespaces: retry a tunnelled GET until it works."""
    deadline = time.monotonic() + 30
    while True:
        try:
            async with MasqueClient(proxy_host, PROXY_PORT, key=KEY, verify=False) as masque:
                tunnel = await masque.open_tunnel(target_host, target_port)
                host, port = tunnel.local_address
                async with Http3Client(host, port, verify=False) as inner:
                    await asyncio.wait_for((await inner.request("GET", "/ready")).read(), 3)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)


# -- the orchestration: one emulator, target, proxy and client per run ---------------------------


def run_once(setup: Setup, scheduler: str, seed: int) -> list[Record]:
    """One run in an emulator of its own: the target, the proxy, then the client."""
    ensure_certificate()  # made once here, not raced by the target and the proxy
    me = [sys.executable, "-m", "experiments.masque"]
    links = [setup.link.replace(seed=seed), BACKHAUL.replace(seed=seed)]
    with tempfile.TemporaryDirectory() as scratch, Netem(links, "chain") as net:
        assert net.middle is not None and net.middle_address is not None
        out, log = Path(scratch) / "records.json", Path(scratch) / "roles.log"
        target = f"{net.server_address}:{H3_PORT}"
        with log.open("wb") as logs:
            net.popen(net.server, [*me, "serve"], cwd=ROOT, stderr=logs)
            net.popen(
                net.middle, [*me, "proxy", "--scheduler", scheduler, "--target", target],
                cwd=ROOT, stderr=logs,
            )  # fmt: skip
        run = net.popen(
            net.client,
            [*me, "client", "--experiment", setup.name, "--scheduler", scheduler, "--seed",
             str(seed), "--host", net.middle_address, "--target", target, "--out", str(out),
             "--tunnels", str(setup.tunnels), "--streams", str(setup.streams)],
            cwd=ROOT,
        )  # fmt: skip
        try:
            code = run.wait(timeout=GIVE_UP_S + 120)
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            raise RuntimeError(
                f"{setup.name}, {scheduler}, seed {seed}: the client exited with {code}; the "
                f"target's and proxy's log ends:\n{log.read_text()[-2000:]}"
            )
        return [Record(**r) for r in json.loads(out.read_text())]


Runs = dict[tuple[str, str, int], list[Record]]
"""(experiment, outer scheduler, seed) -> its records."""


class TunnelRow(TypedDict):
    """Experiment 1, one outer scheduler over its seeds: a row of tunnels.csv."""

    scheduler: str
    seeds: int
    completion: float
    completion_ci95: float
    all_done_s: float
    all_done_ci95: float
    runs_with_failures: int
    latency_p50_s: float
    latency_max_s: float
    failed: int
    slow_handshakes: float
    completion_quic_go_timeout: float
    inner_packets_per_tunnel: float


class NestedGroup(TypedDict):
    """Experiment 2, one outer scheduler and priority: a row of nested_groups.csv."""

    scheduler: str
    priority: int
    mean_rtt_ms: int
    ci95_ms: int | str
    """Empty where one seed gives no interval."""


class NestedCorrelation(TypedDict):
    """Experiment 2, one outer scheduler over its seeds: a row of nested.csv."""

    scheduler: str
    seeds: int
    spearman: float
    spearman_ci95: float | str
    worst_seed: float
    failed: int


def read_records(path: Path) -> Runs:
    import csv

    runs: Runs = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            record = Record(
                int(row["group"]), int(row["stream"]),
                float(row["latency_s"]) if row["latency_s"] else None, row["error"] or None,
                int(row["packets_up"]), int(row["packets_down"]),
                float(row["handshake_s"]) if row["handshake_s"] else None,
            )  # fmt: skip
            runs.setdefault((row["experiment"], row["scheduler"], int(row["seed"])), []).append(
                record
            )
    return runs


# -- the analysis ------------------------------------------------------------------------------


def _seeds(runs: Runs, experiment: str, scheduler: str) -> list[list[Record]]:
    return [rs for (e, s, _), rs in sorted(runs.items()) if (e, s) == (experiment, scheduler)]


def summarise_tunnels(runs: Runs) -> list[TunnelRow]:
    rows: list[TunnelRow] = []
    for scheduler in SETUPS["tunnels"].schedulers:
        seeds = _seeds(runs, "tunnels", scheduler)
        if not seeds:
            continue
        shares = [sum(_done(r) for r in rs) / len(rs) for rs in seeds]
        finish = [max((r.latency_s or math.inf) for r in rs) for rs in seeds]
        latencies = [r.latency_s for rs in seeds for r in rs if r.latency_s is not None]
        share, share_ci = mean_ci(shares)
        finite = [f for f in finish if math.isfinite(f)]
        all_done, all_done_ci = mean_ci(finite) if finite else (math.inf, math.nan)
        strict, _ = mean_ci([sum(_done_quic_go(r) for r in rs) / len(rs) for rs in seeds])
        rows.append({
            "scheduler": scheduler, "seeds": len(seeds), "completion": round(share, 4),
            "completion_ci95": round(share_ci, 4), "all_done_s": round(all_done, 2),
            "all_done_ci95": round(all_done_ci, 2),
            "runs_with_failures": len(finish) - len(finite),
            "latency_p50_s": round(float(np.percentile(latencies, 50)), 3),
            "latency_max_s": round(max(latencies), 3),
            "failed": sum(r.latency_s is None for rs in seeds for r in rs),
            "slow_handshakes": round(
                statistics.fmean(_slow_handshake(r) for rs in seeds for r in rs), 4
            ),
            "completion_quic_go_timeout": round(strict, 4),
            "inner_packets_per_tunnel": round(
                statistics.fmean(r.packets_up + r.packets_down for rs in seeds for r in rs), 1
            ),
        })  # fmt: skip
    return rows


def _done(record: Record) -> bool:
    return record.latency_s is not None and record.latency_s <= DEADLINE_S


QUIC_GO_HANDSHAKE_TIMEOUT_S = 5.0
"""quic-go's default `HandshakeIdleTimeout`: a client whose handshake is not done by then gives
up. aioquic has none (only the 60 s idle timeout), so a starved inner handshake here waits."""


def _slow_handshake(record: Record) -> bool:
    return record.handshake_s is None or record.handshake_s > QUIC_GO_HANDSHAKE_TIMEOUT_S


def _done_quic_go(record: Record) -> bool:
    """Done by the deadline, had a handshake over quic-go's timeout failed instead (an upper
    bound on quic-go's waiting: its timer restarts on handshake progress, ours does not)."""
    return _done(record) and not _slow_handshake(record)


def summarise_nested(runs: Runs) -> tuple[list[NestedGroup], list[NestedCorrelation]]:
    """Per (scheduler, priority): the mean RTT over seeds; per scheduler: Spearman's rho between
    priority and a group's mean RTT, one per seed (negative: the more urgent, the faster)."""
    from scipy import stats

    groups: list[NestedGroup] = []
    correlations: list[NestedCorrelation] = []
    for scheduler in SETUPS["nested"].schedulers:
        seeds = _seeds(runs, "nested", scheduler)
        if not seeds:
            continue
        rhos = []
        per_seed: dict[int, list[float]] = {}
        for rs in seeds:
            means = {
                p: statistics.fmean(r.latency_s for r in rs if r.group == p and r.latency_s)
                for p in sorted({r.group for r in rs if r.latency_s is not None})
            }
            for p, mean in means.items():
                per_seed.setdefault(p, []).append(mean)
            rhos.append(float(stats.spearmanr(list(means), list(means.values())).statistic))
        for p, seed_means in sorted(per_seed.items()):
            mean, ci = mean_ci(seed_means)
            groups.append({"scheduler": scheduler, "priority": p, "mean_rtt_ms": round(1e3 * mean),
                           "ci95_ms": round(1e3 * ci) if math.isfinite(ci) else ""})  # fmt: skip
        rho, rho_ci = mean_ci(rhos)
        correlations.append({
            "scheduler": scheduler, "seeds": len(seeds), "spearman": round(rho, 3),
            "spearman_ci95": round(rho_ci, 3) if math.isfinite(rho_ci) else "",
            "worst_seed": round(max(rhos), 3),
            "failed": sum(r.latency_s is None for rs in seeds for r in rs),
        })  # fmt: skip
    return groups, correlations


def plot(runs: Runs, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    tunnel_rows = summarise_tunnels(runs)
    if tunnel_rows:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        names = [str(r["scheduler"]) for r in tunnel_rows]
        left.bar(names, [100 * float(r["completion"]) for r in tunnel_rows],
                 yerr=[100 * float(r["completion_ci95"] or 0) for r in tunnel_rows],
                 capsize=4, label="ours")  # fmt: skip
        left.scatter(["fcfs", "rr"], [17, 68], color="black", marker="x", zorder=3, label="thesis")
        left.set_ylabel(f"tunnels done within {DEADLINE_S:g} s (%)")
        left.set_title("Completion (95% CI over seeds)")
        left.legend()
        for scheduler in names:
            latencies = sorted(
                r.latency_s if r.latency_s is not None else math.inf
                for rs in _seeds(runs, "tunnels", scheduler) for r in rs
            )  # fmt: skip
            right.step(
                latencies, np.arange(1, len(latencies) + 1) / len(latencies), label=scheduler
            )
        right.axvline(DEADLINE_S, color="red", linestyle="--", linewidth=1, label="deadline")
        right.set_xlabel("tunnel's echo done after (s)")
        right.set_ylabel("share of tunnels")
        right.set_title("Latency, all seeds")
        right.legend()
        fig.suptitle(
            "100 tunnels x 10 KB echo, 5 Mbit/s, 1.5% loss, 50 ms: Chuppala (2024), ch. 2, exp. 1"
        )
        fig.tight_layout()
        written.append(out / "tunnels.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    groups, correlations = summarise_nested(runs)
    if groups:
        fig, ax = plt.subplots(figsize=(7, 4))
        rho = {c["scheduler"]: c["spearman"] for c in correlations}
        for scheduler in dict.fromkeys(str(g["scheduler"]) for g in groups):
            mine = [g for g in groups if g["scheduler"] == scheduler]
            ax.errorbar(
                [g["priority"] for g in mine], [g["mean_rtt_ms"] for g in mine],
                yerr=[g["ci95_ms"] or 0 for g in mine], capsize=3, marker="o",
                label=f"outer {scheduler} (Spearman {rho[scheduler]})",
            )  # fmt: skip
        ax.set_xlabel("outer priority (10 most urgent)")
        ax.set_ylabel("mean RTT of the group's streams (ms)")
        ax.set_title("10 tunnels x 30 streams x 1 KB, inner rr: Chuppala (2024), ch. 2, exp. 2")
        ax.legend()
        fig.tight_layout()
        written.append(out / "nested.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def report(runs: Runs, out: Path) -> list[str]:
    """Prints the tables beside the thesis's numbers; returns the target lines."""
    lines = []
    tunnel_rows = summarise_tunnels(runs)
    if tunnel_rows:
        write_csv(out / "tunnels.csv", tunnel_rows)
        print(f"\n1. tunnels (the thesis: {THESIS['tunnels']})")
        print(f"{'outer':6} {'completion by 8 s':>22} {'all done (s)':>16} {'p50 s':>7} "
              f"{'failed':>6} {'inner packets a tunnel':>22}")  # fmt: skip
        for r in tunnel_rows:
            print(f"{r['scheduler']!s:6} {100 * float(r['completion']):>14.1f}% ± "
                  f"{100 * float(r['completion_ci95'] or 0):>4.1f} {r['all_done_s']!s:>9} ± "
                  f"{r['all_done_ci95']!s:>4} {r['latency_p50_s']!s:>7} "
                  f"{r['failed']!s:>6} {r['inner_packets_per_tunnel']!s:>22}")  # fmt: skip
        by = {r["scheduler"]: float(r["completion"]) for r in tunnel_rows}
        if {"fcfs", "rr"} <= set(by):
            ratio = by["rr"] / by["fcfs"] if by["fcfs"] else math.inf
            lines.append(f"{'MET' if ratio >= 2 else 'MISSED'} rr completes at least 2x fcfs by "
                         f"8 s: {100 * by['rr']:.1f}% against {100 * by['fcfs']:.1f}%, "
                         f"{ratio:.2f}x (the thesis: 4x)")  # fmt: skip
            slow = {r["scheduler"]: r for r in tunnel_rows}
            lines.append(
                "     inner handshakes over quic-go's 5 s timeout: "
                + ", ".join(
                    f"{s} {100 * float(r['slow_handshakes']):.0f}%" for s, r in slow.items()
                )
                + "; completion by 8 s had those failed, as in quic-go: "
                + ", ".join(
                    f"{s} {100 * float(r['completion_quic_go_timeout']):.1f}%"
                    for s, r in slow.items()
                )
            )
    groups, correlations = summarise_nested(runs)
    if groups:
        write_csv(out / "nested_groups.csv", groups)
        write_csv(out / "nested.csv", correlations)
        print(f"\n2. nested (the thesis: {THESIS['nested']})")
        schedulers = list(dict.fromkeys(str(g["scheduler"]) for g in groups))
        print("mean RTT (ms) by outer priority:")
        print(f"{'priority':>8} " + " ".join(f"{s:>12}" for s in schedulers))
        for p in sorted({int(g["priority"]) for g in groups}):
            cells = {g["scheduler"]: g for g in groups if g["priority"] == p}
            print(f"{p:>8} " + " ".join(
                f"{cells[s]['mean_rtt_ms']!s:>7} ±{cells[s]['ci95_ms']!s:>4}" if s in cells
                else f"{'':>12}" for s in schedulers))  # fmt: skip
        for c in correlations:
            print(f"outer {c['scheduler']}: Spearman(priority, mean RTT) {c['spearman']} ± "
                  f"{c['spearman_ci95']} (worst seed {c['worst_seed']}), "
                  f"{c['failed']} failed")  # fmt: skip
        abs_row = next((c for c in correlations if c["scheduler"] == "abs"), None)
        if abs_row is not None:
            rho = float(abs_row["spearman"])
            lines.append(f"{'MET' if rho <= -0.9 else 'MISSED'} under outer abs the groups are "
                         f"ordered by priority: Spearman {rho} (target: -0.9 or below, the more "
                         f"urgent the faster; worst seed {abs_row['worst_seed']})")  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.masque", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument(
        "role", nargs="?", default="run", choices=["run", "serve", "proxy", "client"]
    )
    parser.add_argument("--experiments", default="tunnels,nested,pifo", help="comma-separated")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one seed")
    parser.add_argument("--tunnels", type=int, help="instead of 100 (tunnels) and 10 (nested)")
    parser.add_argument("--streams", type=int, help="inner streams a tunnel, instead of 1 and 30")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--report", action="store_true", help="no runs: tables and plots again")
    hidden = argparse.SUPPRESS  # the roles' own arguments
    parser.add_argument("--experiment", help=hidden)
    parser.add_argument("--scheduler", default="rr", help=hidden)
    parser.add_argument("--seed", type=int, default=0, help=hidden)
    parser.add_argument("--host", help=hidden)
    parser.add_argument("--target", help=hidden)
    args = parser.parse_args(argv)
    if args.role == "serve":
        asyncio.run(serve("rr", tls=False))
        return 0
    if args.role == "proxy":
        asyncio.run(proxy(args.scheduler, args.target))
        return 0
    sized = {
        name: replace(
            setup, tunnels=args.tunnels or setup.tunnels, streams=args.streams or setup.streams
        )
        for name, setup in SETUPS.items()
    }
    if args.role == "client":
        setup = sized[args.experiment]
        records = asyncio.run(client(setup, args.scheduler, args.seed, args.host, args.target))
        Path(args.out).write_text(json.dumps([asdict(r) for r in records]))
        return 0
    chosen = [e.strip() for e in args.experiments.split(",") if e.strip()]
    unknown = set(chosen) - {*SETUPS, "pifo"}
    if unknown:
        parser.error(f"unknown experiments {sorted(unknown)}; choose from tunnels, nested, pifo")
    if args.quick:
        args.seeds = 1
    if args.seeds < 1 or min(args.tunnels or 1, args.streams or 1) < 1:
        parser.error("--seeds, --tunnels and --streams must be at least 1")
    out = Path(args.out)
    emulated = [e for e in chosen if e in SETUPS]
    if args.report:
        runs = read_records(out / "records.csv")
    else:
        if emulated:
            try:
                check_can_run()
            except NetemError as error:
                parser.exit(2, f"error: {error}\n")
        out.mkdir(parents=True, exist_ok=True)
        runs = {}
        cells = [
            (sized[e], scheduler, seed)
            for seed in range(args.seeds) for e in emulated for scheduler in SETUPS[e].schedulers
        ]  # fmt: skip
        for setup, scheduler, seed in tqdm(cells, desc="runs", unit="run"):
            runs[setup.name, scheduler, seed] = run_once(setup, scheduler, seed)
        if runs:
            write_csv(out / "records.csv", [
                {"experiment": e, "scheduler": s, "seed": seed, **asdict(r)}
                for (e, s, seed), rs in runs.items() for r in rs
            ])  # fmt: skip
    lines = report(runs, out)
    if "pifo" in chosen and not args.report:
        print(f"\n3. pifo (the thesis: {THESIS['pifo']})")
        for command in PIFO_COMMANDS["quick" if args.quick else "full"]:
            print(f"$ {' '.join(command)}", flush=True)
            subprocess.run([sys.executable, *command, "--out", str(out)], cwd=ROOT, check=True)
    figures = plot(runs, out)
    print()
    for line in lines:
        print(line)
    print(f"\nwritten to {out}/: " + ", ".join(p.name for p in figures))
    return 0


PIFO_COMMANDS = {
    # One round through the connection: 10,000 streams take about 3 minutes a run.
    "full": [
        ["-m", "benchmarks.scheduler_overhead", "--sizes", "1000", "10000", "100000"],
        ["-m", "benchmarks.pifo_connection", "--sizes", "1000", "10000", "--rounds", "1"],
    ],
    "quick": [
        ["-m", "benchmarks.scheduler_overhead", "--sizes", "1000", "10000"],
        ["-m", "benchmarks.pifo_connection", "--sizes", "1000", "--rounds", "1"],
    ],
}


if __name__ == "__main__":
    sys.exit(main())
