"""`python -m experiments.stable`: seed 004 Figures 4 and 5, the stable workload, in simulation.

Poisson arrivals at each rate from 0.25 to 48 req/s for 40 s, the cluster reset between rates,
over several seeds. For every policy: mean reward per request and SLO attainment; for the DQN, its
share of requests per model (Figure 4's lower panel) and per task (Figure 5).

Writes results/stable-<deployment>.csv and .png and prints the table with the targets' checks.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from config import DEFAULT_PATH, ConfigError, load_deployment
from experiments.output import write_csv
from experiments.policies import add_admission_argument, baselines
from router.evaluate import mean_reward, simulate
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec

RATES = (0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    deployment = load_deployment(args.config, args.deployment).with_admission(args.admission)
    policies = baselines(deployment, args.results, args.policy_file)
    rows: list[dict[str, object]] = []
    with tqdm(total=len(policies) * len(args.rates) * args.seeds, unit="run") as bar:
        for name, factory in policies.items():
            for rate in args.rates:
                for seed in range(args.seeds):
                    spec = WorkloadSpec(arrivals=Poisson(rate))
                    done = simulate(deployment, factory(), spec, seed, duration=args.duration)
                    row: dict[str, object] = {
                        "policy": name,
                        "rate": rate,
                        "seed": seed,
                        "requests": len(done),
                        "mean_reward": mean_reward(deployment, done),
                        "slo": float(np.mean([f.slo_met for f in done])) if done else 0.0,
                    }
                    models = Counter(f.model for f in done)
                    for m in deployment.models:
                        row[f"share:{m}"] = models[m] / max(1, len(done))
                    for task in deployment.tasks:
                        of_task = [f for f in done if f.request.task == task]
                        for m in deployment.models:
                            n = sum(1 for f in of_task if f.model == m)
                            row[f"share:{task}:{m}"] = n / max(1, len(of_task))
                    rows.append(row)
                    bar.update(1)
    return rows


def mean_by(
    rows: list[dict[str, object]], key: str, reduce: Callable[[list[float]], float] = np.mean
) -> dict[tuple[str, float], float]:
    """`key` over the seeds, per (policy, rate): the mean, or `reduce` (np.std for the spread)."""
    groups: dict[tuple[str, float], list[float]] = {}
    for r in rows:
        groups.setdefault((str(r["policy"]), float(r["rate"])), []).append(float(r[key]))  # type: ignore[arg-type]
    return {k: float(reduce(v)) for k, v in groups.items()}


def targets(rows: list[dict[str, object]], models: list[str], rates: list[float]) -> list[str]:
    """The issue's Figure 4 targets, checked on these rows."""
    reward = mean_by(rows, "mean_reward")
    if ("dqn", rates[0]) not in reward:
        return ["no trained DQN policy: targets not checked"]
    statics = [f"{m}-only" for m in models]
    big = statics[-1]  # placement order lists the models smallest first
    by = {(str(r["policy"]), float(r["rate"]), int(r["seed"])): float(r["mean_reward"])  # type: ignore[arg-type]
          for r in rows}  # fmt: skip
    seeds = sorted({int(r["seed"]) for r in rows})  # type: ignore[call-overload]
    lines, short = [], []
    for rate in rates:  # paired by seed: every policy saw the same arrivals
        d = [by["dqn", rate, s] - max(by[p, rate, s] for p in statics) for s in seeds]
        if np.mean(d) + np.std(d) < 0:
            short.append(f"{rate:g} req/s ({np.mean(d):+.4f} +- {np.std(d):.4f})")
    lines.append(
        "DQN >= best static at every rate (paired over seeds, within one std): "
        + ("met" if not short else "missed at " + ", ".join(short))
    )
    low = rates[0]
    ratio = reward["dqn", low] / max(1e-9, reward[big, low])
    lines.append(f"DQN / {big} at {low} req/s: {ratio:.3f} (target >= 0.95)")
    fall = next((r for r in rates if reward[big, r] < 0.5), None)
    top = 0.0  # the highest rate up to which the DQN holds 0.5 at every rate of the sweep
    for r in rates:
        if reward["dqn", r] < 0.5:
            break
        top = r
    if fall is None:
        lines.append(f"{big} never falls below 0.5 in this sweep")
    else:
        lines.append(
            f"{big} falls below 0.5 at {fall} req/s; DQN holds >= 0.5 up to {top} req/s "
            f"= {top / fall:.1f}x (target >= 10x)"
        )
    return lines


def plot(rows: list[dict[str, object]], models: list[str], tasks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reward = mean_by(rows, "mean_reward")
    spread = mean_by(rows, "mean_reward", np.std)
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    rates = sorted({float(r["rate"]) for r in rows})  # type: ignore[arg-type]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), gridspec_kw={"height_ratios": [2, 1]})
    ax = axes[0][0]
    for p in policies:
        y = np.array([reward[p, r] for r in rates])
        s = np.array([spread[p, r] for r in rates])
        style = {"lw": 2.5, "color": "black"} if p == "dqn" else {"lw": 1, "alpha": 0.8}
        ax.plot(rates, y, marker=".", label=p, **style)
        ax.fill_between(rates, y - s, y + s, alpha=0.15, color=style.get("color"))
    ax.set(xscale="log", xlabel="arrival rate (req/s)", ylabel="mean reward per request")
    ax.set_title("Figure 4: stable workload")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1][0]
    if "dqn" in policies:
        bottom = np.zeros(len(rates))
        for m in models:
            share = mean_by([r for r in rows if r["policy"] == "dqn"], f"share:{m}")
            y = np.array([share["dqn", r] for r in rates])
            ax.bar(range(len(rates)), y, bottom=bottom, label=m)
            bottom += y
        ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
        ax.set(xlabel="arrival rate (req/s)", ylabel="DQN share")
        ax.legend(fontsize=7)
    ax = axes[0][1]
    if "dqn" in policies:
        dqn = [r for r in rows if r["policy"] == "dqn"]
        width = 0.8 / len(tasks)
        for t, task in enumerate(tasks):
            share = mean_by(dqn, f"share:{task}:{models[-1]}")
            ax.bar(
                np.arange(len(rates)) + t * width,
                [share["dqn", r] for r in rates],
                width,
                label=task,
            )
        ax.set_xticks(np.arange(len(rates)) + 0.4 - width / 2, [f"{r:g}" for r in rates])
        ax.set(xlabel="arrival rate (req/s)", ylabel=f"share sent to {models[-1]}")
        ax.set_title("Figure 5: DQN's choice by task")
        ax.legend(fontsize=7)
    ax = axes[1][1]
    slo = mean_by(rows, "slo")
    for p in policies:
        style = {"lw": 2.5, "color": "black"} if p == "dqn" else {"lw": 1, "alpha": 0.8}
        ax.plot(rates, [slo[p, r] for r in rates], marker=".", label=p, **style)
    ax.set(xscale="log", xlabel="arrival rate (req/s)", ylabel="SLO attainment")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.stable", description=__doc__)
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="paper-4gpu")
    parser.add_argument("--policy-file", type=Path, help="default: router/policies/<dep>.npz")
    parser.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",")],
                        default=list(RATES))  # fmt: skip
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per rate")
    parser.add_argument("--seeds", type=int, default=3)
    add_admission_argument(parser)
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    try:
        deployment = load_deployment(args.config, args.deployment)
    except ConfigError as exc:
        parser.error(str(exc))
    rows = run(args)
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"stable-{deployment.name}"
    write_csv(Path(f"{stem}.csv"), rows)
    plot(rows, deployment.models, deployment.tasks, Path(f"{stem}.png"))
    reward = mean_by(rows, "mean_reward")
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    print(f"mean reward per request, mean of {args.seeds} seeds, {args.duration:g} s per rate")
    print(f"{'rate':>6} " + " ".join(f"{p[:11]:>11}" for p in policies))
    for rate in args.rates:
        print(f"{rate:>6g} " + " ".join(f"{reward[p, rate]:>11.3f}" for p in policies))
    for line in targets(rows, deployment.models, args.rates):
        print(line)
    print(f"wrote {stem}.csv and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
