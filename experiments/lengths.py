"""`python -m experiments.lengths`: the learned router across request lengths (issue 38).

Every length distribution of `workloads.lengths`, those trained on and those held out, at each
rate (Poisson, every class of the deployment alike), with admission control off and on, over
several seeds; on the same requests, the DQN that reads the request's lengths (the deployment's
policy, or --policy-file), another DQN to compare with (--compare), the threshold policy tuned on
the training distributions (under each admission rule) and every one-model baseline. In the
simulator: virtual time, the machine does not move the numbers.

Prints, per distribution, admission rule and rate, the mean reward per request of each, and the
DQN's margin over the best one-model policy (target: >= 0) and over the tuned threshold policy
(target: >= -0.005), each the mean over seeds. Writes results/lengths/<deployment>.csv (a row
per run), the table as markdown (.md) and a plot (.png).

With --live, instead: the DQN against --compare's on the live server (`paper-4gpu-sim`,
the twin: simulated engines in real time behind the real transport, gateway and router), on the
same requests of a held-out distribution (`--live-lengths`, default conversations) at 4 and 16
req/s, sent over HTTP/3 by the load generator with each answer's length as min_tokens (where the
twin ends it). Each policy gets a fresh server (`serving --policy-file`). Writes
results/lengths/live.csv.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
from tqdm import tqdm

from config import DEFAULT_PATH, ConfigError, Deployment, load_deployment
from experiments.output import write_csv
from router.evaluate import GRID_RATES, grid_workload, mean_reward, simulate, tune_threshold
from router.policies import DqnPolicy, Policy, QualityThreshold, Static
from router.sim import SHED
from workloads.lengths import ALL, HELD_OUT, TRAINING

RATES = GRID_RATES
ADMISSION_RULES: tuple[Literal["none", "deadline"], ...] = ("none", "deadline")
POLICY_DIR = Path(__file__).resolve().parent.parent / "router" / "policies"
COMPARE = POLICY_DIR / "paper-4gpu-lengths.npz"
"""The DQN trained across request lengths, which the default replaced back (it scores lower on
the seed's own workload), kept to compare with; its column is named after its file."""
MARGIN = 0.005
"""How far below the tuned threshold policy the DQN may fall."""
HELD_OUT_NAMES = frozenset(d.name for d in HELD_OUT)


def thresholds(
    deployment: Deployment, results: Path, episodes: int = 12
) -> dict[str, dict[str, int]]:
    """Admission rule -> QualityThreshold's thresholds, grid-searched on the training lengths
    under that rule (`router.evaluate.tune_threshold`); cached in `results` (minutes each)."""
    cache = results / f"thresholds-{deployment.name}.json"
    tuned = json.loads(cache.read_text()) if cache.exists() else {}
    on = {"lengths": [d.name for d in TRAINING], "episodes": episodes}
    if tuned.get("tuned_on") != on:  # tuned on other workloads: stale
        tuned = {"tuned_on": on}
    for rule in ADMISSION_RULES:
        if rule in tuned:
            continue
        with tqdm(desc=f"tuning thresholds, admission {rule}", unit="candidate") as bar:
            result = tune_threshold(deployment.with_admission(rule), episodes=episodes,
                                    progress=bar.update, lengths=TRAINING)  # fmt: skip
        tuned[rule] = {"thresholds": result.thresholds, "reward": round(result.reward, 4)}
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(tuned, indent=1))
    return {rule: tuned[rule]["thresholds"] for rule in ADMISSION_RULES}


def _label(path: Path | None) -> str:
    """The column of the DQN compared with: its file's name."""
    return "" if path is None else path.stem


def policies(
    deployment: Deployment, dqn: Path, before: Path | None, tuned: dict[str, int]
) -> dict[str, Callable[[], Policy]]:
    """Name -> a factory of each policy compared (all keep no state between runs)."""
    out: dict[str, Callable[[], Policy]] = {}
    for name, path in (("dqn", dqn), (_label(before), before)):
        if path is not None and name:
            policy = DqnPolicy.load(path)
            policy.check_fits(deployment)
            out[name] = lambda policy=policy: policy  # type: ignore[misc]
    out["threshold"] = lambda: QualityThreshold(deployment.quality, 32, tuned)
    for model in deployment.models:
        out[f"{model}-only"] = partial(Static, model)
    return out


def one_cell(
    config: Path,
    name: str,
    dqn: Path,
    before: Path | None,
    tuned: dict[str, dict[str, int]],
    requests: int,
    cell: tuple[str, float, str, int],
) -> list[dict[str, object]]:
    """Every policy on one (distribution, rate, admission rule, seed): a row each."""
    lengths_name, rate, rule, seed = cell
    deployment = load_deployment(config, name).with_admission(rule)  # type: ignore[arg-type]
    spec = grid_workload(deployment, ALL[lengths_name], rate)
    rows = []
    for policy, make in policies(deployment, dqn, before, tuned[rule]).items():
        done = simulate(deployment, make(), spec, seed, requests=requests)
        rows.append({
            "lengths": lengths_name, "held_out": lengths_name in HELD_OUT_NAMES,
            "admission": rule, "rate": rate, "seed": seed, "policy": policy,
            "requests": len(done), "mean_reward": mean_reward(deployment, done),
            "slo": float(np.mean([f.slo_met for f in done])),
            "shed": float(np.mean([f.outcome == SHED for f in done])),
        })  # fmt: skip
    return rows


Key = tuple[str, str, float]


def summary(rows: Sequence[dict[str, object]]) -> dict[Key, dict[str, float]]:
    """(distribution, admission rule, rate) -> policy -> mean reward over seeds."""
    runs: dict[Key, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        key = (str(r["lengths"]), str(r["admission"]), float(r["rate"]))  # type: ignore[arg-type]
        runs[key][str(r["policy"])].append(float(r["mean_reward"]))  # type: ignore[arg-type]
    return {k: {p: float(np.mean(v)) for p, v in by.items()} for k, by in runs.items()}


def table(rows: Sequence[dict[str, object]], models: Sequence[str], other: str) -> list[str]:
    """The markdown table: each cell's rewards, and the DQN's margins (! marks a miss);
    `other`: the column of the DQN compared with."""
    seeds = len({r["seed"] for r in rows})
    head = ["lengths", "admission", "rate", "dqn", other or "-", "threshold", "best one-model",
            "dqn - best one-model", "dqn - threshold"]  # fmt: skip
    lines = [
        f"Mean reward per request, mean of {seeds} seeds; ! marks a missed target "
        f"(dqn below the best one-model policy, or more than {MARGIN} below threshold).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    misses = 0
    for (lengths, rule, rate), by in summary(rows).items():
        best = max((f"{m}-only" for m in models), key=by.__getitem__)
        over_static, over_threshold = by["dqn"] - by[best], by["dqn"] - by["threshold"]
        flag_static = "!" if over_static < 0 else ""
        flag_threshold = "!" if over_threshold < -MARGIN else ""
        misses += bool(flag_static) + bool(flag_threshold)
        held = " (held out)" if lengths in HELD_OUT_NAMES else ""
        lines.append(
            f"| {lengths}{held} | {rule} | {rate:g} | {by['dqn']:.3f} | "
            f"{by.get(other, float('nan')):.3f} | {by['threshold']:.3f} | "
            f"{by[best]:.3f} ({best.removesuffix('-only')}) | {over_static:+.3f}{flag_static} | "
            f"{over_threshold:+.3f}{flag_threshold} |"
        )
    cells = len(lines) - 4
    lines += ["", f"{misses} misses in {2 * cells} targets ({cells} cells)."]
    return lines


def plot(rows: Sequence[dict[str, object]], path: Path) -> None:
    """Per distribution, the DQN's margin over the best one-model policy and over threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = summary(rows)
    names = list(dict.fromkeys(k[0] for k in by))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, rule in zip(axes, ADMISSION_RULES, strict=True):
        for name in names:
            rates = sorted(r for n, a, r in by if n == name and a == rule)
            margin = [by[name, rule, r]["dqn"] - by[name, rule, r]["threshold"] for r in rates]
            held = name in HELD_OUT_NAMES
            ax.plot(rates, margin, marker="o" if held else ".", ls="--" if held else "-",
                    label=name + (" (held out)" if held else ""))  # fmt: skip
        ax.axhline(-MARGIN, color="grey", lw=0.8)
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel="arrival rate (req/s)", title=f"admission {rule}",
               ylabel="DQN - tuned threshold, mean reward")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


LIVE_RATES = (4.0, 16.0)
LIVE_KEY = "lengths-live-key"


def run_live(
    args: argparse.Namespace, deployment: Deployment, dqns: dict[str, Path]
) -> list[dict[str, object]]:
    """Each DQN of `dqns` on the same requests, on a fresh live server each (see the module)."""
    from experiments import live
    from workloads.generate import requests
    from workloads.metrics import Outcome
    from workloads.request import save_requests

    folder = args.results / "live"
    folder.mkdir(parents=True, exist_ok=True)
    lengths = ALL[args.live_lengths]
    rows: list[dict[str, object]] = []
    cells = list(itertools.product(args.live_rates, range(args.live_seeds), dqns.items()))
    for rate, seed, (name, path) in tqdm(cells, unit="run", desc="live", file=sys.stderr):
        spec = replace(grid_workload(deployment, lengths, rate), text=True)
        sent = folder / f"requests-{lengths.name}-{rate:g}-{seed}.jsonl"
        save_requests(sent, requests(spec, seed, duration=args.live_duration))
        out = folder / f"{name}-{lengths.name}-{rate:g}-{seed}.json"
        # A premium key: the classes of the anonymous tier leave out real-time.
        flags = ["--requests", str(sent), "--no-ignore-eos", "--api-key", LIVE_KEY]
        record = live.run_live(
            deployment.name, args.config, "dqn", flags, out, str(deployment.admission.rule),
            args.connections, ["--policy-file", str(path)], {"QOS_PREMIUM_KEY": LIVE_KEY},
        )  # fmt: skip
        done = [Outcome(**o) for o in record["requests"]]
        rows.append({
            "policy": name, "lengths": lengths.name, "rate": rate, "seed": seed,
            "admission": deployment.admission.rule, "requests": len(done),
            "mean_reward": float(np.mean([o.reward for o in done])),
            "slo": float(np.mean([bool(o.slo_met) for o in done])),
            "shed": float(np.mean([o.status == 429 for o in done])),
        } | live.live_row(record))  # fmt: skip
    live.warn_of_trouble(rows, folder)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.lengths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="paper-4gpu")
    parser.add_argument("--policy-file", type=Path, help="default: the deployment's DQN")
    parser.add_argument("--compare", type=Path, default=COMPARE,
                        help="another DQN to compare with (default: the one trained across "
                        "request lengths, for paper-4gpu); 'none': no other")  # fmt: skip
    parser.add_argument("--lengths", type=lambda s: s.split(","), default=list(ALL),
                        help=f"distributions (default: all: {','.join(ALL)})")  # fmt: skip
    parser.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",")],
                        default=list(RATES), help="req/s (default: 1,4,16,48)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1500, help="per run")
    parser.add_argument("--jobs", type=int, default=2, help="processes")
    parser.add_argument("--results", type=Path, default=Path("results") / "lengths")
    parser.add_argument(
        "--live",
        action="store_true",
        help="the DQN against --compare's on the live twin instead (see above)",
    )
    parser.add_argument("--live-deployment", default="paper-4gpu-sim")
    parser.add_argument("--live-lengths", default="conversations", choices=list(ALL))
    parser.add_argument("--live-rates", type=lambda s: [float(v) for v in s.split(",")],
                        default=list(LIVE_RATES))  # fmt: skip
    parser.add_argument("--live-duration", type=float, default=60.0, help="s per run")
    parser.add_argument("--live-seeds", type=int, default=1)
    parser.add_argument("--connections", type=int, default=4, help="--live: QUIC connections")
    args = parser.parse_args()
    try:
        deployment = load_deployment(args.config, args.deployment)
    except ConfigError as exc:
        parser.error(str(exc))
    if unknown := [n for n in args.lengths if n not in ALL]:
        parser.error(f"unknown distribution(s) {', '.join(unknown)} (known: {', '.join(ALL)})")
    dqn = args.policy_file or Path(deployment.policy_file or POLICY_DIR / f"{deployment.name}.npz")
    before = None if str(args.compare) == "none" or not args.compare.exists() else args.compare
    if args.live:
        twin = load_deployment(args.config, args.live_deployment)
        dqns = {"dqn": dqn} | ({_label(before): before} if before is not None else {})
        live_rows = run_live(args, twin, dqns)
        write_csv(args.results / "live.csv", live_rows)
        for r in live_rows:
            print(f"{r['policy']:>11} {r['lengths']} {r['rate']:>4g} req/s seed {r['seed']}: "
                  f"reward {r['mean_reward']:.3f}, SLO {r['slo']:.3f}, shed {r['shed']:.3f}, "
                  f"server {r['server_cores']:.2f} cores, errors {r['errored']}")  # fmt: skip
        print(f"wrote {args.results / 'live.csv'}")
        return 0
    tuned = thresholds(deployment, args.results)
    cells = list(itertools.product(args.lengths, args.rates, ADMISSION_RULES, range(args.seeds)))
    run = partial(one_cell, args.config, deployment.name, dqn, before, tuned, args.requests)
    rows: list[dict[str, object]] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for done in tqdm(pool.map(run, cells), total=len(cells), desc="runs", file=sys.stderr):
            rows += done
    stem = args.results / deployment.name
    write_csv(stem.with_suffix(".csv"), rows)
    lines = table(rows, deployment.models, _label(before))
    command = "python -m experiments.lengths " + " ".join(sys.argv[1:])
    stem.with_suffix(".md").write_text(f"`{command.strip()}`\n\n" + "\n".join(lines) + "\n")
    plot(rows, stem.with_suffix(".png"))
    print("\n".join(lines))
    print(f"thresholds: {tuned}")
    print(f"wrote {stem}.csv, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
