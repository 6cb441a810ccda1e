"""The experiments of Chuppala (2024) run live (`--live`): the load generator sends a real server
of simulated engines the very workload the simulator saw, and the one-model baselines are the
client naming the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import DEFAULT_PATH, load_deployment
from experiments.harness.baselines import baselines
from experiments.harness.live import live_policy, run_live
from router.evaluate import simulate
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec


def test_baselines_map_to_the_server_and_the_client() -> None:
    assert live_policy("dqn") == ("dqn", "auto")
    assert live_policy("least-load") == ("least-load", "auto")
    assert live_policy("opt-6.7b-only") == (None, "opt-6.7b")
    with pytest.raises(ValueError, match="does not run live"):
        live_policy("threshold")


def test_a_live_run_sends_the_simulators_workload(tmp_path: Path) -> None:
    deployment = load_deployment(DEFAULT_PATH, "embedded-sim")
    flags = ["--arrivals", "poisson", "--rate", "4", "--duration", "3", "--seed", "1"]
    record = run_live("embedded-sim", DEFAULT_PATH, "dqn", flags, tmp_path / "run.json")
    dqn = baselines(deployment, tmp_path, only=["dqn"])["dqn"]()
    simulated = simulate(deployment, dqn, WorkloadSpec(arrivals=Poisson(4.0)), 1, duration=3.0)
    live = record["requests"]
    assert len(live) == len(simulated) > 3
    by_arrival = sorted(simulated, key=lambda f: f.arrival)
    for sent, sim in zip(live, by_arrival, strict=True):
        assert sent["arrival_s"] == pytest.approx(sim.arrival)
        assert sent["task"] == sim.request.task
        assert sent["output_tokens"] == sim.request.max_tokens
    assert all(r["error_kind"] is None for r in live), [r["error"] for r in live]
    assert {r["model"] for r in live} <= set(deployment.models)
    assert 0 < record["summary"]["mean_reward"] <= 1
