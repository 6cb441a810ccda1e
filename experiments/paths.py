"""`python -m experiments.paths`: the network-aware router against the network-blind one, with
clients on the paths of a mix. The targets: +0.05 of mean reward on the mixed paths (GAIN_TARGET),
and at most 0.005 lost with every client on the LAN (LAN_TOLERANCE).

Every request's client is on a path drawn from models.yaml's path mix (`mixed`: LAN, LTE, 3G and
a bad link, 40/30/20/10%), and its answer is delivered over it: the SLO is met or missed at the
client (`router.paths`). The same requests, the same paths and the same cluster for every policy:
- the network-blind DQN (`router/trained/paper-4gpu.npz`), which sees only the servers;
- the network-aware DQN (the deployment's `policy.net_path`), which also sees each request's
  path and remaining budget;
- a path rule, the network-blind DQN that sends a request whose path takes over a fifth of its
  SLO's time to the second-best model: what one line of knowledge of the network buys;
- the one-model baselines, for scale.

Workloads, as in §5.1.3 of Chuppala (2024): stable (Poisson at each rate, 40 s, a fresh cluster
each) and unpredictable (the rate switching among 0.25-48 req/s, 10 s a level on average, 300 s);
classes uniform over the deployment's, as in training. Each runs with the `mixed` mix and with
every client on the LAN (`lan`), where knowing the network should change nothing.

    python -m experiments.paths                 # 8 rates x 40 s + 300 s unpredictable, 3 seeds
    python -m experiments.paths --quick         # 4 rates, 120 s unpredictable, 1 seed

Writes results/paths/runs.csv (one row per run and policy), summary.csv, and fig5-paths.png:
each model's share per path and load for both DQNs, as the thesis's Figure 5 shows it per task.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from config import DEFAULT_PATH, ConfigError, Deployment, load, load_deployment
from experiments.harness.output import as_float, as_int, write_csv
from experiments.transport_micro import mean_ci
from router.evaluate import mean_reward, simulate
from router.features import FeatureEncoder
from router.paths import estimate_of
from router.policies import DqnPolicy, Policy, Static
from router.sim import Finished
from router.view import ClusterView
from workloads import Request
from workloads.arrivals import ArrivalProcess, Poisson, SwitchingRate
from workloads.generate import WorkloadSpec

OUT = Path("results/paths")
RATES = (0.25, 1, 2, 4, 8, 16, 32, 48)
QUICK_RATES = (1, 4, 16, 48)
MIXES = ("mixed", "lan")
GAIN_TARGET = 0.05
"""The network-aware DQN's margin over the network-blind one on the mixed paths..."""
LAN_TOLERANCE = 0.005
"""...and how far below it it may fall with every client on the LAN."""
FIGURE_RATES = (1, 4, 16, 48)


class PathRule:
    """A reference, not a router to ship: the network-blind DQN, except that a request whose
    path takes more than `share` of its SLO's time (`router.paths.budget`) goes to the
    second-best model's least-loaded replica. What one line of knowledge of the network buys,
    for scale beside what the network-aware DQN learned."""

    def __init__(self, blind: DqnPolicy, deployment: Deployment, share: float = 0.2) -> None:
        self.blind, self.share = blind, share
        mixed = FeatureEncoder.for_deployment(deployment)
        assert mixed.deadlines is not None, "the deployment names a path mix"
        self.budget, self.tpot_s = mixed.budget, deployment.slo.tpot_s
        quality = deployment.quality
        ranked = sorted(deployment.models, key=lambda m: -statistics.fmean(
            row[m] for row in quality.values()))  # fmt: skip
        self.fallback = ranked[1]
        blind.bind(deployment)  # a per-action layout is built on the deployment (a flat one is)
        self.encoder = blind.encoder

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        left = self.budget(request)
        assert left is not None
        whole = self.tpot_s * max(1, request.max_tokens or 1)
        if 1 - left.answer_s / whole > self.share:
            index = view.least_loaded(self.fallback)
            if index is not None:
                return index
        return self.blind.choose(obs, request, view)


def policies(deployment: Deployment, aware_file: Path | None) -> dict[str, Callable[[], Policy]]:
    """The two DQNs, the path rule and the one-model baselines. `deployment` names a path
    mix."""
    blind_file = deployment.policy.path
    aware = aware_file or (Path(deployment.policy_file) if deployment.policy_file else None)
    if blind_file is None or aware is None or str(aware) == blind_file:
        raise SystemExit(
            f"deployment {deployment.name!r} needs a network-blind policy (policy.path) and a "
            "network-aware one (policy.net_path, or --policy-file)"
        )
    made: dict[str, Callable[[], Policy]] = {}
    for name, path in (("dqn-blind", Path(blind_file)), ("dqn-net", aware)):
        trained = DqnPolicy.load(path)
        trained.check_fits(deployment)
        made[name] = _constant(trained)
    rule = PathRule(DqnPolicy.load(blind_file), deployment)
    made["path-rule"] = lambda: rule
    for model in deployment.models:
        made[f"{model}-only"] = partial(Static, model)
    return made


def _constant(policy: Policy) -> Callable[[], Policy]:
    return lambda: policy


def path_names(deployment: Deployment) -> dict[object, str]:
    """The path a request came over, by the estimate it carries."""
    assert deployment.paths is not None
    return {estimate_of(spec): name for name, spec in deployment.paths.paths.items()}


def row(
    deployment: Deployment, mix: str, kind: str, phase: str, seed: int, policy: str,
    done: Sequence[Finished],
) -> dict[str, object]:  # fmt: skip
    names = path_names(deployment)
    out: dict[str, object] = {
        "mix": mix, "workload": kind, "phase": phase, "seed": seed, "policy": policy,
        "requests": len(done), "reward": round(mean_reward(deployment, done), 5),
        "slo": round(float(np.mean([f.slo_met for f in done])) if done else 0.0, 5),
    }  # fmt: skip
    for path in deployment.paths.paths if deployment.paths else ():
        mine = [f for f in done if names.get(f.request.path) == path]
        out[f"reward:{path}"] = round(mean_reward(deployment, mine), 5) if mine else None
        models = Counter(f.model for f in mine)
        for model in deployment.models:
            out[f"share:{path}:{model}"] = round(models[model] / max(1, len(mine)), 4)
    return out


def phases(args: argparse.Namespace) -> list[tuple[str, str, ArrivalProcess, float]]:
    """(workload, phase, arrivals, seconds) of every run."""
    stable = [("stable", f"{r:g}", Poisson(float(r)), args.rate_seconds) for r in args.rates]
    return [*stable, ("unpredictable", "all", SwitchingRate(), args.seconds)]


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    runs = [(mix, p, seed) for mix in MIXES for p in phases(args) for seed in range(args.seeds)]
    for mix, (kind, phase, arrivals, seconds), seed in tqdm(runs, unit="run", desc="simulated"):
        deployment = load_deployment(args.config, args.deployment, mix)
        spec = WorkloadSpec(arrivals=arrivals, classes=dict.fromkeys(deployment.qos_classes, 1))
        for name, make in policies(deployment, args.policy_file).items():
            done = simulate(deployment, make(), spec, seed, duration=seconds)
            rows.append(row(deployment, mix, kind, phase, seed, name, done))
    return rows


def summarize(rows: Sequence[dict[str, object]]) -> tuple[list[dict[str, object]], list[str]]:
    """Per mix and workload: each policy's mean reward (a workload's score is the mean over its
    phases, as the thesis scores the stable one), and the network-aware DQN's gain, paired by
    seed, with its 95% CI; then the targets' verdicts."""
    scores: dict[tuple[str, str, str], dict[int, list[float]]] = {}
    for r in rows:
        key = (str(r["mix"]), str(r["workload"]), str(r["policy"]))
        scores.setdefault(key, {}).setdefault(as_int(r["seed"]), []).append(as_float(r["reward"]))
    summary, verdicts = [], []
    for mix in MIXES:
        for kind in ("stable", "unpredictable"):
            per_seed = {
                policy: {s: statistics.fmean(v) for s, v in seeds.items()}
                for (m, k, policy), seeds in scores.items()
                if (m, k) == (mix, kind)
            }
            if "dqn-net" not in per_seed:
                continue
            seeds = sorted(per_seed["dqn-net"])
            gains = [per_seed["dqn-net"][s] - per_seed["dqn-blind"][s] for s in seeds]
            gain, ci = mean_ci(gains)
            entry: dict[str, object] = {"mix": mix, "workload": kind}
            for policy, by_seed in per_seed.items():
                entry[policy] = round(statistics.fmean(by_seed.values()), 4)
            entry |= {"gain": round(gain, 4), "gain_ci95": round(ci, 4)}
            summary.append(entry)
            if mix == "lan":
                ok = gain >= -LAN_TOLERANCE
                verdicts.append(f"{'PASS' if ok else 'MISS'} LAN only, {kind}: network-aware "
                                f"{gain:+.4f} against network-blind (target: no less than "
                                f"-{LAN_TOLERANCE})")  # fmt: skip
            else:
                ok = gain >= GAIN_TARGET
                verdicts.append(f"{'PASS' if ok else 'MISS'} mixed paths, {kind}: network-aware "
                                f"{gain:+.4f} ± {ci:.4f} against network-blind (target: "
                                f"+{GAIN_TARGET})")  # fmt: skip
    return summary, verdicts


def print_summary(summary: Sequence[dict[str, object]], verdicts: Sequence[str]) -> None:
    policies_seen = [k for k in summary[0] if k not in ("mix", "workload", "gain", "gain_ci95")]
    print(f"\n{'mix':6} {'workload':13} " + " ".join(f"{p:>10}" for p in policies_seen)
          + f" {'gain':>8} {'±95%':>7}")  # fmt: skip
    for s in summary:
        cells = " ".join(f"{as_float(s[p]):>10.4f}" for p in policies_seen)
        print(f"{s['mix']:6} {s['workload']:13} {cells} {as_float(s['gain']):>+8.4f} "
              f"{as_float(s['gain_ci95']):>7.4f}")  # fmt: skip
    print()
    for line in verdicts:
        print(line)


def per_path(rows: Sequence[dict[str, object]], paths: Sequence[str]) -> None:
    """Mean reward per path on the mixed mix, both DQNs: where the gain comes from."""
    print("\nmixed paths, mean reward per path (stable and unpredictable runs together):")
    print(f"{'policy':10} " + " ".join(f"{p:>7}" for p in paths))
    for policy in ("dqn-blind", "dqn-net"):
        mine = [r for r in rows if r["mix"] == "mixed" and r["policy"] == policy]
        values = [
            statistics.fmean(
                as_float(r[f"reward:{p}"]) for r in mine if r[f"reward:{p}"] is not None
            )
            for p in paths
        ]
        print(f"{policy:10} " + " ".join(f"{v:>7.3f}" for v in values))


def plot(rows: Sequence[dict[str, object]], paths: Sequence[str], models: Sequence[str],
         out: Path) -> None:  # fmt: skip
    """Each model's share of a path's requests at each load, both DQNs: the thesis's Figure 5,
    per path instead of per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r for r in FIGURE_RATES if any(x["phase"] == f"{r:g}" for x in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    colours = plt.get_cmap("viridis")(np.linspace(0.15, 0.85, len(models)))
    for ax, policy in zip(axes, ("dqn-blind", "dqn-net"), strict=True):
        x, labels = 0.0, []
        for path in paths:
            for rate in rates:
                mine = [r for r in rows if r["mix"] == "mixed" and r["policy"] == policy
                        and r["workload"] == "stable" and r["phase"] == f"{rate:g}"]  # fmt: skip
                bottom = 0.0
                for model, colour in zip(models, colours, strict=True):
                    share = statistics.fmean(as_float(r[f"share:{path}:{model}"]) for r in mine)
                    label = model if (path, rate) == (paths[0], rates[0]) else None
                    ax.bar(x, share, bottom=bottom, color=colour, width=0.8, label=label)
                    bottom += share
                labels.append((x, f"{rate:g}"))
                x += 1
            ax.text(x - len(rates) / 2 - 0.5, 1.04, path, ha="center")
            x += 0.8
        ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=7)
        ax.set(title=f"{policy}, mixed paths", xlabel="path; load (req/s)", ylim=(0, 1.12))
    axes[0].set_ylabel("share of the path's requests")
    axes[0].legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.paths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="paper-4gpu")
    parser.add_argument("--policy-file", type=Path, help="the network-aware policy to compare")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=list(RATES))  # fmt: skip
    parser.add_argument("--rate-seconds", type=float, default=40.0)
    parser.add_argument("--seconds", type=float, default=300.0, help="the unpredictable run's")
    parser.add_argument("--quick", action="store_true", help="4 rates, 120 s, 1 seed")
    parser.add_argument("--results", type=Path, default=OUT)
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.quick:
        args.rates, args.seconds, args.seeds = list(QUICK_RATES), 120.0, 1
    if args.seeds < 1 or args.rate_seconds <= 0 or args.seconds <= 0 or not args.rates:
        parser.error("--seeds, --rate-seconds, --seconds and --rates must be positive")
    try:
        mixes = load(args.config).path_mixes
        missing = [m for m in MIXES if m not in mixes]
        if missing:
            raise ConfigError(f"{args.config}: no path mix {', '.join(missing)}")
        deployment = load_deployment(args.config, args.deployment, "mixed")
    except ConfigError as exc:
        parser.error(str(exc))
    rows = run(args)
    write_csv(args.results / "runs.csv", rows)
    summary, verdicts = summarize(rows)
    write_csv(args.results / "summary.csv", summary)
    print_summary(summary, verdicts)
    assert deployment.paths is not None
    paths = list(deployment.paths.paths)
    per_path(rows, paths)
    plot(rows, paths, deployment.models, args.results / "fig5-paths.png")
    print(f"\nwrote {args.results}/runs.csv, summary.csv and fig5-paths.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
