"""`python -m experiments.stale_view`: what routing loses when N front-end workers each know
their own requests exactly and the others' only from a snapshot `--staleness-ms` old.

In the simulator (`router.stale.StaleSimulator`), on `paper-4gpu` with its shipped DQN and its
admission rule: Poisson arrivals at each `--rates` for `--duration` s, each request (90%
free-tier, 10% real-time by default) taken by one of `--routers` routers drawn at random, every
router refreshing its snapshot of the others at each staleness (0: every view exact). For each
rate and staleness, over `--seeds` seeds: mean reward per request, SLO attainment per class,
and the load imbalance (at each arrival, the busiest replica's requests in flight over the
mean), each with its 95% confidence interval; and the reward lost against an exact view, whose
target is under 0.01 at 100 ms.

Writes results/stale_view/stale_view.{csv,png} and prints the table.

    python -m experiments.stale_view                     # 2 routers, 48 and 192 req/s, 3 seeds
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from scipy import stats
from tqdm import tqdm

from config import DEFAULT_PATH, Deployment, load_deployment
from experiments.harness.output import write_csv
from router.evaluate import mean_reward, simulate
from router.policies import DqnPolicy, Policy, make_policy
from router.sim import Simulator
from router.stale import StaleSimulator
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec

ROOT = Path(__file__).resolve().parent.parent


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t) over seeds."""
    if len(values) < 2:
        return values[0], math.nan
    t = float(stats.t.ppf(0.975, len(values) - 1))
    return statistics.fmean(values), t * statistics.stdev(values) / len(values) ** 0.5


def one_run(
    deployment: Deployment,
    policy: Policy,
    rate: float,
    stale_ms: float,
    seed: int,
    args: argparse.Namespace,
) -> dict[str, float]:
    """One simulated run: its mean reward, its SLO attainment per class, its imbalance."""
    made: list[StaleSimulator] = []

    def simulator() -> Simulator:
        stale = StaleSimulator.from_deployment(
            deployment, routers=args.routers, interval_s=stale_ms / 1000, seed=seed
        )
        assert isinstance(stale, StaleSimulator)
        made.append(stale)
        return stale

    spec = WorkloadSpec(arrivals=Poisson(rate), classes=args.classes)
    done = simulate(deployment, policy, spec, seed, duration=args.duration, simulator=simulator)
    result = {"reward": mean_reward(deployment, done),
              "imbalance": statistics.fmean(made[-1].imbalance or [1.0])}  # fmt: skip
    for qos_class in args.classes:
        of_class = [f for f in done if f.request.qos_class == qos_class]
        result[f"slo:{qos_class}"] = sum(f.slo_met for f in of_class) / max(1, len(of_class))
    return result


def plot(rows: list[dict[str, object]], rates: list[float], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = list(dict.fromkeys(str(r["policy"]) for r in rows))
    for label in labels:
        for rate in rates:
            mine = [r for r in rows if r["rate"] == rate and r["policy"] == label]
            xs = [max(float(r["staleness_ms"]), 1.0) for r in mine]  # type: ignore[arg-type]
            name = f"{rate:g} req/s" + (f", {label}" if len(labels) > 1 else "")
            axes[0].errorbar(xs, [r["reward"] for r in mine],
                             yerr=[r["reward_ci95"] for r in mine], marker="o", capsize=3,
                             label=name)  # fmt: skip
            axes[1].plot(xs, [r["imbalance"] for r in mine], marker="o", label=name)
    for axis, label in zip(
        axes, ("mean reward per request", "busiest replica / mean"), strict=True
    ):
        axis.set_xscale("log")
        axis.set_xlabel("staleness of the others' counts, ms (0 drawn at 1)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{args.deployment}: {args.routers} routers, each exact about its own requests")
    figure.tight_layout()
    figure.savefig(args.out / "stale_view.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.stale_view",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=str(DEFAULT_PATH))
    parser.add_argument("--deployment", default="paper-4gpu")
    parser.add_argument("--routers", type=int, default=2)
    parser.add_argument("--staleness-ms", default="0,10,50,100,250,1000")
    parser.add_argument(
        "--rates", default="48,192", help="req/s: the peak rate in Chuppala (2024), and 4x it"
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--classes",
        default="free-tier:0.9,real-time:0.1",
        type=lambda text: {k: float(v) for k, v in (p.split(":") for p in text.split(","))},
        help="the QoS class mix, class:weight,...",
    )
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per run")
    parser.add_argument(
        "--policies",
        help="DQN policy files to compare, comma-separated, each run on the same workloads "
        "(default: the deployment's own policy)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "stale_view")
    args = parser.parse_args(argv)
    deployment = load_deployment(args.config, args.deployment)
    staleness = [float(s) for s in args.staleness_ms.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    policies = _policies(deployment, args.policies)
    runs = [(p, r, s, seed) for p in policies for r in rates for s in staleness
            for seed in range(args.seeds)]  # fmt: skip
    raw: dict[tuple[str, float, float], list[dict[str, float]]] = {}
    for label, rate, stale_ms, seed in tqdm(runs, unit="run", desc="simulated"):
        result = one_run(deployment, policies[label], rate, stale_ms, seed, args)
        raw.setdefault((label, rate, stale_ms), []).append(result)
    first = next(iter(policies))
    rows = []
    for (label, rate, stale_ms), results in raw.items():
        row: dict[str, object] = {"policy": label, "rate": rate, "staleness_ms": stale_ms,
                                  "routers": args.routers}  # fmt: skip
        for key in results[0]:
            mean, half = mean_ci([r[key] for r in results])
            row[key], row[f"{key}_ci95"] = round(mean, 4), round(half, 4)
        exact = statistics.fmean(r["reward"] for r in raw[(label, rate, staleness[0])])
        row["reward_lost"] = round(exact - float(row["reward"]), 4)  # type: ignore[arg-type]
        # Against the first policy on the same workloads (same seeds): paired differences.
        gains = [a["reward"] - b["reward"]
                 for a, b in zip(results, raw[(first, rate, stale_ms)], strict=True)]  # fmt: skip
        row["gain"], row["gain_ci95"] = (round(x, 4) for x in mean_ci(gains))
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "stale_view.csv", rows)
    classes = list(args.classes)
    print(f"\n{args.deployment}, {args.routers} routers, {args.seeds} seeds x {args.duration:g} s; "
          f"reward lost against staleness {staleness[0]:g} ms\n")  # fmt: skip
    print(f"| policy | rate | staleness | mean reward (95% CI) | lost | vs {first} | " + " | ".join(
        f"SLO {c}" for c in classes) + " | imbalance |")  # fmt: skip
    print("|---" * (7 + len(classes)) + "|")
    for row in rows:
        slo = " | ".join(f"{row[f'slo:{c}']:.3f}" for c in classes)
        print(f"| {row['policy']} | {row['rate']:g} req/s | {row['staleness_ms']:g} ms "
              f"| {row['reward']:.4f} ± {row['reward_ci95']:.4f} | {row['reward_lost']:+.4f} "
              f"| {row['gain']:+.4f} ± {row['gain_ci95']:.4f} | {slo} "
              f"| {row['imbalance']:.2f} |")  # fmt: skip
    plot(rows, rates, args)
    print(f"\nwrote {args.out / 'stale_view.csv'} and {args.out / 'stale_view.png'}")
    return 0


def _policies(deployment: Deployment, given: str | None) -> dict[str, Policy]:
    """The policies to compare, by label (a file's stem); the deployment's own by default."""
    if not given:
        return {"shipped": make_policy(deployment)}
    policies: dict[str, Policy] = {}
    for path in given.split(","):
        policy = DqnPolicy.load(path)
        policy.check_fits(deployment)
        policies[Path(path).stem] = policy
    return policies


if __name__ == "__main__":
    sys.exit(main())
