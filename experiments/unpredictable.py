"""`python -m experiments.unpredictable`: Table 2 and Figure 6 of Chuppala (2024).

The arrival rate switches at random among levels from 0.25 to 48 req/s, each held for an
exponentially distributed time (MAF2-style bursts, `workloads.arrivals.SwitchingRate`). For every
policy: mean reward, and the number of sliding windows of 20 requests whose mean reward reaches
= 1.00, >= 0.99, >= 0.98, >= 0.96 and >= 0.94, summed over seeds; then the ratios to the biggest
model alone, and the DQN's margin over the tuned threshold heuristic.

In the simulator by default. With --live, the same workloads also go through the real server
(see experiments.stable); --quick runs the DQN and the biggest model alone, one seed of 300 s.

Writes results/unpredictable-<deployment>.csv and .png (-live.csv and .png with --live), and
prints the table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from config import DEFAULT_PATH, ConfigError, Deployment, load_deployment
from experiments.harness import live
from experiments.harness.baselines import (
    add_admission_argument,
    add_previous_argument,
    baselines,
    previous_dqn,
)
from experiments.harness.output import as_float, as_int, write_csv
from experiments.stable import interval
from router.evaluate import outcomes, simulate
from workloads.arrivals import SwitchingRate
from workloads.generate import WorkloadSpec
from workloads.summary import WINDOW_THRESHOLDS, summarize

KEYS = [f"{t:.2f}" for t in WINDOW_THRESHOLDS]


def row(policy: str, seed: int, summary: dict) -> dict[str, object]:
    counts = summary["windows"]["reward_at_least"]
    return {"policy": policy, "seed": seed, "requests": summary["sent"],
            "mean_reward": summary["mean_reward"], "slo": summary["slo_attainment"]} | {
        f">={k}": counts[k] for k in KEYS}  # fmt: skip


def report(rows: list[dict[str, object]], deployment: Deployment, caption: str) -> None:
    """Table 2 for these rows: windows per threshold summed over seeds, and the ratios."""
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    totals = {
        name: {k: sum(as_int(r[f">={k}"]) for r in rows if r["policy"] == name) for k in KEYS}
        for name in policies
    }
    rewards = {
        name: [as_float(r["mean_reward"]) for r in rows if r["policy"] == name] for name in policies
    }
    print(caption)
    print(f"{'policy':>16} {'reward':>14} " + " ".join(f"{'>=' + k:>8}" for k in KEYS))
    for name in policies:
        r = rewards[name]
        print(f"{name:>16} {np.mean(r):>7.3f} +-{np.std(r):.3f} "
              + " ".join(f"{totals[name][k]:>8}" for k in KEYS))  # fmt: skip
    big = f"{deployment.models[-1]}-only"
    if "dqn" in policies and big in policies:
        for k in ("0.99", "0.96"):
            ratio = totals["dqn"][k] / max(1, totals[big][k])
            print(f"DQN / {big}, windows >= {k}: {ratio:.2f}x")
    for rival in ("dqn-previous", "threshold"):
        if "dqn" in policies and rival in policies:
            paired = [as_float(a["mean_reward"]) - as_float(b["mean_reward"])
                      for a in rows if a["policy"] == "dqn"
                      for b in rows if b["policy"] == rival and b["seed"] == a["seed"]]  # fmt: skip
            margin = float(np.mean(paired))
            print(f"DQN - {rival}, mean reward, paired over seeds: {margin:+.4f} "
                  f"(95% ci {interval(paired):.4f}; target >= 0): "
                  + ("met" if margin >= 0 else "missed"))  # fmt: skip


def run_live(
    args: argparse.Namespace, deployment: Deployment, policies: Sequence[str]
) -> tuple[list[dict[str, object]], dict[str, np.ndarray]]:
    rows, traces = [], {}
    folder = args.results / f"unpredictable-{deployment.name}{args.tag}-live"
    levels = args.levels or SwitchingRate().levels
    runs = [(p, seed) for p in policies for seed in range(args.seeds)]
    for name, seed in tqdm(runs, unit="run", desc="live"):
        flags = ["--arrivals", "switching", "--levels", ",".join(f"{v:g}" for v in levels),
                 "--mean-level-s", f"{args.mean_level_s:g}", "--duration", f"{args.duration:g}",
                 "--seed", str(seed), "--window", str(args.window)]  # fmt: skip
        out = folder / f"{name}-{seed}.json"
        record = live.run_live(
            deployment.name, args.config, name, flags, out, args.admission, args.connections
        )
        rows.append(row(name, seed, record["summary"]) | live.live_row(record))
        if seed == 0:
            traces[name] = np.asarray(record["summary"]["windows"]["mean_reward"])
    return rows, traces


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.unpredictable", description=__doc__
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="paper-4gpu")
    parser.add_argument("--policy-file", type=Path, help="default: the deployment's DQN")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds per seed (default: 600; 300 with --quick)")  # fmt: skip
    parser.add_argument("--mean-level-s", type=float, default=10.0)
    parser.add_argument(
        "--levels",
        type=lambda text: tuple(float(v) for v in text.split(",")),
        default=None,
        help="rates to switch among, req/s (default: SwitchingRate's, 0.25 to 48)",
    )
    parser.add_argument("--tag", default="", help="suffix for the output files")
    parser.add_argument("--seeds", type=int, default=None, help="default: 3 (1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="the DQN and the biggest model alone, one seed of 300 s")  # fmt: skip
    live.add_live_arguments(parser)
    add_admission_argument(parser)
    add_previous_argument(parser)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    live.check_live_arguments(parser, args)
    args.duration = args.duration or (300.0 if args.quick else 600.0)
    args.seeds = args.seeds or (1 if args.quick else 3)
    try:
        deployment = load_deployment(args.config, args.deployment).with_admission(args.admission)
    except ConfigError as exc:
        parser.error(str(exc))
    only = ["dqn", f"{deployment.models[-1]}{live.STATIC_SUFFIX}"] if args.quick else None
    previous = previous_dqn(args.previous, args.policy_file, deployment)
    policies = baselines(deployment, args.results, args.policy_file, only, previous)
    arrivals = (
        SwitchingRate(levels=args.levels, mean_duration_s=args.mean_level_s)
        if args.levels
        else SwitchingRate(mean_duration_s=args.mean_level_s)
    )
    spec = WorkloadSpec(arrivals=arrivals)
    rows: list[dict[str, object]] = []
    traces: dict[str, np.ndarray] = {}
    runs = [(p, seed) for p in policies for seed in range(args.seeds)]
    for name, seed in tqdm(runs, unit="run", desc="simulated"):
        done = simulate(deployment, policies[name](), spec, seed, duration=args.duration)
        summary = summarize(outcomes(deployment, done), args.duration, args.window)
        rows.append(row(name, seed, summary))
        if seed == 0:
            traces[name] = np.asarray(summary["windows"]["mean_reward"])
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"unpredictable-{deployment.name}{args.tag}"
    write_csv(Path(f"{stem}.csv"), rows)
    print(f"levels {arrivals.levels} req/s, mean {args.mean_level_s:g} s each")
    caption = (f"simulated: windows of {args.window} requests, summed over {args.seeds} seeds of "
               f"{args.duration:g} s; mean reward over seeds (+- std)")  # fmt: skip
    report(rows, deployment, caption)
    plot([("simulated", traces)], arrivals, args.duration, Path(f"{stem}.png"), args.window)
    print(f"wrote {stem}.csv and {stem}.png")
    if args.live:
        names = [p for p in policies if live.runs_live(p)]
        real, live_traces = run_live(args, deployment, names)
        both = [r | {"mode": "live"} for r in real]
        both += [r | {"mode": "simulated"} for r in rows if r["policy"] in names]
        write_csv(Path(f"{stem}-live.csv"), both)
        report(real, deployment, "live: the same workloads on the live server")
        sim_traces = {n: t for n, t in traces.items() if n in names}
        plot([("simulated", sim_traces), ("live", live_traces)], arrivals, args.duration,
             Path(f"{stem}-live.png"), args.window)  # fmt: skip
        live.warn_of_trouble(real, args.results / f"unpredictable-{deployment.name}{args.tag}-live")
        print(f"wrote {stem}-live.csv and {stem}-live.png")
    return 0


def plot(
    panels: Sequence[tuple[str, dict[str, np.ndarray]]],
    arrivals: SwitchingRate,
    duration: float,
    path: Path,
    window: int,
) -> None:
    """Figure 6 (seed 0): each panel's reward traces over the requests, side by side, above the
    arrival rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(panels), figsize=(11 * len(panels), 6), squeeze=False)
    for (title, traces), top, bottom in zip(panels, axes[0], axes[1], strict=True):
        for name, trace in traces.items():
            top.plot(trace, lw=2 if name == "dqn" else 0.7, label=name,
                     alpha=1 if name == "dqn" else 0.7)  # fmt: skip
        top.set(xlabel="request", ylabel=f"mean reward of the last {window}", ylim=(0, 1.05))
        top.set_title(f"Figure 6: unpredictable workload (seed 0), {title}")
        top.legend(fontsize=7, ncol=3)
        levels = arrivals.schedule(0, duration)
        bottom.step([t for t, _ in levels] + [duration], [r for _, r in levels] + [levels[-1][1]],
                    where="post")  # fmt: skip
        bottom.set(xlabel="time (s)", ylabel="arrival rate (req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
