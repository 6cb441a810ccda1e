"""`python -m experiments.lengths`: the learned router across request lengths, against the
heuristics and against hindsight.

Every length distribution of `workloads.lengths`, those trained on and those held out, at each
rate (Poisson, every class of the deployment alike), with admission control off and on, over
several seeds; on the same requests:
- the DQN (the deployment's policy, or --policy-file) and the DQNs to compare with (--compare);
- the threshold policy, grid-searched afresh in this run on the training distributions under
  each admission rule (`router.evaluate.tune_threshold`: 12 episodes, its grid), and every
  one-model policy: the heuristics;
- the references in hindsight, which know every arrival and every answer's length: the
  threshold policy tuned on the cell's own requests (all its seeds), the clairvoyant schedule
  (`router.hindsight.clairvoyant`: rollouts from the best of the heuristics' and the hindsight
  threshold's schedules) and the bound no schedule can pass (`router.bound`).

Prints per cell (distribution, admission rule, rate) the mean reward per request of each over
seeds, and the targets: the DQN at or above the best one-model policy, at most 0.005 below the
threshold policy, at least 95% of the clairvoyant's reward at 1-16 req/s (90% at 48), and at
least half the headroom, (DQN - best heuristic) / (clairvoyant - best heuristic), wherever the
clairvoyant beats the best heuristic by 0.02 or more; and where the clairvoyant falls below a
policy (it must not), and how far the bound sits above it. In the simulator: virtual time, the
machine does not move the numbers. Writes results/lengths/<deployment>.csv (a row per run), the
table as markdown (.md) and a plot (.png). The references, which take most of the time (about
an hour on two cores for the full grid), are kept in results/lengths/references/ and reused
while their inputs are the same.

With --live, instead: the DQN against --compare's on the live server (`paper-4gpu-sim`, the
twin: simulated engines in real time behind the real transport, gateway and router), on the
same requests of a held-out distribution (`--live-lengths`, default conversations) at 4 and 16
req/s, sent over HTTP/3 by the load generator with each answer's length as min_tokens (where the
twin ends it). Each policy gets a fresh server (`serving --policy-file`). Writes
results/lengths/live.csv.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
from scipy import stats
from tqdm import tqdm

from config import DEFAULT_PATH, ConfigError, Deployment, load_deployment
from experiments.harness.output import as_float, as_int, write_csv
from router.bound import upper_bound
from router.evaluate import (
    GRID_RATES,
    THRESHOLD_GRID,
    grid_workload,
    mean_reward,
    simulate,
    tune_threshold,
)
from router.hindsight import Horizon, clairvoyant
from router.policies import TRAINED, DqnPolicy, Policy, QualityThreshold, Static
from router.sim import SHED, Finished
from workloads.generate import requests
from workloads.lengths import ALL, HELD_OUT, TRAINING

RATES = GRID_RATES
ADMISSION_RULES: tuple[Literal["none", "deadline"], ...] = ("none", "deadline")
COMPARE = (TRAINED / "paper-4gpu-lengths.npz",)
"""The DQNs to compare with by default (each column named after its file)."""
MARGIN = 0.005
"""How far below the tuned threshold policy the DQN may fall."""
SHARE = {1.0: 0.95, 4.0: 0.95, 16.0: 0.95, 48.0: 0.90}
"""The share of the clairvoyant's reward the DQN must keep, by rate."""
HEADROOM = 0.02
"""Where the clairvoyant beats the best heuristic by this much, the DQN must take..."""
HEADROOM_TAKEN = 0.5
"""...this share of it."""
TUNING_EPISODES = 12
HINDSIGHT_GRID = (0, *THRESHOLD_GRID)
"""The thresholds the hindsight search tries: 0 leaves a model out, which the grid tuned on the
training distributions never does (without it, the family could not send everything to OPT-1.3B,
and fell 0.43 below that one-model policy on azure-code at 1 req/s)."""
REFERENCES_VERSION = 2
"""Part of the references' cache key: raised when the simulator or the references change."""
HELD_OUT_NAMES = frozenset(d.name for d in HELD_OUT)


@dataclass(frozen=True)
class Cell:
    lengths: str
    rate: float
    rule: Literal["none", "deadline"]

    def deployment(self, config: Path, name: str) -> Deployment:
        return load_deployment(config, name).with_admission(self.rule)

    def spec(self, deployment: Deployment):  # type: ignore[no-untyped-def]
        return grid_workload(deployment, ALL[self.lengths], self.rate)


def thresholds(config: Path, name: str, jobs: int) -> dict[str, dict[str, int]]:
    """Admission rule -> QualityThreshold's thresholds, grid-searched afresh on the training
    lengths under that rule (`router.evaluate.tune_threshold`)."""
    with ProcessPoolExecutor(min(jobs, len(ADMISSION_RULES))) as pool:
        tuned = pool.map(partial(_tune, config, name), ADMISSION_RULES)
        return dict(zip(ADMISSION_RULES, tuned, strict=True))


def _tune(config: Path, name: str, rule: str) -> dict[str, int]:
    deployment = load_deployment(config, name).with_admission(rule)  # type: ignore[arg-type]
    return tune_threshold(deployment, episodes=TUNING_EPISODES, lengths=TRAINING).thresholds


def _label(path: Path) -> str:
    """The column of a DQN compared with: its file's name."""
    return path.stem


def heuristics(deployment: Deployment, tuned: dict[str, int]) -> dict[str, Callable[[], Policy]]:
    """The threshold policy and every one-model policy: none keeps state between runs."""
    out: dict[str, Callable[[], Policy]] = {
        "threshold": lambda: QualityThreshold(deployment.quality, 32, tuned)
    }
    for model in deployment.models:
        out[f"{model}-only"] = partial(Static, model)
    return out


def run_policies(
    config: Path,
    name: str,
    dqns: dict[str, Path],
    tuned: dict[str, dict[str, int]],
    count: int,
    task: tuple[Cell, int],
) -> list[dict[str, object]]:
    """Every policy on one cell and seed, and the bound: a row each."""
    cell, seed = task
    deployment = cell.deployment(config, name)
    spec = cell.spec(deployment)
    makes: dict[str, Callable[[], Policy]] = {}
    for label, path in dqns.items():
        policy = DqnPolicy.load(path)
        policy.check_fits(deployment)
        makes[label] = lambda policy=policy: policy  # type: ignore[misc]
    makes |= heuristics(deployment, tuned[cell.rule])
    rows = [
        _row(
            cell, seed, label, deployment, simulate(deployment, make(), spec, seed, requests=count)
        )
        for label, make in makes.items()
    ]
    bound = upper_bound(deployment, list(requests(spec, seed, None, count)))
    rows.append(
        _base(cell, seed)
        | {"policy": "bound", "requests": count, "mean_reward": bound.reward, "alone": bound.alone}
    )
    return rows


def _base(cell: Cell, seed: int) -> dict[str, object]:
    return {"lengths": cell.lengths, "held_out": cell.lengths in HELD_OUT_NAMES,
            "admission": cell.rule, "rate": cell.rate, "seed": seed}  # fmt: skip


def _row(
    cell: Cell, seed: int, policy: str, deployment: Deployment, done: list[Finished]
) -> dict[str, object]:
    return _base(cell, seed) | {
        "policy": policy,
        "requests": len(done),
        "mean_reward": mean_reward(deployment, done),
        "slo": float(np.mean([f.slo_met for f in done])),
        "shed": float(np.mean([f.outcome == SHED for f in done])),
    }


def hindsight_threshold(
    config: Path,
    name: str,
    count: int,
    seeds: int,
    tuned: dict[str, dict[str, int]],
    cell: Cell,
    cache: Path,
) -> tuple[dict[str, int], list[float]]:
    """The thresholds that earn the most on the cell's own requests (every seed of it), and what
    they earn on each: a reference, tuned in hindsight. Searched one model's threshold at a
    time over `HINDSIGHT_GRID` until a round changes none (a full grid search took 2 minutes a
    cell), from several starts: the thresholds tuned on the training distributions, so that it
    never earns less than they do on the cell, and those that send (nearly) everything to one
    model, so that it holds the one-model policies too."""
    key = _key("hindsight-threshold", cell, count, seeds, tuned[cell.rule], HINDSIGHT_GRID)
    if (found := _cached(cache, key)) is not None:
        return found["thresholds"], found["rewards"]
    deployment = cell.deployment(config, name)
    spec = cell.spec(deployment)
    quality = deployment.quality
    ranked = sorted(deployment.models, key=lambda m: -np.mean([r[m] for r in quality.values()]))
    seen: dict[tuple[int, ...], list[float]] = {}

    def earned(values: tuple[int, ...]) -> float:
        if values not in seen:
            policy = QualityThreshold(
                quality, max(THRESHOLD_GRID), dict(zip(ranked[:-1], values, strict=True))
            )
            seen[values] = [mean_reward(deployment, simulate(deployment, policy, spec, s,
                                                             requests=count))
                            for s in range(seeds)]  # fmt: skip
        return float(np.mean(seen[values]))

    def search(best: tuple[int, ...]) -> tuple[int, ...]:
        changed = True
        while changed:
            changed = False
            for k in range(len(best)):
                for value in HINDSIGHT_GRID:
                    tried = best[:k] + (value,) + best[k + 1 :]
                    if earned(tried) > earned(best):
                        best, changed = tried, True
        return best

    most = max(THRESHOLD_GRID)
    starts = [tuple(tuned[cell.rule][m] for m in ranked[:-1])]
    starts += [(0,) * k + (most,) * (len(ranked) - 1 - k) for k in range(len(ranked))]
    best = max((search(start) for start in starts), key=earned)
    thresholds = dict(zip(ranked[:-1], best, strict=True))
    _store(cache, key, {"thresholds": thresholds, "rewards": seen[best]})
    return thresholds, seen[best]


def run_clairvoyant(
    config: Path,
    name: str,
    tuned: dict[str, dict[str, int]],
    hindsight: dict[Cell, dict[str, int]],
    count: int,
    passes: int,
    cache: Path,
    task: tuple[Cell, int],
) -> dict[str, object]:
    """The clairvoyant schedule of one cell and seed: its bases are the heuristics and the
    cell's hindsight threshold."""
    cell, seed = task
    deployment = cell.deployment(config, name)
    bases = list(heuristics(deployment, tuned[cell.rule]).values())
    own = hindsight[cell]
    bases.append(lambda: QualityThreshold(deployment.quality, max(THRESHOLD_GRID), own))
    key = _key("clairvoyant", cell, count, seed, tuned[cell.rule], own, passes, Horizon())
    if (found := _cached(cache, key)) is None:
        done = clairvoyant(deployment, cell.spec(deployment), seed, bases, passes=passes,
                           requests=count)  # fmt: skip
        found = _row(cell, seed, "clairvoyant", deployment, done)
        _store(cache, key, found)
    return found


def _key(*parts: object) -> str:
    text = json.dumps([REFERENCES_VERSION, *map(repr, parts)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _cached(cache: Path, key: str) -> dict[str, Any] | None:
    path = cache / f"{key}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _store(cache: Path, key: str, value: object) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"{key}.json").write_text(json.dumps(value))


Key = tuple[str, str, float]


def by_cell(rows: Sequence[dict[str, object]]) -> dict[Key, dict[str, dict[int, float]]]:
    """(distribution, admission rule, rate) -> policy -> seed -> mean reward."""
    out: dict[Key, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        key = (str(r["lengths"]), str(r["admission"]), as_float(r["rate"]))
        out[key][str(r["policy"])][as_int(r["seed"])] = as_float(r["mean_reward"])
    return out


def _interval(values: Sequence[float]) -> float:
    """Half the 95% confidence interval of the mean of paired differences over seeds."""
    if len(values) < 2:
        return float("nan")
    return float(
        stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / np.sqrt(len(values))
    )


@dataclass
class Verdict:
    """One cell's numbers and targets."""

    rewards: dict[str, float]
    best_static: str
    best_heuristic: float
    over_static: float
    over_static_ci: float
    over_threshold: float
    over_threshold_ci: float
    share: float | None = None
    headroom: float | None = None
    taken: float | None = None
    misses: list[str] | None = None
    clairvoyant_below: list[str] | None = None


def verdict(key: Key, runs: dict[str, dict[int, float]], models: Sequence[str]) -> Verdict:
    seeds = sorted(runs["dqn"])
    mean = {p: float(np.mean([v[s] for s in seeds if s in v])) for p, v in runs.items()}
    statics = [f"{m}-only" for m in models]
    best = max(statics, key=mean.__getitem__)
    paired_static = [runs["dqn"][s] - max(runs[p][s] for p in statics) for s in seeds]
    paired_threshold = [runs["dqn"][s] - runs["threshold"][s] for s in seeds]
    heuristic = max(mean["threshold"], mean[best])
    v = Verdict(
        mean, best, heuristic, mean["dqn"] - mean[best], _interval(paired_static),
        mean["dqn"] - mean["threshold"], _interval(paired_threshold), misses=[],
    )  # fmt: skip
    assert v.misses is not None
    if v.over_static < 0:
        v.misses.append("below the best one-model policy")
    if v.over_threshold < -MARGIN:
        v.misses.append(f"more than {MARGIN} below threshold")
    if "clairvoyant" in mean:
        clair = mean["clairvoyant"]
        v.share = mean["dqn"] / clair if clair > 0 else 1.0
        if v.share < SHARE.get(key[2], 0.95):
            v.misses.append(f"under {SHARE.get(key[2], 0.95):.0%} of the clairvoyant")
        v.headroom = clair - heuristic
        if v.headroom >= HEADROOM:
            v.taken = (mean["dqn"] - heuristic) / v.headroom
            if v.taken < HEADROOM_TAKEN:
                v.misses.append(f"under {HEADROOM_TAKEN:.0%} of the headroom")
        v.clairvoyant_below = [
            p for p in runs if p not in ("clairvoyant", "bound") and mean[p] > clair + 1e-9
        ]
    return v


def table(
    rows: Sequence[dict[str, object]], models: Sequence[str], others: Sequence[str]
) -> list[str]:
    """The markdown table and what it says of the targets."""
    cells = by_cell(rows)
    seeds = len({r["seed"] for r in rows})
    refs = any(r["policy"] == "clairvoyant" for r in rows)
    head = ["lengths", "admission", "rate", "dqn", *others, "threshold", "best one-model",
            "dqn - best one-model", "dqn - threshold"]  # fmt: skip
    if refs:
        head += ["hindsight threshold", "clairvoyant", "bound", "dqn / clairvoyant",
                 "headroom taken"]  # fmt: skip
    lines = [
        f"Mean reward per request over {seeds} seeds (the same requests for every policy); "
        "margins with the half-width of their 95% interval over seeds, paired; ! marks a "
        "missed target.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    misses: dict[str, int] = defaultdict(int)
    below: list[str] = []
    gaps = []
    for key, runs in cells.items():
        v = verdict(key, runs, models)
        lengths, rule, rate = key
        m = v.rewards
        flag = lambda bad: "!" if bad else ""  # noqa: E731
        held = " (held out)" if lengths in HELD_OUT_NAMES else ""
        cols = [f"{lengths}{held}", rule, f"{rate:g}", f"{m['dqn']:.3f}",
                *(f"{m.get(o, float('nan')):.3f}" for o in others), f"{m['threshold']:.3f}",
                f"{m[v.best_static]:.3f} ({v.best_static.removesuffix('-only')})",
                f"{v.over_static:+.3f} ±{v.over_static_ci:.3f}{flag(v.over_static < 0)}",
                f"{v.over_threshold:+.3f} ±{v.over_threshold_ci:.3f}"
                f"{flag(v.over_threshold < -MARGIN)}"]  # fmt: skip
        if refs:
            assert v.share is not None and v.headroom is not None
            taken = "-" if v.taken is None else f"{v.taken:.0%}{flag(v.taken < HEADROOM_TAKEN)}"
            cols += [f"{m.get('hindsight-threshold', float('nan')):.3f}",
                     f"{m['clairvoyant']:.3f}", f"{m['bound']:.3f}",
                     f"{v.share:.1%}{flag(v.share < SHARE.get(rate, 0.95))}", taken]  # fmt: skip
            gaps.append(m["bound"] - m["clairvoyant"])
            if v.clairvoyant_below:
                gone = ", ".join(f"{p} {m[p] - m['clairvoyant']:+.3f}" for p in v.clairvoyant_below)
                below.append(f"{lengths}/{rule}/{rate:g}: {gone}")
        lines.append("| " + " | ".join(cols) + " |")
        for miss in v.misses or []:
            misses[miss] += 1
    n = len(cells)
    said = "; ".join(f"{k}: {c}" for k, c in misses.items())
    lines += ["", f"{sum(misses.values())} misses in {n} cells" + (f": {said}" if said else ".")]
    if refs:
        lines.append(
            "The clairvoyant is at or above every policy in every cell." if not below
            else "The clairvoyant falls below a policy in: " + "; ".join(below)
        )  # fmt: skip
        lines.append(f"The bound sits {np.mean(gaps):.3f} above the clairvoyant on average "
                     f"(at most {np.max(gaps):.3f}).")  # fmt: skip
    return lines


def plot(rows: Sequence[dict[str, object]], path: Path) -> None:
    """Per distribution, the DQN's margin over threshold, and, with the references, its share of
    the clairvoyant's reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = by_cell(rows)
    names = list(dict.fromkeys(k[0] for k in cells))
    refs = any(r["policy"] == "clairvoyant" for r in rows)
    fig, axes = plt.subplots(2 if refs else 1, 2, figsize=(13, 9 if refs else 4.5), squeeze=False)
    for col, rule in enumerate(ADMISSION_RULES):
        for name in names:
            rates = sorted(r for n, a, r in cells if n == name and a == rule)
            mean = [{p: float(np.mean(list(v.values()))) for p, v in cells[name, rule, r].items()}
                    for r in rates]  # fmt: skip
            held = name in HELD_OUT_NAMES
            style = {"marker": "o" if held else ".", "ls": "--" if held else "-"}
            label = name + (" (held out)" if held else "")
            axes[0][col].plot(
                rates, [m["dqn"] - m["threshold"] for m in mean], label=label, **style
            )
            if refs:
                axes[1][col].plot(
                    rates, [m["dqn"] / m["clairvoyant"] for m in mean], label=label, **style
                )
        ax = axes[0][col]
        ax.axhline(-MARGIN, color="grey", lw=0.8)
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel="arrival rate (req/s)", title=f"admission {rule}",
               ylabel="DQN - tuned threshold, mean reward")  # fmt: skip
        ax.legend(fontsize=7)
        if refs:
            ax = axes[1][col]
            ax.axhline(0.95, color="grey", lw=0.8)
            ax.axhline(0.90, color="grey", lw=0.8, ls=":")
            ax.set(xscale="log", xlabel="arrival rate (req/s)", ylabel="DQN / clairvoyant")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


LIVE_RATES = (4.0, 16.0)
LIVE_KEY = "lengths-live-key"


def run_live(
    args: argparse.Namespace, deployment: Deployment, dqns: dict[str, Path]
) -> list[dict[str, object]]:
    """Each DQN of `dqns` on the same requests, on a fresh live server each (see the module)."""
    from experiments.harness import live
    from workloads.request import save_requests
    from workloads.summary import Outcome

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
    parser.add_argument("--compare", type=lambda s: [Path(p) for p in s.split(",") if p],
                        default=list(COMPARE),
                        help="other DQNs to compare with, comma-separated (default: "
                        f"{','.join(p.name for p in COMPARE)}); '': none")  # fmt: skip
    parser.add_argument("--lengths", type=lambda s: s.split(","), default=list(ALL),
                        help=f"distributions (default: all: {','.join(ALL)})")  # fmt: skip
    parser.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",")],
                        default=list(RATES), help="req/s (default: 1,4,16,48)")  # fmt: skip
    parser.add_argument("--rules", type=lambda s: s.split(","), default=list(ADMISSION_RULES),
                        help="admission rules (default: none,deadline)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500, help="per run")
    parser.add_argument("--jobs", type=int, default=2, help="processes")
    parser.add_argument(
        "--no-references",
        action="store_true",
        help="no hindsight threshold, no clairvoyant (the bound stays)",
    )
    parser.add_argument("--passes", type=int, default=2, help="the clairvoyant's passes")
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
    if unknown := [r for r in args.rules if r not in ADMISSION_RULES]:
        parser.error(f"unknown admission rule(s) {', '.join(unknown)} (none, deadline)")
    if missing := [str(p) for p in args.compare if not p.exists()]:
        parser.error(f"--compare: no such file {', '.join(missing)}")
    dqn = args.policy_file or Path(deployment.policy_file or TRAINED / f"{deployment.name}.npz")
    others = {_label(p): p for p in args.compare}
    if args.live:
        twin = load_deployment(args.config, args.live_deployment)
        live_rows = run_live(args, twin, {"dqn": dqn} | others)
        write_csv(args.results / "live.csv", live_rows)
        for r in live_rows:
            print(f"{r['policy']:>11} {r['lengths']} {r['rate']:>4g} req/s seed {r['seed']}: "
                  f"reward {r['mean_reward']:.3f}, SLO {r['slo']:.3f}, shed {r['shed']:.3f}, "
                  f"server {r['server_cores']:.2f} cores, errors {r['errored']}")  # fmt: skip
        print(f"wrote {args.results / 'live.csv'}")
        return 0
    config, name, count = args.config, deployment.name, args.requests
    print("tuning the threshold policy on the training distributions, under each rule ...",
          file=sys.stderr)  # fmt: skip
    tuned = thresholds(config, name, args.jobs)
    cells = [
        Cell(n, r, rule) for n, r, rule in itertools.product(args.lengths, args.rates, args.rules)
    ]
    tasks = [(cell, seed) for cell in cells for seed in range(args.seeds)]
    rows: list[dict[str, object]] = []
    cache = args.results / "references"
    with ProcessPoolExecutor(args.jobs) as pool:
        run = partial(run_policies, config, name, {"dqn": dqn} | others, tuned, count)
        for done in tqdm(pool.map(run, tasks), total=len(tasks), desc="policies", file=sys.stderr):
            rows += done
        if not args.no_references:
            tune = partial(hindsight_threshold, config, name, count, args.seeds, tuned,
                           cache=cache)  # fmt: skip
            hindsight: dict[Cell, dict[str, int]] = {}
            for cell, (own, rewards) in zip(cells, tqdm(pool.map(tune, cells), total=len(cells),
                                            desc="hindsight thresholds", file=sys.stderr),
                                            strict=True):  # fmt: skip
                hindsight[cell] = own
                rows += [_base(cell, s) | {"policy": "hindsight-threshold", "mean_reward": r}
                         for s, r in enumerate(rewards)]  # fmt: skip
            run_c = partial(run_clairvoyant, config, name, tuned, hindsight, count, args.passes,
                            cache)  # fmt: skip
            rows += tqdm(pool.map(run_c, tasks), total=len(tasks), desc="clairvoyant",
                         file=sys.stderr)  # fmt: skip
    stem = args.results / deployment.name
    write_csv(stem.with_suffix(".csv"), rows)
    lines = table(rows, deployment.models, list(others))
    command = "python -m experiments.lengths " + " ".join(sys.argv[1:])
    lines += ["", f"Thresholds tuned on the training distributions: {json.dumps(tuned)}."]
    stem.with_suffix(".md").write_text(f"`{command.strip()}`\n\n" + "\n".join(lines) + "\n")
    plot(rows, stem.with_suffix(".png"))
    print("\n".join(lines))
    print(f"wrote {stem}.csv, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
