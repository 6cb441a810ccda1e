"""The cluster simulator against latencies worked out by hand."""

from __future__ import annotations

import pytest

from config import Slo, load_deployment
from config.schema import ProfileModel
from router.sim import Simulator, step_time
from workloads import Message, Request

PROFILE = ProfileModel(prefill_s_per_token=0.001, step_s={1: 0.010, 2: 0.020, 4: 0.030})
SLO = Slo(tpot_s=0.040)


def request(rid: str, prompt_tokens: int, max_tokens: int) -> Request:
    return Request(rid, 0.0, (Message("user", "x"),), max_tokens, "free-tier", "copa",
                   prompt_tokens=prompt_tokens)  # fmt: skip


def test_step_time_interpolates_between_profiled_batches() -> None:
    assert step_time(PROFILE, 1) == pytest.approx(0.010)
    assert step_time(PROFILE, 3) == pytest.approx(0.025)
    assert step_time(PROFILE, 64) == pytest.approx(0.030)


def test_continuous_batching_by_hand() -> None:
    sim = Simulator([("r0", "m", "gpu0")], {"m": PROFILE}, SLO)
    sim.submit(request("a", prompt_tokens=10, max_tokens=3), 0)
    # Iteration 1, batch {a}: 10 ms step + 10 ms prefill -> a's first token at 20 ms.
    assert sim.advance(0.005) == []
    sim.submit(request("b", prompt_tokens=40, max_tokens=2), 0)  # arrives at 5 ms, waits
    assert sim.view().replicas[0].running == 2
    # Iteration 2 at 20 ms admits b: 20 ms step (batch 2) + 40 ms prefill -> ends at 80 ms.
    # Iteration 3: 20 ms -> 100 ms, a's third token and b's second: both finish.
    done = {f.request.request_id: f for f in sim.drain()}
    a, b = done["a"], done["b"]
    assert (a.first_token, a.last_token) == pytest.approx((0.020, 0.100))
    assert (b.arrival, b.first_token, b.last_token) == pytest.approx((0.005, 0.080, 0.100))
    assert a.slo_met  # 100 ms / 3 tokens = 33 ms per token
    assert not b.slo_met  # 95 ms / 2 tokens = 47.5 ms per token
    assert sim.view().replicas[0].running == 0


def test_replicas_on_one_device_slow_each_other() -> None:
    replicas = [("g0/a", "m", "gpu0"), ("g0/b", "m", "gpu0"), ("g1/a", "m", "gpu1")]
    sim = Simulator(replicas, {"m": PROFILE}, SLO, interference=0.5)
    for i in range(3):
        sim.submit(request(f"r{i}", prompt_tokens=0, max_tokens=1), i)
    done = {f.replica: f.last_token for f in sim.drain()}
    # g0/a started alone: 10 ms. g0/b started beside busy g0/a: 10 ms x 1.5. gpu1 is alone.
    assert done == pytest.approx({0: 0.010, 1: 0.015, 2: 0.010})


def test_max_batch_queues_the_rest() -> None:
    sim = Simulator([("r0", "m", "gpu0")], {"m": PROFILE}, SLO, max_batch=1)
    sim.submit(request("a", 0, 2), 0)
    sim.submit(request("b", 0, 1), 0)
    done = {f.request.request_id: f.last_token for f in sim.drain()}
    assert done == pytest.approx({"a": 0.020, "b": 0.030})


def test_the_paper_deployment_simulates_twelve_replicas_on_four_gpus() -> None:
    sim = Simulator.from_deployment(load_deployment(name="paper-4gpu"))
    assert len(sim.replicas) == 12
    assert {r.device for r in sim.replicas} == {f"cuda:{i}" for i in range(4)}
    with pytest.raises(ValueError, match="names no latency profile"):
        Simulator.from_deployment(load_deployment(name="opt-cpu"))


def test_on_tokens_tells_each_token_at_its_iterations_end() -> None:
    sim = Simulator([("r0", "m", "gpu0")], {"m": PROFILE}, SLO)
    seen: list[tuple[str, float, int]] = []
    sim.on_tokens = lambda jobs: seen.extend(
        (j.request.request_id, sim.now, j.remaining) for j in jobs
    )
    sim.submit(request("a", prompt_tokens=10, max_tokens=3), 0)
    sim.advance(0.005)
    sim.submit(request("b", prompt_tokens=40, max_tokens=2), 0)
    assert sim.next_event() == pytest.approx(0.020)
    sim.drain()
    # The iterations of test_continuous_batching_by_hand: 20, 80 and 100 ms.
    assert seen == [("a", pytest.approx(0.020), 2), ("a", pytest.approx(0.080), 1),
                    ("b", pytest.approx(0.080), 1), ("a", pytest.approx(0.100), 0),
                    ("b", pytest.approx(0.100), 0)]  # fmt: skip
    assert sim.next_event() is None
