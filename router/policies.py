"""Routing policies behind one small interface, registered by name.

A policy sees the encoded observation, the request and the cluster view, and returns a replica.
The baselines read the view; the DQN reads only the observation, as it did in training.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from config import DEFAULT_MAX_MODEL_LEN, Deployment
from router.action_features import IN_TIME, ActionFeatures
from router.features import Encoder, FeatureEncoder
from router.prefix import PrefixAffinity, PrefixHash, PrefixIndex, SglangCacheAware
from router.view import ClusterView
from workloads import Request

# The prefix policies live in router.prefix.
__all__ = ["PrefixHash", "PrefixAffinity", "PrefixIndex", "SglangCacheAware"]

log = logging.getLogger(__name__)

TRAINED = Path(__file__).resolve().parent / "trained"
"""Where the shipped policy files live (`<deployment>.npz`, and the others kept by name)."""


class Policy(Protocol):
    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        """Index into view.replicas. Called only when at least one replica is available; the
        gateway replaces a choice of an unavailable replica with that model's least-loaded one."""
        ...


def _least_loaded(view: ClusterView, model: str | None = None) -> int:
    index = view.least_loaded(model)
    if index is None:
        index = view.least_loaded()
    if index is None:
        raise ValueError("no replica is available")
    return index


class Static:
    """Every request to one model (its least-loaded replica): the baselines of Chuppala (2024)."""

    def __init__(self, model: str) -> None:
        self.model = model

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        return _least_loaded(view, self.model)


class RoundRobin:
    """Each available replica in turn, whatever its model or load (Kubernetes' Service)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        available = [i for i, r in enumerate(view.replicas) if r.available]
        if not available:
            raise ValueError("no replica is available")
        return available[next(self._turn) % len(available)]


class LeastLoad:
    """The replica with the fewest requests in flight, any model (KubeAI's LeastLoad)."""

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        return _least_loaded(view)


class PowerOfTwo:
    """The less loaded of two replicas drawn at random (Mitzenmacher's power of two choices)."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        available = [i for i, r in enumerate(view.replicas) if r.available]
        if not available:
            raise ValueError("no replica is available")
        picks = self._rng.choice(available, size=min(2, len(available)), replace=False)
        return int(min(picks, key=lambda i: view.replicas[i].running))


class RandomReplica:
    """An available replica drawn uniformly (Kubernetes' Service as kube-proxy spreads it)."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        available = [i for i, r in enumerate(view.replicas) if r.available]
        if not available:
            raise ValueError("no replica is available")
        return available[int(self._rng.integers(len(available)))]


class RandomModel:
    """A model drawn uniformly, then its least-loaded replica: the floor a learner must clear."""

    def __init__(self, models: Sequence[str], seed: int = 0) -> None:
        self.models = list(models)
        self._rng = np.random.default_rng(seed)

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        return _least_loaded(view, self.models[int(self._rng.integers(len(self.models)))])


class QualityThreshold:
    """The best-quality model (for the request's task) whose least-loaded replica runs fewer
    requests than that model's threshold.

    When every model is that busy, the replica with the fewest running requests wins (ties go to
    the better model): past the thresholds, queueing is what costs the deadline. The thresholds
    are the tuning knobs: `router.evaluate.tune_threshold` grid-searches them on the training
    workloads.
    """

    def __init__(
        self,
        quality: Mapping[str, Mapping[str, float]],
        max_running: int,
        thresholds: Mapping[str, int] | None = None,
    ) -> None:
        models = list(next(iter(quality.values())))
        self.thresholds = {m: max_running for m in models} | dict(thresholds or {})
        self._by_task = {
            task: sorted(row, key=row.__getitem__, reverse=True) for task, row in quality.items()
        }
        mean = {m: sum(row[m] for row in quality.values()) / len(quality) for m in models}
        self._default = sorted(models, key=mean.__getitem__, reverse=True)

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        ranked = self._by_task.get(request.task or "", self._default)
        fallback: int | None = None
        for model in ranked:
            i = view.least_loaded(model)
            if i is None:
                continue
            if view.replicas[i].running < self.thresholds[model]:
                return i
            if fallback is None or view.replicas[i].running < view.replicas[fallback].running:
                fallback = i
        if fallback is None:
            raise ValueError("no replica is available")
        return fallback


def q_values(
    layers: list[tuple[np.ndarray, np.ndarray]], obs: np.ndarray, actions: int | None = None
) -> np.ndarray:
    """A network's `layers` (ReLU between them), each as (its weights transposed, its bias), on
    one observation, in numpy: flat, or (`actions`) one row of the observation per action
    through the same layers."""
    x = obs if actions is None else obs.reshape(actions, -1)
    last = len(layers) - 1
    for i, (w, b) in enumerate(layers):
        x = np.dot(x, w)  # a little cheaper than @ on arrays this small
        x += b
        if i < last:
            np.maximum(x, 0.0, out=x)
    return x if actions is None else x[:, 0]


class DqnPolicy:
    """A trained Q-network evaluated as numpy matrix products: no torch in the routing path.

    The file (`.npz`) holds the layers and, as JSON, the observation layout it was trained on and
    what its actions mean, so that a policy cannot silently route a deployment it does not fit.
    """

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray]], meta: dict[str, Any]) -> None:
        self.layers = [(w.astype(np.float32), b.astype(np.float32)) for w, b in layers]
        # Transposed and contiguous once: a row times each is the hot path's one product.
        self._forward = [(np.ascontiguousarray(w.T), b) for w, b in self.layers]
        self.meta = meta
        self.action = meta["action"]
        self.models: list[str] = meta["models"]
        self.masked = bool(meta.get("masked", False))
        """Trained with the actions admission control rules out masked: it chooses among those
        the view allows (earlier policies took their best action and the gateway swapped a
        ruled-out choice for the least-loaded replica it allows)."""
        self.per_action = meta.get("layout") == "per-action"
        """A row of features per action through one network (`router.action_features`): its
        layout is computed from the deployment's profile, so it is built when the policy is
        bound to one (`bind`)."""
        self.encoder: Encoder = (
            _Unbound() if self.per_action else FeatureEncoder(
                meta["replicas"],
                meta["tasks"],
                meta["qos_classes"],
                meta.get("batch_scale", 32.0),
                meta.get("rate_scale", 48.0),
                meta.get("path_deadlines"),
                meta.get("tpot_s", 0.04),
                meta.get("token_scale"),
                meta.get("context", DEFAULT_MAX_MODEL_LEN),
            )
        )  # fmt: skip
        """The observation layout it was trained on; the gateway encodes with this one, so a task
        or class added to models.yaml later reaches the network as "none of those it knows". A
        policy that reads the request's lengths records their scale (`token_scale`; those
        trained before do not); a network-aware one (trained with a path mix) adds its
        requests' paths and budgets."""

    def bind(self, deployment: Deployment) -> None:
        """Build a per-action layout on `deployment` (its profile, SLO and classes as the
        policy recorded them); a flat one needs nothing."""
        if self.per_action:
            self.encoder = ActionFeatures(
                deployment,
                paths=bool(self.meta.get("paths")),
                classes=self.meta["qos_classes"],
                in_time=self.meta.get("in_time", IN_TIME),
                loads=bool(self.meta.get("loads")),
            )

    def q_values(self, obs: np.ndarray) -> np.ndarray:
        return q_values(self._forward, obs, len(self.models) if self.per_action else None)

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        q = self.q_values(obs)
        if self.per_action:
            assert isinstance(self.encoder, ActionFeatures)
            values = q.tolist()
            allowed = [a for a, ok in enumerate(self.encoder.allowed(obs).tolist()) if ok]
            if not allowed:
                raise ValueError("no replica is available")
            return _least_loaded(view, self.models[max(allowed, key=values.__getitem__)])
        if self.masked:
            return self._best_allowed(q, view)
        action = int(np.argmax(q))
        if self.action == "replica":
            return action
        return _least_loaded(view, self.models[action])

    def _best_allowed(self, q: np.ndarray, view: ClusterView) -> int:
        """The replica of the best action among those the view allows (a model with a replica
        that may take the request, or such a replica): the others are masked, as in training."""
        best, choice = -np.inf, None
        for action, value in enumerate(q.tolist()):
            if value <= best:
                continue
            if self.action == "replica":
                replica: int | None = action if view.replicas[action].available else None
            else:
                replica = view.least_loaded(self.models[action])
            if replica is not None:
                best, choice = value, replica
        if choice is None:
            raise ValueError("no replica is available")
        return choice

    def save(self, path: str | Path) -> None:
        arrays = {f"w{i}": w for i, (w, _) in enumerate(self.layers)}
        arrays |= {f"b{i}": b for i, (_, b) in enumerate(self.layers)}
        # numpy's stub: mypy checks the **dict against the keyword allow_pickle too.
        np.savez_compressed(path, meta=np.array(json.dumps(self.meta)), **arrays)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: str | Path) -> DqnPolicy:
        try:
            with np.load(path) as data:
                meta = json.loads(str(data["meta"]))
                n = sum(1 for k in data.files if k.startswith("w"))
                layers = [(data[f"w{i}"], data[f"b{i}"]) for i in range(n)]
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"{path}: not a trained router policy: {exc}") from exc
        return cls(layers, meta)

    def check_fits(self, deployment: Deployment) -> None:
        """Raise unless the deployment has the replicas and models this policy was trained on:
        a replica of the same model in each place of its view, whatever the replicas' names (a
        fleet's `engines...:7000#2/cuda:0/opt-6.7b` is one 4-GPU host's `cuda:2/opt-6.7b`).
        Tasks and classes may differ: unknown ones encode as zeros (FeatureEncoder)."""
        trained = dict(self.meta)
        if isinstance(names := trained.get("replicas"), list):
            trained["replicas"] = [str(name).rsplit("/", 1)[-1] for name in names]
        layout: dict[str, object] = {
            "replicas": [r.model for r in deployment.replicas],
            "models": deployment.models,
        }
        if self.encoder.reads_lengths:  # max_tokens' default, which it reads, is the context's
            layout["context"] = deployment.max_model_len
        for key, want in layout.items():
            if trained.get(key) != want:
                raise ValueError(
                    f"the policy was trained with {key} {self.meta.get(key)}, but deployment "
                    f"{deployment.name!r} has {want}; retrain it with python -m router.train"
                )
        if (stale := self.stale_quality(deployment)) is not None:
            log.warning(stale)

    def stale_quality(self, deployment: Deployment) -> str | None:
        """Why the policy's quality table is not the deployment's (None: it is). It still routes:
        the table moves what a request is worth, not what the policy can see, but its choices
        weigh the models by the table it was trained on."""
        trained = self.meta.get("quality")
        if trained is None:
            return (
                f"the policy records no quality table; deployment {deployment.name!r} routes on "
                f"{deployment.quality_source.rstrip('.')}. Retrain it with python -m router.train"
            )
        differ = sorted(
            task
            for task, row in deployment.quality.items()
            if any(abs(trained.get(task, {}).get(m, -1.0) - q) > 1e-6 for m, q in row.items())
        )
        if not differ:
            return None
        return (
            f"the policy is stale: it was trained on another quality table "
            f"({self.meta.get('quality_source', 'unrecorded').rstrip('.')}) than deployment "
            f"{deployment.name!r} has ({deployment.quality_source.rstrip('.')}); they differ on "
            f"{', '.join(differ)}. Retrain it with python -m router.train"
        )


def ensemble(policies: Sequence[DqnPolicy], meta: dict[str, Any]) -> DqnPolicy:
    """One network whose Q-values are the mean of `policies`' (networks of one layout and
    depth): their hidden layers side by side, each layer's weights block-diagonal, the last
    layer averaging them. A matrix product of a few rows costs about the same at 64 units as
    at 192 here, so the ensemble routes nearly as fast as one of them."""
    first = policies[0]
    depth = len(first.layers)
    if any(len(p.layers) != depth or p.meta.get("layout") != first.meta.get("layout")
           for p in policies):  # fmt: skip
        raise ValueError("an ensemble needs networks of one layout and depth")
    k = len(policies)
    layers = []
    for i in range(depth):
        ws = [p.layers[i][0] for p in policies]
        bs = [p.layers[i][1] for p in policies]
        if i == 0:
            w = np.vstack(ws)
        else:
            rows = sum(x.shape[0] for x in ws) if i < depth - 1 else ws[0].shape[0]
            w = np.zeros((rows, sum(x.shape[1] for x in ws)), np.float32)
            r = c = 0
            for x in ws:
                if i < depth - 1:
                    w[r : r + x.shape[0], c : c + x.shape[1]] = x
                    r += x.shape[0]
                else:
                    w[:, c : c + x.shape[1]] = x / k
                c += x.shape[1]
        b = np.concatenate(bs) if i < depth - 1 else np.mean(bs, axis=0)
        layers.append((w, b))
    return DqnPolicy(layers, first.meta | meta)


def encoder_for(policy: Policy, deployment: Deployment) -> Encoder:
    """The observation layout to route `policy` with: a trained policy brings the one it learned
    on (network-blind or network-aware, flat or per action), the others take the deployment's."""
    if isinstance(policy, DqnPolicy):
        if isinstance(policy.encoder, _Unbound):
            policy.bind(deployment)
        return policy.encoder
    own = getattr(policy, "encoder", None)
    return (
        own
        if isinstance(own, FeatureEncoder | ActionFeatures)
        else (FeatureEncoder.for_deployment(deployment))
    )


class _Unbound:
    """A per-action policy's layout before it is bound to a deployment (`DqnPolicy.bind`)."""

    size = 0
    reads_lengths = True

    def encode(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise RuntimeError("a per-action policy routes only once bound to a deployment (bind)")

    def budget(self, *args: Any, **kwargs: Any) -> None:
        return None


def _dqn(deployment: Deployment) -> DqnPolicy:
    if deployment.policy_file is None:
        raise ValueError(f"deployment {deployment.name!r}: policy dqn needs a path")
    policy = DqnPolicy.load(deployment.policy_file)
    policy.check_fits(deployment)
    policy.bind(deployment)
    return policy


def _static(deployment: Deployment) -> Static:
    model = deployment.policy.model
    if model not in deployment.models:
        raise ValueError(f"policy static needs a model of the deployment, got {model!r}")
    return Static(model)


class ModelThenReplica:
    """The learned router chooses the model; a prefix policy chooses that model's replica."""

    def __init__(self, model_policy: Policy, replica_policy: Policy) -> None:
        self.model_policy = model_policy
        self.replica_policy = replica_policy
        self.encoder = getattr(model_policy, "encoder", None)
        """The model policy's observation layout, where it brings one (a trained DQN)."""

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        model = view.replicas[self.model_policy.choose(obs, request, view)].model
        if isinstance(self.replica_policy, PrefixAffinity | PrefixHash | SglangCacheAware):
            return self.replica_policy.choose(obs, request, view, model)
        only = view.only([r.model == model for r in view.replicas])
        return self.replica_policy.choose(obs, request, only)


PolicyFactory = Callable[[Deployment], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "quality-threshold": lambda d: QualityThreshold(
        d.quality, d.policy.max_running, d.policy.thresholds
    ),
    "dqn": _dqn,
    "static": _static,
    "round-robin": lambda d: RoundRobin(),
    "least-load": lambda d: LeastLoad(),
    "p2c": lambda d: PowerOfTwo(),
    "prefix-hash": lambda d: prefix_hash(d),
    "prefix-approx": lambda d: PrefixAffinity(approximate_index(d), False, d.quality),
    "prefix-precise": lambda d: PrefixAffinity(PrefixIndex(len(d.replicas)), True, d.quality),
    "sglang-cache-aware": lambda d: SglangCacheAware(d.quality),
    "random": lambda d: RandomModel(d.models),
    "random-replica": lambda d: RandomReplica(),
}


def prefix_hash(deployment: Deployment) -> PrefixHash:
    """KubeAI's policy on `deployment`: a ring per model."""
    replicas = deployment.replicas
    return PrefixHash([r.name for r in replicas], [r.model for r in replicas], deployment.quality)


def approximate_index(deployment: Deployment) -> PrefixIndex:
    """An index kept from routing decisions, each replica's share bounded by its KV cache in
    blocks (where the deployment sizes one)."""
    return PrefixIndex(
        len(deployment.replicas),
        [r.kv_tokens // r.block_size if r.kv_tokens else None for r in deployment.replicas],
    )


def make_policy(deployment: Deployment, name: str | None = None) -> Policy:
    """The policy `name` (default: the deployment's); "A+B": A chooses the model, B that
    model's replica (`ModelThenReplica`), e.g. "dqn+prefix-precise"."""
    name = name or deployment.policy.name
    first, plus, second = name.partition("+")
    if plus:
        return ModelThenReplica(make_policy(deployment, first), make_policy(deployment, second))
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name](deployment)
