"""The live check of the end-to-end benchmark of Chuppala (2024): a subset of
`experiments.transport_macro`'s cells run both in virtual time and live, over the TUN emulator,
scored alike and compared.

The subset is the issue's: the DQN and the best static model (OPT-1.3B) x rr, edf, ml and the two
TLS/TCP stacks, at 3 rates of the stable workload. Each (cell, rate) is one run on a fresh
cluster, as in the co-simulation, with the same requests:

- virtual: `experiments.harness.cosim`, as `python -m experiments.transport_macro` runs it;
- live: a fresh emulated 3G link (`netsim.netem`, the co-simulation's link and loss seed), the
  real server (`python -m serving --deployment paper-4gpu-sim`) in its server namespace, with the
  stack's QUIC scheduler and CUBIC, or `--tls` for the TCP stacks; and the load generator
  (`python -m workloads.replay --requests`) in its client namespace, sending exactly the
  co-simulation's requests. HTTP/3 goes on one QUIC connection, its uploads scheduled by class
  as the co-simulation's are; h1-tls opens a TLS connection per request, h2-tls puts every
  request on one.

A request scores its model's quality if its last token reached the client within the SLO of its
scheduled sending (the client's lateness and stream-credit wait included), on both sides.
Where they differ by design: live TCP is the kernel's (its congestion control is printed), where
the co-simulation models it with aioquic's ordered streams and CUBIC; the live server spends
real CPU, which the run reports.

    python -m experiments.transport_macro_live            # 2 policies x 5 stacks x 3 rates, 1 seed
    python -m experiments.transport_macro_live --report   # the comparison from the last run

Needs root, as the emulator does. Writes results/transport_macro_live/ (runs.csv,
comparison.csv, comparison.png, and each live run's load-generator record and server log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

from tqdm import tqdm

from config import Deployment, load_deployment
from experiments.harness.baselines import baselines
from experiments.harness.cosim import Delivery
from experiments.harness.live import cpu_seconds, live_policy
from experiments.harness.output import as_float, as_int, write_csv
from experiments.transport_macro import (
    DEPLOYMENT,
    RATE_SECONDS,
    parse_rates,
    phase_row,
    rows_to_report,
    run_cells,
    workload,
)
from experiments.transport_micro import CONGESTION_CONTROL, LINK_3G, STACKS, TCP_STACKS
from netsim.netem import Netem, NetemError, check_can_run
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec
from workloads.replay import MAX_CLIENT_CPU, MAX_P99_LAG_S
from workloads.request import Request, save_requests
from workloads.summary import Outcome

OUT = Path("results/transport_macro_live")
ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("dqn", "opt-1.3b-only")
"""The DQN and the best static model of Table 3 (OPT-1.3B)."""
LIVE_STACKS = ("rr", "edf", "ml", "h1-tls", "h2-tls")
RATES = (4.0, 16.0, 48.0)
"""Busy for OPT-6.7B, busy for OPT-1.3B, and past the link's capacity (48 req/s of SSE events
need 7.3 Mbit/s against its 5)."""
TARGET = 0.05
KEY = "transport-macro-live-key"
"""The premium key the load generator sends, so that real-time is a class it may ask for."""
HTTP_PORT, TLS_PORT, H3_PORT = 8000, 8443, 8443
TIMEOUT_AFTER_RUN_S = 10.0
"""A request's limit at the load generator is the run's length and this: none is cancelled while
later requests still compete for the link, as the co-simulation cancels none. (A response of 128
tokens at 40 ms each must end within 5.1 s to meet its SLO, so one cut then scores 0 anyway.)"""


def live_run(
    stack: str, policy: str, seed: int, rate: float, requests: Sequence[Request], seconds: float,
    folder: Path,
) -> tuple[list[Outcome], dict[str, Any]]:  # fmt: skip
    """One live run on a fresh emulator and server: each request's outcome, and the load
    generator's record (with the server's CPU, in cores, as `server_cores`)."""
    tls = stack in TCP_STACKS
    server_policy, model = live_policy(policy)
    name = f"{policy}-{stack}-r{rate:g}-s{seed}"
    wanted, record_path = folder / f"{name}.requests.jsonl", folder / f"{name}.json"
    save_requests(wanted, requests)
    env = {"QOS_PREMIUM_KEY": KEY}
    with Netem(LINK_3G.replace(seed=seed)) as net:
        host = net.server_address
        server = [
            sys.executable, "-m", "serving", "--deployment", DEPLOYMENT, "--host", host,
            "--port", str(TLS_PORT if tls else HTTP_PORT), "--h3-port", str(H3_PORT),
            *(["--tls"] if tls else []), "--scheduler", "rr" if tls else stack,
            "--congestion-control", CONGESTION_CONTROL, "--admission", "none",
            "--request-log", "off", *(["--policy", server_policy] if server_policy else []),
        ]  # fmt: skip
        log = folder / f"{name}.server.log"
        with log.open("wb") as server_log:
            served = net.popen(
                net.server, server, cwd=ROOT, env=env, stdout=server_log, stderr=server_log
            )
        # Asked from inside the server's namespace: the readiness check stays off the link.
        url = f"{'https' if tls else 'http'}://{host}:{TLS_PORT if tls else HTTP_PORT}"
        me = [sys.executable, "-m", "experiments.transport_macro_live"]
        waiter = net.popen(net.server, [*me, "wait", url], cwd=ROOT)
        while waiter.poll() is None:
            if served.poll() is not None:  # it died starting: no use waiting for it
                waiter.kill()
            time.sleep(0.2)
        if waiter.returncode != 0:
            raise RuntimeError(f"{name}: the server did not start; its log ends:\n"
                               f"{log.read_text()[-2000:]}")  # fmt: skip
        proto = {"h1-tls": ["h1", "--connection-per-request"], "h2-tls": ["h2"]}.get(
            stack, ["h3", "--scheduler", stack, "--congestion-control", CONGESTION_CONTROL]
        )
        client = [
            sys.executable, "-m", "workloads.replay", "--requests", str(wanted),
            "--proto", *proto, "--url", f"https://{host}:{TLS_PORT if tls else H3_PORT}",
            "--insecure", "--deployment", DEPLOYMENT, "--model", model, "--api-key", KEY,
            "--connections", "1", "--timeout", str(seconds + TIMEOUT_AFTER_RUN_S),
            "--out", str(record_path), "--no-progress",
        ]  # fmt: skip
        before = cpu_seconds(served.pid)
        with (folder / f"{name}.client.log").open("wb") as client_log:
            sender = net.popen(
                net.client, client, cwd=ROOT, env=env, stdout=client_log, stderr=client_log
            )
        try:
            # Every request ends by its --timeout: past this, the load generator is stuck.
            code = sender.wait(seconds + TIMEOUT_AFTER_RUN_S + 120)
        except subprocess.TimeoutExpired:
            code = None  # killed at the emulator's teardown
        if served.poll() is not None:  # its requests are counted, but this is no measurement
            raise RuntimeError(f"{name}: the server exited ({served.returncode}) during the run; "
                               f"its log ends:\n{log.read_text()[-2000:]}")  # fmt: skip
        spent = cpu_seconds(served.pid) - before
    if code not in (0, 1) or not record_path.exists():
        raise RuntimeError(f"{name}: the load generator exited with {code}; see "
                           f"{folder / f'{name}.client.log'}")  # fmt: skip
    record = json.loads(record_path.read_text())
    # Over the run the load generator timed, not the whole of the client's process.
    record["server_cores"] = spent / max(record["summary"]["duration_s"], 1e-9)
    outcomes = [Outcome(**o) for o in record["requests"]]
    return outcomes, record


def as_delivery(request: Request, outcome: Outcome) -> Delivery:
    """A live outcome on the co-simulation's clock (seconds from the run's start), so that both
    are scored by the same code."""
    sent = request.arrival + outcome.lag_s + outcome.credit_wait_s
    status: int | None
    if outcome.completed:
        status = 200
    elif outcome.error_kind == "timeout":
        status = None  # not done by the end, as the co-simulation leaves one at its horizon
    elif outcome.status in (None, 200):
        status = 0  # a connection's failure, or a stream that failed after its 200
    else:
        status = outcome.status  # an error answer (504, ...)
    return Delivery(
        request,
        model=outcome.model,
        tokens=outcome.output_tokens,
        status=status,
        first_token=sent + outcome.ttft_s if outcome.ttft_s is not None else None,
        done=sent + outcome.e2el_s if outcome.e2el_s is not None else None,
    )


def live_phase_row(
    deployment: Deployment, stack: str, policy: str, seed: int, rate: float, seconds: float,
    folder: Path,
) -> dict[str, object]:  # fmt: skip
    """One live run, as `transport_macro.phase_row` makes a virtual one's row, and how the run
    itself went: whether the load generator kept up, the server's CPU, the long prompts' length
    as the server counted it."""
    requests = workload(WorkloadSpec(Poisson(rate)), seed, seconds)
    outcomes, record = live_run(stack, policy, seed, rate, requests, seconds, folder)
    by_id = {o.request_id: o for o in outcomes}
    done = [as_delivery(r, by_id[r.request_id]) for r in requests]
    row = phase_row(deployment, stack, policy, "stable", seed, f"{rate:g}", done)
    del row["slo_server"]  # the server's own count is the co-simulation's alone
    health = record["client"]
    return {
        "mode": "live", **row,
        # Whether it sent on time, and had a core to do it: the load generator's own limits. A
        # wait for HTTP/3 stream credit is not one of them here: it is the stack under test,
        # and the co-simulation's aioquic client waits alike.
        "client_kept_up": health["p99_lag_ms"] <= MAX_P99_LAG_S * 1000
        and health["cpu_share_of_core"] <= MAX_CLIENT_CPU,
        "client_p99_lag_ms": round(health["p99_lag_ms"], 1),
        "client_cores": round(health["cpu_share_of_core"], 3),
        "credit_waited": health["credit_waited"],
        "server_cores": round(record["server_cores"], 3),
        "prompt_tokens_long": round(statistics.fmean([
            o.prompt_tokens for o in outcomes if o.qos_class == "long" and o.completed
            and o.prompt_tokens] or [0])),
    }  # fmt: skip


# The comparison.


class Comparison(TypedDict):
    """A run's or a cell's scores: a row of comparison.csv."""

    policy: str
    stack: str
    rate: str
    """'all' for a cell, the mean over its rates."""
    virtual: float
    live: float
    difference: float


def compare(rows: Sequence[dict[str, object]]) -> list[Comparison]:
    """Virtual and live scores side by side, and their difference: per run (policy, stack,
    rate; the mean over seeds), then per cell (policy, stack; the mean over its rates, as
    `transport_macro` scores a cell)."""
    scores: dict[tuple[str, str, str, str], list[float]] = {}  # (policy, stack, rate, mode)
    for r in rows:
        key = (str(r["policy"]), str(r["stack"]), str(r["phase"]), str(r["mode"]))
        scores.setdefault(key, []).append(as_float(r["score"]))
    runs = sorted({k[:3] for k in scores}, key=lambda k: (k[0], STACKS.index(k[1]), float(k[2])))
    run_means = {
        (*run, mode): statistics.fmean(scores[(*run, mode)]) if (*run, mode) in scores else math.nan
        for run in runs
        for mode in ("virtual", "live")
    }
    out = [_entry(*run, run_means[(*run, "virtual")], run_means[(*run, "live")]) for run in runs]
    for policy, stack in dict.fromkeys(run[:2] for run in runs):
        rates = [run[2] for run in runs if run[:2] == (policy, stack)]
        virtual, live = (
            statistics.fmean(run_means[(policy, stack, rate, mode)] for rate in rates)
            for mode in ("virtual", "live")
        )
        out.append(_entry(policy, stack, "all", virtual, live))
    return out


def _entry(policy: str, stack: str, rate: str, virtual: float, live: float) -> Comparison:
    return {"policy": policy, "stack": stack, "rate": rate, "virtual": round(virtual, 4),
            "live": round(live, 4), "difference": round(live - virtual, 4)}  # fmt: skip


def print_comparison(comparison: Sequence[Comparison]) -> list[str]:
    print(f"\n{'policy':14} {'stack':7} {'rate':>5} {'virtual':>8} {'live':>8} {'live-virt':>10}")
    for c in comparison:
        print(f"{c['policy']:14} {c['stack']:7} {c['rate']:>5} {c['virtual']:>8.3f} "
              f"{c['live']:>8.3f} {c['difference']:>+10.3f}")  # fmt: skip
    lines = []
    for scope, label in (("all", "cells (mean over their rates)"), (None, "runs (one rate)")):
        mine = [c for c in comparison if (c["rate"] == "all") == (scope == "all")]
        gaps = [abs(float(c["difference"])) for c in mine if not math.isnan(float(c["difference"]))]
        if not gaps:
            continue
        within = sum(g <= TARGET for g in gaps)
        verdict = "PASS" if within == len(gaps) else "MISS"
        lines.append(f"{verdict} {within} of {len(gaps)} {label} within {TARGET} of virtual time; "
                     f"largest gap {max(gaps):.3f}, mean {statistics.fmean(gaps):.3f}")  # fmt: skip
    return lines


def plot(comparison: Sequence[Comparison], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.fill_between([0, 1], [-TARGET, 1 - TARGET], [TARGET, 1 + TARGET], color="0.9",
                    label=f"within {TARGET}")  # fmt: skip
    ax.plot([0, 1], [0, 1], color="0.5", lw=0.8)
    runs = [c for c in comparison if c["rate"] != "all"]
    for stack in dict.fromkeys(str(c["stack"]) for c in runs):
        for policy, marker in zip(POLICIES, "os", strict=True):
            mine = [c for c in runs if c["stack"] == stack and c["policy"] == policy]
            if mine:
                ax.scatter([c["virtual"] for c in mine], [c["live"] for c in mine],
                           marker=marker, color=f"C{STACKS.index(stack)}",
                           label=f"{policy}, {stack}", alpha=0.8)  # fmt: skip
    ax.set_xlabel("virtual-time score")
    ax.set_ylabel("live score")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Each run (policy, stack, rate): live against virtual time")
    fig.tight_layout()
    fig.savefig(out / "comparison.png", dpi=120)
    plt.close(fig)


async def _wait(url: str, limit_s: float) -> int:
    import httpx

    deadline = time.monotonic() + limit_s
    async with httpx.AsyncClient(verify=False, timeout=2) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url + "/readyz")).status_code == 200:
                    return 0
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.transport_macro_live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("role", nargs="?", default="run", choices=["run", "wait"])
    parser.add_argument("url", nargs="?", help=argparse.SUPPRESS)  # wait's
    parser.add_argument("--stacks", default=",".join(LIVE_STACKS), help="comma-separated")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    parser.add_argument("--seconds", type=float, default=RATE_SECONDS, help="each run's length")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2, help="processes for the virtual runs")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--report", action="store_true", help="no runs: the comparison from --out")
    args = parser.parse_args(argv)
    if args.role == "wait":
        return asyncio.run(_wait(args.url, 120.0))
    stacks = [s for s in args.stacks.split(",") if s]
    policies = [p for p in args.policies.split(",") if p]
    if unknown := set(stacks) - set(STACKS):
        parser.error(f"unknown stacks {sorted(unknown)}; choose from {', '.join(STACKS)}")
    known = (*POLICIES, "opt-125m-only", "opt-6.7b-only")
    if unknown := set(policies) - set(known):
        parser.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(known)} "
                     "(the tuned threshold has no live twin)")  # fmt: skip
    rates = parse_rates(parser, args.rates)
    if not all(0 < v < math.inf for v in (args.seconds, *rates)):
        parser.error("--seconds and every rate must be finite numbers above 0")
    if args.seeds < 1 or args.jobs < 1:
        parser.error("--seeds and --jobs must be at least 1")
    out = Path(args.out)
    if args.report:
        rows = rows_to_report(parser, out)
    else:
        try:
            check_can_run()
        except NetemError as error:
            parser.exit(2, f"error: {error}\n")
        deployment = load_deployment(name=DEPLOYMENT).with_admission("none")
        if missing := set(policies) - set(baselines(deployment, Path("results"), only=policies)):
            parser.exit(2, f"error: no policy {sorted(missing)}: train one with "
                        "python -m router.train\n")  # fmt: skip
        cells = [
            (stack, policy, "stable", seed, rates, args.seconds)
            for seed in range(args.seeds)
            for policy in policies
            for stack in stacks
        ]
        print(f"virtual time: {len(cells)} cells x {len(rates)} rates", file=sys.stderr)
        virtual, stopped = run_cells(cells, args.jobs)
        if stopped:
            parser.exit(1, f"error: {stopped}\n")
        rows = [{"mode": "virtual", **r} for r in virtual]
        folder = out / "live"
        folder.mkdir(parents=True, exist_ok=True)
        runs = [(stack, policy, seed, rate) for stack, policy, _, seed, _, _ in cells
                for rate in rates]  # fmt: skip
        write_csv(out / "runs.csv", rows)
        try:
            for stack, policy, seed, rate in tqdm(runs, desc="live runs", unit="run"):
                row = live_phase_row(deployment, stack, policy, seed, rate, args.seconds, folder)
                rows.append(row)
                write_csv(out / "runs.csv", rows)  # each run kept as it ends
        except (KeyboardInterrupt, RuntimeError) as error:
            why = "interrupted" if isinstance(error, KeyboardInterrupt) else str(error)
            parser.exit(1, f"error: {why}\nthe runs that ended are in {out / 'runs.csv'}\n")
    comparison = compare(rows)
    write_csv(out / "comparison.csv", comparison)
    plot(comparison, out)
    lines = print_comparison(comparison)
    live = [r for r in rows if r["mode"] == "live"]
    behind = [r for r in live if str(r["client_kept_up"]) != "True"]
    tcp = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    cores = max((as_float(r["server_cores"]) for r in live), default=0.0)
    print(f"\ncongestion control: QUIC {CONGESTION_CONTROL}, TCP {tcp} (the kernel's); "
          f"the live server's CPU: up to {cores:.2f} cores")  # fmt: skip
    failed = [r for r in live if as_int(r["errors"]) + as_int(r["unfinished"])]
    if failed:
        count = sum(as_int(r["errors"]) + as_int(r["unfinished"]) for r in failed)
        print(f"note: {count} live request(s) ended in an error or unfinished, in {len(failed)} "
              f"run(s) (a miss the co-simulation counts too; the records in {out / 'live'} say "
              "why)")  # fmt: skip
    if behind:
        print(
            f"warning: the load generator fell behind in {len(behind)} live run(s): "
            + ", ".join(f"{r['policy']}/{r['stack']}@{r['phase']}" for r in behind)
        )
    for line in lines:
        print(line)
    print(f"\nwritten to {out}/ (runs.csv, comparison.csv, comparison.png, live/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
