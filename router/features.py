"""The observation a policy sees, and the arrival-rate estimate inside it.

One encoder serves both the simulator and the live gateway, so a policy trained in simulation
sees exactly the same features when it routes live requests.
"""

from __future__ import annotations

import math

import numpy as np

from config import Deployment
from router.view import ClusterView
from workloads import Request


class ArrivalRateEstimator:
    """Requests per second, exponentially smoothed over `horizon_s`.

    Each arrival adds 1/horizon to a level that decays as exp(-dt/horizon), so a steady Poisson
    stream of rate r settles around r. It takes `now` and keeps no clock of its own.

    `observe` returns the estimate as the arrival found it, before counting it: read just after
    the jump, every arrival would see r + 1/horizon, a bias that is large at low rates.
    """

    def __init__(self, horizon_s: float = 10.0) -> None:
        self.horizon_s = horizon_s
        self._level = 0.0
        self._last: float | None = None

    def observe(self, now: float) -> float:
        """Count an arrival at `now`; return the rate it found."""
        before = self.value(now)
        self._level = before + 1.0 / self.horizon_s
        self._last = now
        return before

    def value(self, now: float) -> float:
        if self._last is None:
            return 0.0
        return self._level * math.exp(-max(0.0, now - self._last) / self.horizon_s)


class FeatureEncoder:
    """obs = [running requests per replica / batch_scale] + one-hot(task) + [rate / rate_scale]
    + one-hot(QoS class). An unknown or missing task encodes as all zeros."""

    def __init__(
        self,
        replicas: list[str],
        tasks: list[str],
        qos_classes: list[str],
        batch_scale: float = 32.0,
        rate_scale: float = 48.0,
    ) -> None:
        self.replicas = list(replicas)
        self.tasks = {t: i for i, t in enumerate(tasks)}
        self.qos_classes = {c: i for i, c in enumerate(qos_classes)}
        self.batch_scale = batch_scale
        self.rate_scale = rate_scale
        self.size = len(self.replicas) + len(self.tasks) + 1 + len(self.qos_classes)

    @classmethod
    def for_deployment(cls, deployment: Deployment) -> FeatureEncoder:
        """The one layout for a deployment, built the same by the simulator and the gateway."""
        return cls(
            [r.name for r in deployment.replicas], deployment.tasks, list(deployment.qos_classes)
        )

    def encode(self, view: ClusterView, request: Request, rate: float) -> np.ndarray:
        obs = np.zeros(self.size, dtype=np.float32)
        n = len(self.replicas)
        for i, replica in enumerate(view.replicas):
            obs[i] = replica.running / self.batch_scale
        if request.task in self.tasks:
            obs[n + self.tasks[request.task]] = 1.0
        at = n + len(self.tasks)
        obs[at] = rate / self.rate_scale
        if request.qos_class in self.qos_classes:
            obs[at + 1 + self.qos_classes[request.qos_class]] = 1.0
        return obs
