"""The policies every experiment compares, built once per deployment."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path

from config import Deployment
from router.evaluate import tune_threshold
from router.policies import (
    TRAINED,
    DqnPolicy,
    LeastLoad,
    Policy,
    PowerOfTwo,
    QualityThreshold,
    RandomModel,
    RoundRobin,
    Static,
    prefix_hash,
)

MARGIN = 0.005
"""How far below the best of the others the DQN may fall, on the figures of Chuppala (2024)."""


def add_previous_argument(parser: argparse.ArgumentParser) -> None:
    """--previous: the DQN the one measured would replace, compared with (`dqn-previous`)."""
    parser.add_argument(
        "--previous",
        help="the DQN the one measured would replace, run beside it as dqn-previous (default: "
        "the deployment's own, where --policy-file names another); 'none': no other",
    )


def previous_dqn(
    given: str | None, policy_file: Path | None, deployment: Deployment
) -> Path | None:
    """The DQN `--previous` names: by default the deployment's own, where the one measured is
    another (a candidate must not score below the default it would replace)."""
    if given is not None:
        return None if given == "none" else Path(given)
    own = deployment.policy_file
    if policy_file is None or own is None or Path(policy_file).resolve() == Path(own).resolve():
        return None
    return Path(own)


def tuned_thresholds(deployment: Deployment, results: Path) -> dict[str, int]:
    """The grid-searched thresholds, cached in results/ (the search takes minutes)."""
    cache = results / f"threshold-{deployment.name}.json"
    if cache.exists():
        return json.loads(cache.read_text())["thresholds"]
    from tqdm import tqdm

    with tqdm(desc="tuning thresholds", unit="candidate") as bar:
        result = tune_threshold(deployment, progress=bar.update)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"thresholds": result.thresholds, "reward": result.reward}))
    return result.thresholds


def baselines(
    deployment: Deployment,
    results: Path,
    dqn: Path | None = None,
    only: Collection[str] | None = None,
    previous: Path | None = None,
) -> dict[str, Callable[[], Policy]]:
    """Name -> a factory for a fresh policy (round-robin and p2c keep state between calls), for
    every baseline or those named in `only`. The DQN is `dqn`, else the deployment's own trained
    policy, else router/trained/<deployment>.npz; it is left out if there is none. `dqn-net`
    is the deployment's network-aware DQN (`policy.net_path`), where it has one;
    `dqn-previous`, the DQN `previous` (the one the deployment's replaced), where given."""
    wanted = set(only) if only is not None else None

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    policies: dict[str, Callable[[], Policy]] = {}
    own = deployment.policy_file if deployment.policy.name == "dqn" else None
    dqn = dqn or (Path(own) if own else TRAINED / f"{deployment.name}.npz")
    if want("dqn") and dqn.exists():
        trained = DqnPolicy.load(dqn)
        trained.check_fits(deployment)
        policies["dqn"] = lambda: trained
    if want("dqn-previous") and previous is not None and previous.exists():
        before = DqnPolicy.load(previous)
        before.check_fits(deployment)
        policies["dqn-previous"] = lambda: before
    net = deployment.policy.net_path if deployment.policy.name == "dqn" else None
    if want("dqn-net") and net is not None and Path(net).exists():
        aware = DqnPolicy.load(net)
        aware.check_fits(deployment)
        policies["dqn-net"] = lambda: aware
    if want("threshold"):
        thresholds = tuned_thresholds(deployment, results)
        policies["threshold"] = lambda: QualityThreshold(deployment.quality, 32, thresholds)
    for model in deployment.models:
        policies[f"{model}-only"] = partial(Static, model)
    policies |= {
        "round-robin": RoundRobin,
        "least-load": LeastLoad,
        "p2c": PowerOfTwo,
        "prefix-hash": lambda: prefix_hash(deployment),
        "random": lambda: RandomModel(deployment.models),
    }
    return {name: make for name, make in policies.items() if want(name)}


def add_admission_argument(parser: argparse.ArgumentParser) -> None:
    """--admission: the simulator's admission control, for the thesis's experiments."""
    parser.add_argument(
        "--admission",
        choices=["none", "deadline"],
        default="none",
        help="admission control in the simulator: none, as in the thesis (default), or the "
        "deployment's deadline rule, which sends what a replica cannot start in time elsewhere "
        "(so a one-model baseline is no longer one model) or sheds it",
    )
