"""The end-to-end benchmark of Chuppala (2024), §5.3, Tables 3 and 4: routing policy x transport
stack, with clients behind the 3G link, scored at the client.

Chat requests go to the `paper-4gpu-sim` deployment (the thesis's four GPUs, as simulated engines)
over the 3G link of `experiments.transport_micro` (5 Mbit/s, 0.5% loss, 50 ms RTT), in virtual
time (`experiments.harness.cosim`): real aioquic connections carry each response's SSE events at the
times the simulated engines make them.

Classes, as the thesis's three (choices it leaves open, made here):
- high priority, small input: OpenBookQA, `real-time` (a quarter of requests, the task mix being
  uniform);
- low priority, small input: the other three tasks, `free-tier`;
- low priority, large input: a third of the other tasks' requests, `long`, with a 1,500-token
  prompt (it fits OPT's 2,048-token context with the 128 output tokens at most).

Score: a request scores its model's quality on its task (models.yaml's table, the thesis's Table 1)
if its last token reached the client within 40 ms per token of its sending, else 0. The classes'
reward weights stay 1.0, so the score is the thesis's plain accuracy and the shipped DQN, trained
under those weights, is the one measured (no retraining). The first-token deadline (1, 2 and 7 s by
class) is reported beside it, met at the client.

Workloads: stable (Poisson at each rate from 0.25 to 48 req/s for 40 s, the cluster reset between
rates; a cell's score is the mean over rates of each rate's mean score, so every rate weighs the
same) and unpredictable (the rate switching among levels, `workloads.arrivals.SwitchingRate`).

    python -m experiments.transport_macro                # the full matrix: 8 stacks x 5 policies
    python -m experiments.transport_macro --quick        # 5 rates, 60 s unpredictable, 1 seed
    python -m experiments.transport_macro --report       # tables and plots from the last run

Writes results/transport_macro/ (runs.csv, cells.csv, tables.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from config import Deployment, load_deployment
from experiments.harness.baselines import baselines
from experiments.harness.cosim import CoSimulation, Delivery
from experiments.harness.output import as_float, as_int, write_csv
from experiments.transport_micro import LINK_3G, STACKS, mean_ci
from netsim.link import LinkConfig
from router.paths import TOKEN_BYTES
from transport.tls import ensure_certificate
from workloads import Message, Request
from workloads.arrivals import Poisson, SwitchingRate
from workloads.generate import WorkloadSpec, requests, with_background

OUT = Path("results/transport_macro")
DEPLOYMENT = "paper-4gpu-sim"
RATES = (0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
QUICK_RATES = (0.25, 1, 4, 16, 48)
RATE_SECONDS = 40.0
UNPREDICTABLE_SECONDS = 300.0
REAL_TIME_TASK = "openbookqa"
LARGE_SHARE = 1 / 3
"""Of the low-priority tasks' requests, the share with a large input."""
LARGE_PROMPT_TOKENS = 1500
WORKLOADS = ("stable", "unpredictable")

THESIS_TABLES = {
    # stack: (Table 3: OPT-2.7B, OPT-1.3B, policy; Table 4: the same), the thesis's §5.3
    "rr": (0.20, 0.25, 0.42, 0.19, 0.54, 0.42),
    "fcfs": (0.19, 0.24, 0.36, 0.17, 0.53, 0.36),
    "edf": (0.21, 0.37, 0.52, 0.19, 0.64, 0.48),
    "abs": (0.20, 0.35, 0.49, 0.18, 0.62, 0.46),
    "ml": (0.21, 0.29, 0.45, 0.19, 0.57, 0.44),
    "h1-tls": (0.20, 0.24, 0.41, 0.18, 0.54, 0.41),
    "h2-tls": (0.18, 0.22, 0.31, 0.16, 0.51, 0.35),
}
"""pifo has no column in the thesis. Its TLS/TCP is a connection per request (h1-tls here) and
its TLS/TCP-1conn one connection for all (h2-tls)."""


def classify(request: Request, rng: np.random.Generator, padding: np.random.Generator) -> Request:
    """The thesis's three classes, from the task. A large input is the task's example led by
    background text (from `padding`) to about 1,500 tokens, so that a live server reads as long a
    prompt as the simulator counts."""
    if request.task == REAL_TIME_TASK:
        return dataclasses.replace(request, qos_class="real-time")
    if rng.random() < LARGE_SHARE:
        assert isinstance(request.prompt, tuple)  # workloads.generate makes chats
        *before, last = request.prompt
        long = with_background(last.content, LARGE_PROMPT_TOKENS, padding)
        return dataclasses.replace(
            request,
            qos_class="long",
            prompt=(*before, Message(last.role, long)),
            prompt_tokens=LARGE_PROMPT_TOKENS,
        )
    return dataclasses.replace(request, qos_class="free-tier")


def workload(spec: WorkloadSpec, seed: int, duration: float) -> list[Request]:
    # Generators apart from the arrivals' and contents', and from each other, so that the
    # padding leaves the classes alone.
    rng, padding = np.random.default_rng([seed, 2]), np.random.default_rng([seed, 3])
    return [classify(r, rng, padding) for r in requests(spec, seed, duration)]


def phases(
    kind: str, seed: int, rates: Sequence[float], seconds: float
) -> list[tuple[str, list[Request]]]:
    """A workload as runs, each on a fresh cluster: (label, its requests). `seconds`: each
    rate's for the stable workload, the whole for the unpredictable."""
    if kind == "stable":
        return [(f"{rate:g}", workload(WorkloadSpec(Poisson(rate)), seed, seconds))
                for rate in rates]  # fmt: skip
    return [("all", workload(WorkloadSpec(SwitchingRate()), seed, seconds))]


def score(deployment: Deployment, d: Delivery) -> float:
    """The model's quality on the task if the SLO was met at the client, else 0."""
    return deployment.reward(
        d.request.task, d.model, d.request.qos_class, met_at_client(deployment, d)
    )


def met_at_client(deployment: Deployment, d: Delivery) -> bool:
    return d.status == 200 and d.done is not None and deployment.slo.met(d.done - d.sent, d.tokens)


def first_token_met(deployment: Deployment, d: Delivery) -> bool:
    deadline = deployment.qos_classes[d.request.qos_class].deadline_s
    return d.first_token is not None and d.first_token - d.sent <= deadline


# One cell: a stack, a policy, a workload and a seed; run in a worker process.

_certificate: tuple[Path, Path] | None = None


Cell = tuple[str, str, str, int, tuple[float, ...], float]
"""(stack, policy, workload, seed, the stable workload's rates, seconds a phase)."""


def run_cell(cell: Cell) -> list[dict[str, object]]:
    stack, policy_name, kind, seed, rates, seconds = cell
    deployment = load_deployment(name=DEPLOYMENT).with_admission("none")
    assert _certificate is not None
    rows = []
    make_policy = baselines(deployment, Path("results"), only=[policy_name])[policy_name]
    for label, reqs in phases(kind, seed, rates, seconds):
        policy = make_policy()  # fresh for each cluster, as round-robin keeps state
        started = time.monotonic()
        sim = CoSimulation(
            stack, deployment, policy, reqs, LINK_3G.replace(seed=seed), _certificate
        )
        horizon = max(
            (r.arrival + deployment.slo.tpot_s * (r.max_tokens or 1) for r in reqs), default=0.0
        )
        done = sim.run(horizon + 1.0)
        down = sim.path.bytes_sent[1] * 8 / seconds / 1e6
        cpu = round(time.monotonic() - started, 2)
        row = phase_row(deployment, stack, policy_name, kind, seed, label, done)
        rows.append(row | {"downlink_mbps": round(down, 3), "cpu_s": cpu})
    return rows


def phase_row(
    deployment: Deployment, stack: str, policy: str, kind: str, seed: int, label: str,
    done: Sequence[Delivery],
) -> dict[str, object]:  # fmt: skip
    n = max(1, len(done))
    by_class = {}
    for qos_class in deployment.qos_classes:
        mine = [d for d in done if d.request.qos_class == qos_class]
        if mine:
            by_class[f"slo:{qos_class}"] = round(
                sum(met_at_client(deployment, d) for d in mine) / len(mine), 4
            )
    return {
        "stack": stack, "policy": policy, "workload": kind, "seed": seed, "phase": label,
        "requests": len(done),
        "score": round(sum(score(deployment, d) for d in done) / n, 4),
        "slo_client": round(sum(met_at_client(deployment, d) for d in done) / n, 4),
        "slo_server": round(sum(d.server_slo_met for d in done) / n, 4),
        "first_token_met": round(sum(first_token_met(deployment, d) for d in done) / n, 4),
        "unfinished": sum(d.status is None for d in done),
        "errors": sum(d.status not in (None, 200) for d in done),
        **by_class,
        **{f"share:{m}": round(sum(d.model == m for d in done) / n, 4) for m in deployment.models},
    }  # fmt: skip


def run_cells(cells: list[Cell], jobs: int) -> tuple[list[dict[str, object]], str | None]:
    """Every cell's rows, in `jobs` processes; and why it stopped early, if it did (what had
    finished is kept either way)."""
    rows: list[dict[str, object]] = []
    finished = 0
    with tempfile.TemporaryDirectory() as scratch:
        certificate = ensure_certificate(Path(scratch), deterministic=True)
        # Not multiprocessing.Pool: a worker killed mid-cell (by the OOM killer, say) leaves
        # Pool waiting forever for its result, where the executor says the pool broke.
        pool = ProcessPoolExecutor(
            jobs, multiprocessing.get_context("fork"), _init_worker, (certificate,)
        )
        futures = [pool.submit(run_cell, cell) for cell in cells]
        try:
            for future in tqdm(as_completed(futures), total=len(cells), unit="cell"):
                rows += future.result()
                finished += 1
        except (KeyboardInterrupt, Exception) as error:
            pool.shutdown(wait=False, cancel_futures=True)
            if isinstance(error, KeyboardInterrupt):
                why = "interrupted"
            elif isinstance(error, BrokenProcessPool):
                why = "a worker died"
            else:  # a cell's own failure: the others' rows are still worth keeping
                why = f"a cell failed ({type(error).__name__}: {error})"
            return rows, f"{why}: {len(cells) - finished} of {len(cells)} cells did not finish"
        pool.shutdown()
    return rows, None


def _init_worker(certificate: tuple[Path, Path]) -> None:
    global _certificate
    _certificate = certificate


# Tables.


def cell_scores(rows: list[dict[str, object]]) -> dict[tuple[str, str, str], list[float]]:
    """(workload, stack, policy) -> its score per seed (stable: the mean over rates)."""
    per_seed: dict[tuple[str, str, str, int], list[float]] = {}
    for r in rows:
        key = (str(r["workload"]), str(r["stack"]), str(r["policy"]), as_int(r["seed"]))
        per_seed.setdefault(key, []).append(as_float(r["score"]))
    out: dict[tuple[str, str, str], list[float]] = {}
    for (kind, stack, policy, _), scores in sorted(per_seed.items()):
        out.setdefault((kind, stack, policy), []).append(statistics.fmean(scores))
    return out


def print_tables(rows: list[dict[str, object]], policies: list[str]) -> list[dict[str, object]]:
    scores = cell_scores(rows)
    summary = []
    for number, kind in ((3, "stable"), (4, "unpredictable")):
        stacks = [s for s in STACKS if any((kind, s, p) in scores for p in policies)]
        if not stacks:
            continue
        offset = 0 if kind == "stable" else 3
        print(f"\nTable {number} ({kind}): mean score at the client (± 95% CI over seeds); "
              "the thesis's OPT-2.7B / OPT-1.3B / policy on the right")  # fmt: skip
        print(
            f"{'stack':8} "
            + " ".join(f"{p:>16}" for p in policies)
            + "   thesis: 2.7B  1.3B  policy"
        )
        for stack in stacks:
            cells = []
            for policy in policies:
                values = scores.get((kind, stack, policy))
                if not values:
                    cells.append(f"{'-':>16}")
                    continue
                mean, ci = mean_ci(values)
                cells.append(f"{mean:>8.3f} ± {0 if math.isnan(ci) else ci:.3f}")
                summary.append({"workload": kind, "stack": stack, "policy": policy,
                                "seeds": len(values), "score": round(mean, 4),
                                "ci95": round(ci, 4), "min": round(min(values), 4),
                                "max": round(max(values), 4)})  # fmt: skip
            thesis = THESIS_TABLES.get(stack)
            theirs = "  ".join(f"{v:.2f}" for v in thesis[offset : offset + 3]) if thesis else "  -"
            print(f"{stack:8} " + " ".join(cells) + f"   {theirs}")
    return summary


NET_MARGIN = 0.05
"""The target for the network-aware DQN: its margin over the best static x scheduler cell."""


def check_targets(summary: list[dict[str, object]]) -> list[str]:
    lines = []
    get = {
        (str(r["workload"]), str(r["stack"]), str(r["policy"])): as_float(r["score"])
        for r in summary
    }
    for kind in WORKLOADS:
        dqn = {s: v for (k, s, p), v in get.items() if k == kind and p == "dqn"}
        static = {(s, p): v for (k, s, p), v in get.items() if k == kind and p.endswith("-only")}
        if not dqn or not static:
            continue
        best_stack = max(dqn, key=lambda s: dqn[s])
        rival = max(static, key=lambda sp: static[sp])
        ok = dqn[best_stack] > static[rival]
        lines.append(f"{'PASS' if ok else 'MISS'} {kind}: the DQN with {best_stack} "
                     f"({dqn[best_stack]:.3f}) beats every static x scheduler cell (best: "
                     f"{rival[1]} with {rival[0]}, {static[rival]:.3f})")  # fmt: skip
        net = {s: v for (k, s, p), v in get.items() if k == kind and p == "dqn-net"}
        if net:
            best = max(net, key=lambda s: net[s])
            margin = net[best] - static[rival]
            lost = kind == "unpredictable"
            thesis = " (the thesis lost it by 0.16: 0.48 against 0.64)" if lost else ""
            lines.append(f"{'PASS' if margin >= NET_MARGIN else 'MISS'} {kind}: the network-aware "
                         f"DQN with {best} ({net[best]:.3f}) against the best static x scheduler "
                         f"cell ({rival[1]} with {rival[0]}, {static[rival]:.3f}): {margin:+.3f} "
                         f"(target: +{NET_MARGIN}){thesis}")  # fmt: skip
        quic = {s: v for s, v in dqn.items() if s not in ("h1-tls", "h2-tls")}
        others = [s for s in ("rr", "h1-tls", "h2-tls") if s in dqn]
        if quic and others:
            best_quic = max(quic, key=lambda s: quic[s])
            ok = all(quic[best_quic] > dqn[s] for s in others if s != best_quic)
            lines.append(f"{'PASS' if ok else 'MISS'} {kind}: for the DQN, the best QUIC scheduler "
                         f"({best_quic}, {quic[best_quic]:.3f}) beats " + ", ".join(
                             f"{s} {dqn[s]:.3f}" for s in others))  # fmt: skip
    return lines


def saturation(rates: Sequence[float], link: LinkConfig) -> list[str]:
    """Where the link saturates: the response bytes each rate asks of the downlink (from a
    sample of RATE_SECONDS of the workload; the classes do not change a response's length)."""
    lines = []
    for rate in rates:
        reqs = requests(WorkloadSpec(Poisson(rate)), 0, RATE_SECONDS)
        tokens = sum(r.max_tokens or 1 for r in reqs)
        mbps = tokens * TOKEN_BYTES * 8 / RATE_SECONDS / 1e6
        lines.append(f"{rate:>6g} req/s: {mbps:6.2f} Mbit/s of SSE events"
                     f"{'  > the link' if mbps > link.rate_bps / 1e6 else ''}")  # fmt: skip
    return lines


def plot(summary: list[dict[str, object]], policies: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=True)
    for ax, kind in zip(axes, WORKLOADS, strict=True):
        mine = [r for r in summary if r["workload"] == kind]
        stacks = [s for s in STACKS if any(r["stack"] == s for r in mine)]
        width = 0.8 / max(1, len(policies))
        for k, policy in enumerate(policies):
            cells = {str(r["stack"]): r for r in mine if r["policy"] == policy}
            xs = [
                i + (k - (len(policies) - 1) / 2) * width
                for i, s in enumerate(stacks)
                if s in cells
            ]
            ax.bar(xs, [as_float(cells[s]["score"]) for s in stacks if s in cells], width,
                   yerr=[as_float(cells[s]["ci95"]) if not math.isnan(as_float(cells[s]["ci95"]))
                         else 0 for s in stacks if s in cells],
                   capsize=2, label=policy)  # fmt: skip
        ax.set_xticks(range(len(stacks)), stacks)
        ax.set_title(f"{kind} (Table {3 if kind == 'stable' else 4})")
        ax.set_ylabel("mean score at the client")
    axes[0].legend(fontsize=8)
    fig.suptitle("Policy x stack over the 3G link, paper-4gpu-sim; 95% CI over seeds")
    fig.tight_layout()
    fig.savefig(out / "tables.png", dpi=120)
    plt.close(fig)


def read_rows(path: Path) -> list[dict[str, object]]:
    import csv

    with path.open() as f:
        return list(csv.DictReader(f))


def parse_rates(parser: argparse.ArgumentParser, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        parser.error(f"--rates takes numbers separated by commas, not {text!r}")


def rows_to_report(parser: argparse.ArgumentParser, out: Path) -> list[dict[str, object]]:
    """--report's rows: the last run's, from `out`; or a usage error that says why there are
    none."""
    try:
        rows = read_rows(out / "runs.csv")
    except OSError as error:
        parser.exit(2, f"error: no run to report: {error}\n")
    if not rows:
        parser.exit(2, f"error: {out / 'runs.csv'} has no runs\n")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.transport_macro",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--stacks", default=",".join(STACKS), help="comma-separated")
    parser.add_argument(
        "--policies",
        default=None,
        help="comma-separated (default: static models, threshold, dqn; dqn-net, the "
        "network-aware DQN, on request)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rates", default=None, help="stable's rates, comma-separated")
    parser.add_argument(
        "--seconds",
        type=float,
        default=UNPREDICTABLE_SECONDS,
        help="the unpredictable workload's length",
    )
    parser.add_argument("--rate-seconds", type=float, default=RATE_SECONDS,
                        help="the stable workload's time at each rate")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="5 rates, 60 s unpredictable, 1 seed")
    parser.add_argument("--jobs", type=int, default=max(1, (multiprocessing.cpu_count() or 1)))
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--report", action="store_true", help="no runs: tables from --out")
    args = parser.parse_args(argv)
    deployment = load_deployment(name=DEPLOYMENT).with_admission("none")
    default_policies = [f"{m}-only" for m in deployment.models] + ["threshold", "dqn"]
    known = default_policies + (["dqn-net"] if deployment.policy.net_path else [])
    policies = args.policies.split(",") if args.policies else default_policies
    stacks = [s for s in args.stacks.split(",") if s]
    kinds = [k for k in args.workloads.split(",") if k]
    if unknown := set(stacks) - set(STACKS):
        parser.error(f"unknown stacks {sorted(unknown)}; choose from {', '.join(STACKS)}")
    if unknown := set(kinds) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    if unknown := set(policies) - set(known):
        parser.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(known)}")
    rates = parse_rates(parser, args.rates) if args.rates else RATES
    if args.quick:
        rates, args.seconds, args.seeds = QUICK_RATES, 60.0, 1
    if args.seeds < 1 or args.jobs < 1:
        parser.error("--seeds and --jobs must be at least 1")
    if not all(0 < v < math.inf for v in (args.seconds, args.rate_seconds, *rates)):
        parser.error("--seconds, --rate-seconds and every rate must be finite numbers above 0")
    out = Path(args.out)
    if args.report:
        rows = rows_to_report(parser, out)
        stable = {as_float(r["phase"]) for r in rows if r["workload"] == "stable"}
        rates = tuple(sorted(stable)) or rates
    else:
        available = baselines(deployment, Path("results"), only=policies)  # tunes once, cached
        if missing := [p for p in policies if p not in available]:
            parser.exit(2, f"error: no policy {missing}: train one with python -m router.train\n")
        out.mkdir(parents=True, exist_ok=True)
        length = {"stable": args.rate_seconds, "unpredictable": args.seconds}
        cells = [(stack, policy, kind, seed, rates, length[kind])
                 for kind in kinds for seed in range(args.seeds)
                 for policy in policies for stack in stacks]  # fmt: skip
        rows, stopped = run_cells(cells, args.jobs)
        if rows:
            write_csv(out / "runs.csv", rows)
        if stopped:
            kept = f"; the {len(rows)} runs that ended are in {out / 'runs.csv'}" if rows else ""
            parser.exit(1, f"error: {stopped}{kept}\n")
    summary = print_tables(rows, policies)
    if not summary:
        parser.exit(2, f"error: {out / 'runs.csv'} has no runs of {', '.join(policies)}\n")
    write_csv(out / "cells.csv", summary)
    plot(summary, policies, out)
    print()
    for line in check_targets(summary):
        print(line)
    print(f"\nWhere the 3G link saturates (its downlink: {LINK_3G.rate_bps / 1e6:g} Mbit/s):")
    for line in saturation(rates, LINK_3G):
        print("  " + line)
    print(f"\nwritten to {out}/ (runs.csv, cells.csv, tables.png)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
