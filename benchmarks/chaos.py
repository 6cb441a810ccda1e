"""Chaos: SIGKILL one vLLM engine under load, and measure how the server rides it out.

An open-loop Poisson load (`workloads.replay`'s client and workload, so its flags apply; 10 req/s
for 300 s by default) runs against a server this script starts, or one at `--url`. After
`--kill-at` seconds it SIGKILLs the EngineCore process of one replica (`--kill`, by default the
model that served the most so far), polls /readyz until that replica is back, and keeps the load
on to the end. It reports, each against its target:
  - client-side connection errors (0): the server stays reachable while an engine dies;
  - failures the client saw against the server's own count of them (serving_requests_total
    deltas from /metrics): each one an `engine_error`, none unaccounted for;
  - the time from the kill until /readyz lists the replica up again (under 120 s);
  - the mean reward (models.yaml quality when the SLO was met, else 0; failures score 0) per
    30 s window, before the kill against after recovery (back within 0.05); "after" starts
    `--settle-s` after /readyz lists the replica up, once the outage's backlog has drained.
Writes results/chaos/chaos.{json,csv,png} (the CSV has one row per window) and the server's log.

    python -m benchmarks.chaos                        # the embedded deployment, 300 s
    python -m benchmarks.chaos --url http://localhost:8000 --proto h1 --server-log server.log
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from config import ConfigError, Deployment, load_deployment
from experiments.harness.live import requests_total
from experiments.harness.live import server as live_server
from experiments.harness.output import write_csv
from workloads.generate import requests
from workloads.replay import Client, build_workload, client_health, replay
from workloads.replay import parser as replay_parser
from workloads.summary import Outcome, format_summary, summarize

ROOT = Path(__file__).resolve().parent.parent

READY_LINE = re.compile(r"(\S+): ready in [\d.]+ s, context \d+ tokens, EngineCore pid ([\d,]+)")
"""What serving.engines.vllm_engine logs each time an engine (re)starts."""
POLL_S = 0.5
CERT = ROOT / ".certs" / "cert.pem"


@dataclass
class Chaos:
    """What the chaos side saw, in seconds from the start of the load."""

    replica: str = ""
    pid: int = 0
    killed_at: float | None = None
    down_at: float | None = None
    """First /readyz poll after the kill that listed the replica down."""
    up_at: float | None = None
    """First poll after that which listed it up again."""
    unanswered_polls: int = 0
    readyz: list[tuple[float, list[str]]] = field(default_factory=list)
    """Every poll: its time and the replicas it listed down."""


def parser() -> argparse.ArgumentParser:
    p = replay_parser()
    p.prog = "python -m benchmarks.chaos"
    p.description = __doc__.split("\n\n")[0]
    chaos = p.add_argument_group("chaos")
    chaos.add_argument("--kill-at", type=float, default=60.0, help="s after the load starts")
    chaos.add_argument(
        "--kill", help="the replica or model whose engine dies; default: the model that served most"
    )
    chaos.add_argument("--window-s", type=float, default=30.0, help="reward window, s")
    chaos.add_argument(
        "--settle-s",
        type=float,
        default=30.0,
        help="windows that start this soon after the replica is up are not yet 'after recovery'",
    )
    chaos.add_argument(
        "--server-log",
        help="with --url: the server's log, where each engine's EngineCore pid is logged",
    )
    chaos.add_argument("--http-url", help="HTTP/1.1 base for /readyz and /metrics (with --url)")
    chaos.add_argument("--startup-timeout", type=float, default=600.0, help="s")
    chaos.add_argument("--recovery-target-s", type=float, default=120.0)
    chaos.add_argument("--reward-tolerance", type=float, default=0.05)
    p.set_defaults(rate=10.0, duration=300.0, out=str(ROOT / "results" / "chaos" / "chaos.json"))
    return p


@contextlib.contextmanager
def served(args: argparse.Namespace, log: Path) -> Iterator[None]:
    """With no --url: `python -m serving` for the run, its log in `log`; stopped however the run
    ends. Points args' URLs at it."""
    if args.url is not None:
        yield
        return
    extra = ["--config", args.config, "--request-log", str(log.with_name("requests.jsonl"))]
    with live_server(
        args.deployment, None, log, args.startup_timeout, extra, ready_path="/readyz"
    ) as live:
        args.http_url = live.url
        args.url = live.url if args.proto == "h1" else f"https://localhost:{live.h3_port}"
        args.cacert = args.cacert or str(CERT)
        args.server_log = str(log)
        yield


def engine_pids(server_log: Path) -> dict[str, int]:
    """Each replica's EngineCore pid, as its latest start logged it."""
    pids = {}
    for match in READY_LINE.finditer(server_log.read_text(errors="replace")):
        pids[match[1]] = int(match[2].split(",")[0])
    return pids


async def inflict(args: argparse.Namespace, deployment: Deployment, chaos: Chaos) -> None:
    """Poll /readyz throughout; at --kill-at, SIGKILL the chosen engine's EngineCore."""
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.http_url, timeout=5) as http:
        while True:
            now = time.perf_counter() - start
            if chaos.killed_at is None and now >= args.kill_at:
                kill(args, deployment, chaos, now)
            try:
                down = (await http.get("/readyz")).json()["down"]
            except (httpx.HTTPError, ValueError, KeyError):
                chaos.unanswered_polls += 1
            else:
                # Stamped on the answer: under load a poll can take seconds, and the replica's
                # state is known no earlier than the answer says so.
                now = time.perf_counter() - start
                chaos.readyz.append((now, down))
                note(chaos, now, down)
            await asyncio.sleep(POLL_S)


def kill(args: argparse.Namespace, deployment: Deployment, chaos: Chaos, now: float) -> None:
    victim = args.kill or requests_total(args.http_url, "model", "ok").most_common(1)[0][0]
    names = [r.name for r in deployment.replicas if victim in (r.name, r.model)]
    pids = engine_pids(Path(args.server_log))
    chaos.replica = next((n for n in names if n in pids), "")
    if not chaos.replica:
        raise SystemExit(f"no EngineCore pid logged for {victim!r} in {args.server_log}")
    chaos.pid = pids[chaos.replica]
    os.kill(chaos.pid, signal.SIGKILL)
    chaos.killed_at = now
    tqdm.write(f"[{now:6.1f} s] SIGKILL EngineCore pid {chaos.pid} of {chaos.replica}")


def note(chaos: Chaos, now: float, down: list[str]) -> None:
    if chaos.killed_at is None:
        return
    if chaos.down_at is None and chaos.replica in down:
        chaos.down_at = now
        tqdm.write(f"[{now:6.1f} s] /readyz: {chaos.replica} down")
    elif chaos.down_at is not None and chaos.up_at is None and chaos.replica not in down:
        chaos.up_at = now
        tqdm.write(f"[{now:6.1f} s] /readyz: {chaos.replica} up again")


async def run(
    args: argparse.Namespace, deployment: Deployment, chaos: Chaos
) -> tuple[list[Outcome], float, float]:
    spec, _ = build_workload(args)
    workload = list(requests(spec, args.seed, args.duration, args.num_requests))
    chaos_task = asyncio.create_task(inflict(args, deployment, chaos))
    try:
        return await replay(
            workload, Client(args, deployment), deployment, args.timeout, args.progress
        )
    finally:
        chaos_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await chaos_task


def windows(
    outcomes: list[Outcome], chaos: Chaos, window_s: float, settle_s: float, end: float
) -> list[dict]:
    """Per window of arrivals: what was sent, how it ended, its mean reward, and its phase:
    before the kill, outage (until the replica is up), settling (starts within `settle_s` of
    that: the backlog of the outage still drains), after recovery."""
    rows = []
    for lo in np.arange(0.0, end, window_s):
        hi = lo + window_s
        group = [o for o in outcomes if lo <= o.arrival_s < hi]
        if not group:
            continue
        if chaos.killed_at is None or hi <= chaos.killed_at:
            phase = "before"
        elif chaos.up_at is None or lo < chaos.up_at:
            phase = "outage"
        elif lo < chaos.up_at + settle_s:
            phase = "settling"
        else:
            phase = "after"
        kinds = Counter(o.error_kind for o in group if o.error_kind)
        rows.append(
            {
                "start_s": float(lo),
                "end_s": float(hi),
                "phase": phase,
                "sent": len(group),
                "completed": sum(o.completed for o in group),
                "failed": sum(kinds.values()),
                "connection_errors": kinds["connection"],
                "mean_reward": float(np.mean([o.reward for o in group])),
                "slo_attainment": float(np.mean([o.slo_met for o in group])),
                "errors": dict(kinds),
            }
        )
    return rows


def verdict(
    outcomes: list[Outcome],
    rows: list[dict],
    chaos: Chaos,
    server: Counter[str],
    args: argparse.Namespace,
) -> dict:
    failed = Counter(o.error_kind for o in outcomes if o.error_kind)
    client_failed = sum(failed.values())
    not_ok = sum(n for outcome, n in server.items() if outcome != "ok")

    def mean_reward(phase: str) -> float | None:
        means = [r["mean_reward"] for r in rows if r["phase"] == phase]
        return float(np.mean(means)) if means else None

    before, after = mean_reward("before"), mean_reward("after")
    recovery = None if chaos.up_at is None else chaos.up_at - (chaos.killed_at or 0.0)
    served_again = min(
        (
            o.arrival_s + (o.ttft_s or 0.0)
            for o in outcomes
            if o.completed and o.replica == chaos.replica and o.arrival_s > (chaos.killed_at or 0)
        ),
        default=None,
    )
    return {
        "client_failed": client_failed,
        "client_errors": dict(failed),
        "connection_errors": failed["connection"],
        "server_outcomes": dict(server),
        "server_engine_errors": server["engine_error"],
        "server_not_ok": not_ok,
        "recovery_s": recovery,
        "first_served_after_kill_s": None
        if served_again is None
        else served_again - (chaos.killed_at or 0.0),
        "reward_before": before,
        "reward_after": after,
        "checks": {
            "no connection errors": failed["connection"] == 0,
            "every failure an engine_error, counted by the server": client_failed
            == server["engine_error"]
            == not_ok,
            f"back within {args.recovery_target_s:g} s": recovery is not None
            and recovery < args.recovery_target_s,
            f"reward back within {args.reward_tolerance:g}": before is not None
            and after is not None
            and abs(after - before) <= args.reward_tolerance,
        },
    }


def print_report(rows: list[dict], result: dict, chaos: Chaos, machine: str) -> None:
    print(f"\n{machine}")
    print(
        f"{'window':>13} {'phase':>8} {'sent':>5} {'done':>5} {'failed':>7} "
        f"{'reward':>7} {'SLO':>6}"
    )
    for r in rows:
        print(
            f"{r['start_s']:5.0f}-{r['end_s']:<5.0f} s {r['phase']:>8} {r['sent']:>5} "
            f"{r['completed']:>5} {r['failed']:>7} {r['mean_reward']:>7.3f} "
            f"{r['slo_attainment']:>6.1%}"
        )
    print(
        f"killed EngineCore pid {chaos.pid} of {chaos.replica} at {fmt(chaos.killed_at, ' s')}; "
        f"/readyz: down at {fmt(chaos.down_at, ' s')}, up at {fmt(chaos.up_at, ' s')}"
    )
    print(f"time from kill to the replica up (/readyz): {fmt(result['recovery_s'], ' s')}")
    print(f"  to its first request served: {fmt(result['first_served_after_kill_s'], ' s')}")
    print(
        f"client failures: {result['client_failed']} {result['client_errors']}; server "
        f"outcomes: {result['server_outcomes']} (engine_error {result['server_engine_errors']})"
    )
    print(
        f"mean reward per {rows[0]['end_s'] - rows[0]['start_s']:g} s window: before the kill "
        f"{fmt(result['reward_before'])}, after recovery {fmt(result['reward_after'])}"
    )
    if chaos.unanswered_polls:
        print(f"/readyz did not answer {chaos.unanswered_polls} polls")
    for check, ok in result["checks"].items():
        print(f"  [{'pass' if ok else 'FAIL'}] {check}")


def fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.3f}{unit}"


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    requests_ = record["requests"]
    chaos, rows, summary = record["chaos"], record["windows"], record["summary"]
    arrivals = np.array([r["arrival_s"] for r in requests_])
    bins = np.arange(0, float(arrivals.max()) + 5.0, 5.0)
    fig, (outcomes, reward, share) = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    groups = {
        "completed": [r for r in requests_ if not r["error_kind"]],
        "engine error (stream, 5xx)": [
            r for r in requests_ if r["error_kind"] == "stream" or r["status"] == 500
        ],
        "other error": [
            r
            for r in requests_
            if r["error_kind"] and r["error_kind"] != "stream" and r["status"] != 500
        ],
    }
    colours = {"completed": "0.6", "engine error (stream, 5xx)": "tab:red", "other error": "k"}
    outcomes.hist(
        [[r["arrival_s"] for r in g] for g in groups.values()],
        bins=bins,
        stacked=True,
        color=list(colours.values()),
        label=list(groups),
    )
    outcomes.set_ylabel("requests / 5 s")
    window = summary["window"]
    ends = arrivals[window - 1 :] if len(arrivals) >= window else np.empty(0)
    reward.plot(ends, summary["windows"]["mean_reward"], lw=0.8, label=f"last {window} requests")
    for r in rows:
        reward.hlines(r["mean_reward"], r["start_s"], r["end_s"], colors="tab:blue", lw=2.5)
    reward.plot([], [], color="tab:blue", lw=2.5, label="per window")
    reward.set_ylabel("mean reward")
    reward.set_ylim(-0.05, 1.05)
    models = sorted({r["model"] for r in groups["completed"]})
    share.hist(
        [[r["arrival_s"] for r in groups["completed"] if r["model"] == m] for m in models],
        bins=bins,
        stacked=True,
        label=models,
    )
    share.set_ylabel("completed / 5 s, by model")
    share.set_xlabel("arrival time (s)")
    for ax in (outcomes, reward, share):
        if chaos["killed_at"] is not None:
            ax.axvline(chaos["killed_at"], color="tab:red", ls="--", lw=1)
            end = chaos["up_at"] if chaos["up_at"] is not None else float(arrivals.max())
            ax.axvspan(chaos["killed_at"], end, color="tab:red", alpha=0.08)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.suptitle(
        f"{record['chaos']['replica']} killed at {chaos['killed_at']:.0f} s under "
        f"{record['arrivals']}; shaded: until /readyz lists it up"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    args = parser().parse_args()
    if args.url is not None and not (args.server_log and (args.http_url or args.proto == "h1")):
        raise SystemExit("with --url, give --server-log (and --http-url unless --proto h1)")
    args.http_url = args.http_url or args.url
    try:
        deployment = load_deployment(args.config, args.deployment)
        _, what = build_workload(args)
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from exc
    out = Path(args.out)
    chaos = Chaos()
    with served(args, out.with_name("server.log")):
        tqdm.write(f"{what} over {args.proto} to {args.url}, kill at {args.kill_at:g} s")
        before = requests_total(args.http_url, "outcome")
        outcomes, duration, cpu = asyncio.run(run(args, deployment, chaos))
        server = requests_total(args.http_url, "outcome") - before
    rows = windows(outcomes, chaos, args.window_s, args.settle_s, args.duration)
    result = verdict(outcomes, rows, chaos, server, args)
    summary = summarize(outcomes, duration, args.window)
    machine = (
        f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    )
    print(format_summary(summary, f"chaos, {args.proto} {args.url}"))
    health = client_health(outcomes, duration, cpu)
    for warning in health["warnings"]:
        print(f"WARNING: {warning}")
    print_report(rows, result, chaos, machine)
    record = {
        "command": sys.argv,
        "machine": machine,
        "arrivals": what,
        "deployment": deployment.name,
        "chaos": asdict(chaos),
        "result": result,
        "windows": rows,
        "client": health,
        "summary": summary,
        "requests": [asdict(o) for o in sorted(outcomes, key=lambda o: o.arrival_s)],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    write_csv(out.with_suffix(".csv"), rows, skip=("errors",))
    plot(record, out.with_suffix(".png"))
    print(f"wrote {out} and its .csv and .png", file=sys.stderr)
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
