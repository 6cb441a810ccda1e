"""Routing policies behind one small interface, registered by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from config import Deployment
from router.view import ClusterView
from workloads import Request


class Policy(Protocol):
    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        """Index into view.replicas. Called only when at least one replica is available; the
        gateway replaces a choice of an unavailable replica with that model's least-loaded one."""
        ...


class QualityThreshold:
    """The best-quality model whose least-loaded replica runs fewer than `max_running` requests.

    When every model is that busy, the replica with the fewest running requests wins (ties go to
    the better model): past the threshold, queueing is what costs the deadline.
    """

    def __init__(self, quality: dict[str, dict[str, float]], max_running: int) -> None:
        self.max_running = max_running
        self._by_task = {
            task: sorted(row, key=row.__getitem__, reverse=True) for task, row in quality.items()
        }
        models = list(next(iter(quality.values())))
        mean = {m: sum(row[m] for row in quality.values()) / len(quality) for m in models}
        self._default = sorted(models, key=mean.__getitem__, reverse=True)

    def choose(self, obs: np.ndarray, request: Request, view: ClusterView) -> int:
        ranked = self._by_task.get(request.task or "", self._default)
        fallback: int | None = None
        for model in ranked:
            i = view.least_loaded(model)
            if i is None:
                continue
            if view.replicas[i].running < self.max_running:
                return i
            if fallback is None or view.replicas[i].running < view.replicas[fallback].running:
                fallback = i
        if fallback is None:
            raise ValueError("no replica is available")
        return fallback


PolicyFactory = Callable[[Deployment], Policy]

POLICIES: dict[str, PolicyFactory] = {
    "quality-threshold": lambda d: QualityThreshold(d.quality, d.policy.max_running),
}


def make_policy(deployment: Deployment, name: str | None = None) -> Policy:
    name = name or deployment.policy.name
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return POLICIES[name](deployment)
