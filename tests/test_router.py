"""The default policy and the feature encoder the gateway shares with the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from router.features import ArrivalRateEstimator, FeatureEncoder
from router.policies import QualityThreshold
from router.view import ClusterView, ReplicaState
from workloads import Request

QUALITY = {
    "hellaswag": {"small": 0.45, "medium": 0.78, "large": 1.0},
    "copa": {"small": 0.80, "medium": 0.95, "large": 1.0},
}


def view(*running: int, available: tuple[bool, ...] | None = None) -> ClusterView:
    models = ["small", "medium", "large"] * (len(running) // 3)
    available = available or (True,) * len(running)
    return ClusterView(
        tuple(
            ReplicaState(f"r{i}", m, n, a)
            for i, (m, n, a) in enumerate(zip(models, running, available, strict=True))
        )
    )


def request(task: str | None = "hellaswag") -> Request:
    return Request("r", 0.0, "hi", 8, "free-tier", task=task)


def choose(policy: QualityThreshold, v: ClusterView, task: str | None = "hellaswag") -> str:
    return v.replicas[policy.choose(np.zeros(1), request(task), v)].name


def test_idle_cluster_gets_the_best_model() -> None:
    assert choose(QualityThreshold(QUALITY, 4), view(0, 0, 0)) == "r2"


def test_busy_best_model_spills_to_the_next_best() -> None:
    policy = QualityThreshold(QUALITY, 4)
    assert choose(policy, view(0, 0, 4)) == "r1"
    assert choose(policy, view(0, 4, 4)) == "r0"


def test_least_loaded_replica_of_the_chosen_model() -> None:
    # Two GPUs: replicas r2 and r5 hold the large model.
    assert choose(QualityThreshold(QUALITY, 4), view(0, 0, 3, 0, 0, 1)) == "r5"


def test_everything_full_goes_to_the_shortest_queue() -> None:
    assert choose(QualityThreshold(QUALITY, 4), view(9, 5, 6)) == "r1"


def test_unavailable_replicas_are_never_chosen() -> None:
    v = view(0, 0, 0, available=(True, True, False))
    assert choose(QualityThreshold(QUALITY, 4), v) == "r1"


def test_unknown_task_ranks_models_by_mean_quality() -> None:
    assert choose(QualityThreshold(QUALITY, 4), view(0, 0, 0), task=None) == "r2"


def test_encoder_layout() -> None:
    encoder = FeatureEncoder(
        ["r0", "r1", "r2"],
        ["hellaswag", "copa"],
        ["real-time", "free-tier"],
        batch_scale=10,
        rate_scale=20,
    )
    obs = encoder.encode(view(1, 2, 5), request("copa"), rate=4.0)
    np.testing.assert_allclose(obs, [0.1, 0.2, 0.5, 0, 1, 0.2, 0, 1])
    assert obs.dtype == np.float32 and encoder.size == 8
    assert encoder.encode(view(0, 0, 0), request(None), 0.0)[3:5].sum() == 0


@pytest.mark.parametrize("rate", [0.5, 4.0, 40.0])
def test_rate_estimate_settles_on_a_poisson_rate(rate: float) -> None:
    rng = np.random.default_rng(7)
    estimator = ArrivalRateEstimator(horizon_s=10.0)
    now, samples = 0.0, []
    while now < 2000:
        now += rng.exponential(1 / rate)
        seen = estimator.observe(now)
        if now > 100:
            samples.append(seen)
    assert np.mean(samples) == pytest.approx(rate, rel=0.1)


def test_rate_estimate_decays_when_arrivals_stop() -> None:
    estimator = ArrivalRateEstimator(horizon_s=10.0)
    for t in range(100):
        estimator.observe(t * 0.1)
    assert estimator.value(10.0) > 5
    assert estimator.value(60.0) < 0.1
