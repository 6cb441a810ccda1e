"""The simulator's prefix cache against real vLLM's (CPU build, prefix caching on): the same
multi-turn prompts, in the same order, through a cache small enough that conversations evict
each other, find the same tokens cached (benchmarks/cache_fidelity.py; its timing half is a
benchmark, not a test)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.cache_fidelity import kv_blocks, make_llm, serve_all, simulate, workload
from config import load_deployment
from tests.support.tiers import starts

BLOCKS = 60


@pytest.fixture(scope="module")
@starts("vllm")
def tiny_m() -> Iterator[Any]:
    replica = next(r for r in load_deployment(name="embedded").replicas if r.model == "tiny-m")
    llm = make_llm(replica, BLOCKS, 2048)
    yield replica, llm
    llm.llm_engine.engine_core.shutdown()


def test_the_simulators_cache_finds_what_vllms_finds(tiny_m: tuple[Any, Any]) -> None:
    replica, llm = tiny_m
    served = workload(replica, 8, seed=0, max_prompt=2040)
    assert max(len(s.ids) for s in served) > 1000
    serve_all(llm, served)
    simulate(served, kv_blocks(llm), replica)
    prompt = sum(len(s.ids) for s in served)
    real = sum(s.vllm_cached for s in served) / prompt
    sim = sum(s.sim_cached for s in served) / prompt
    assert 0.2 < real < 0.9, "the cache was meant to hit often, and to evict"
    assert abs(sim - real) <= 0.05
    same = sum(s.vllm_cached == s.sim_cached for s in served)
    assert same >= 0.8 * len(served)
