"""The simulator's outcomes are pinned: every scenario of `tests.sim_scenarios` ends each request
on the same replica, the same way, at the same times (within float tolerance) as the simulator
that wrote tests/data/sim-outcomes.json.gz, so that making it faster cannot change what it
models."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.sim_scenarios import OUTCOMES, SCENARIOS

with gzip.open(OUTCOMES, "rt") as _f:
    PINNED: dict[str, dict] = json.load(_f)


def test_every_scenario_is_pinned() -> None:
    assert set(PINNED) == set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_simulator_ends_every_request_as_pinned(name: str) -> None:
    got, want = SCENARIOS[name](), PINNED[name]
    assert len(got["finished"]) == len(want["finished"]) > 0
    for g, w in zip(got["finished"], want["finished"], strict=True):
        rid, replica, outcome, first, last, tokens, slo = g
        assert [rid, replica, outcome, tokens, slo] == [w[0], w[1], w[2], w[5], w[6]], (g, w)
        assert (first is None) == (w[3] is None), (g, w)
        if first is not None:
            assert first == pytest.approx(w[3], rel=1e-9, abs=1e-9), (g, w)
        assert last == pytest.approx(w[4], rel=1e-9, abs=1e-9), (g, w)
    assert got["replicas"] == want["replicas"]
    assert got.get("events") == want.get("events")
