"""`python -m experiments.unpredictable`: seed 004 Table 2 and Figure 6, in simulation.

The arrival rate switches at random among levels from 0.25 to 48 req/s, each held for an
exponentially distributed time (MAF2-style bursts, `workloads.arrivals.SwitchingRate`). For every
policy: mean reward, and the number of sliding windows of 20 requests whose mean reward reaches
= 1.00, >= 0.99, >= 0.98, >= 0.96 and >= 0.94, summed over seeds; then the ratios to the biggest
model alone, and the DQN's margin over the tuned threshold heuristic.

Writes results/unpredictable-<deployment>.csv and .png, and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from config import DEFAULT_PATH, ConfigError, load_deployment
from experiments.output import write_csv
from experiments.policies import add_admission_argument, baselines
from router.evaluate import outcomes, simulate
from workloads.arrivals import SwitchingRate
from workloads.generate import WorkloadSpec
from workloads.metrics import WINDOW_THRESHOLDS, summarize


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.unpredictable", description=__doc__
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="paper-4gpu")
    parser.add_argument("--policy-file", type=Path, help="default: router/policies/<dep>.npz")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds per seed")
    parser.add_argument("--mean-level-s", type=float, default=10.0)
    parser.add_argument(
        "--levels",
        type=lambda text: tuple(float(v) for v in text.split(",")),
        default=None,
        help="rates to switch among, req/s (default: SwitchingRate's, 0.25 to 48)",
    )
    parser.add_argument("--tag", default="", help="suffix for the output files")
    parser.add_argument("--seeds", type=int, default=3)
    add_admission_argument(parser)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    try:
        deployment = load_deployment(args.config, args.deployment).with_admission(args.admission)
    except ConfigError as exc:
        parser.error(str(exc))
    policies = baselines(deployment, args.results, args.policy_file)
    arrivals = (
        SwitchingRate(levels=args.levels, mean_duration_s=args.mean_level_s)
        if args.levels
        else SwitchingRate(mean_duration_s=args.mean_level_s)
    )
    spec = WorkloadSpec(arrivals=arrivals)
    keys = [f"{t:.2f}" for t in WINDOW_THRESHOLDS]
    rows: list[dict[str, object]] = []
    traces: dict[str, np.ndarray] = {}
    with tqdm(total=len(policies) * args.seeds, unit="run") as bar:
        for name, factory in policies.items():
            for seed in range(args.seeds):
                done = simulate(deployment, factory(), spec, seed, duration=args.duration)
                summary = summarize(outcomes(deployment, done), args.duration, args.window)
                counts = summary["windows"]["reward_at_least"]
                rows.append(
                    {"policy": name, "seed": seed, "requests": len(done),
                     "mean_reward": summary["mean_reward"], "slo": summary["slo_attainment"]}
                    | {f">={k}": counts[k] for k in keys}
                )  # fmt: skip
                if seed == 0:
                    traces[name] = np.asarray(summary["windows"]["mean_reward"])
                bar.update(1)
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"unpredictable-{deployment.name}{args.tag}"
    write_csv(Path(f"{stem}.csv"), rows)
    totals = {
        name: {k: sum(int(r[f">={k}"]) for r in rows if r["policy"] == name) for k in keys}  # type: ignore[call-overload]
        for name in policies
    }
    rewards = {
        name: [float(r["mean_reward"]) for r in rows if r["policy"] == name]  # type: ignore[arg-type]
        for name in policies
    }
    big = f"{deployment.models[-1]}-only"
    print(f"levels {arrivals.levels} req/s, mean {args.mean_level_s:g} s each")
    print(f"windows of {args.window} requests, summed over {args.seeds} seeds of "
          f"{args.duration:g} s; mean reward is the mean over seeds (+- std)")  # fmt: skip
    print(f"{'policy':>16} {'reward':>14} " + " ".join(f"{'>=' + k:>8}" for k in keys))
    for name in policies:
        r = rewards[name]
        print(f"{name:>16} {np.mean(r):>7.3f} +-{np.std(r):.3f} "
              + " ".join(f"{totals[name][k]:>8}" for k in keys))  # fmt: skip
    if "dqn" in policies:
        for k in ("0.99", "0.96"):
            ratio = totals["dqn"][k] / max(1, totals[big][k])
            print(f"DQN / {big}, windows >= {k}: {ratio:.2f}x")
        margin = np.mean(rewards["dqn"]) - np.mean(rewards["threshold"])
        print(f"DQN - tuned threshold, mean reward: {margin:+.4f}")
    plot(traces, arrivals, args.duration, Path(f"{stem}.png"), args.window)
    print(f"wrote {stem}.csv and {stem}.png")
    return 0


def plot(
    traces: dict[str, np.ndarray],
    arrivals: SwitchingRate,
    duration: float,
    path: Path,
    window: int,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=False)
    for name, trace in traces.items():
        top.plot(
            trace, lw=2 if name == "dqn" else 0.7, label=name, alpha=1 if name == "dqn" else 0.7
        )
    top.set(xlabel="request", ylabel=f"mean reward of the last {window}")
    top.set_title("Figure 6: unpredictable workload (seed 0)")
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
