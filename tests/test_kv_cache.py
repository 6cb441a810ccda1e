"""The prefix cache model (router/kv_cache.py) and the batcher that runs it, in virtual time."""

from __future__ import annotations

import random

import pytest

from config import Slo
from config.schema import ProfileModel
from router.kv_cache import REMOVED, STORED, KvCache, block_hashes
from router.sim import OK, Batcher, Job, Simulator
from workloads import Request

BLOCK = 4
PER_TOKEN = 0.001
PROFILE = ProfileModel(prefill_s_per_token=PER_TOKEN, step_s={1: 0.01, 64: 0.01})


def request(ids: list[int], max_tokens: int = 2, rid: str = "r") -> Request:
    return Request(rid, 0.0, "x", max_tokens, "free-tier", prompt_tokens=len(ids),
                   blocks=block_hashes(ids, BLOCK))  # fmt: skip


def job(ids: list[int], max_tokens: int = 2, rid: str = "r") -> Job:
    return Job(request(ids, max_tokens, rid), 0.0, float("inf"), max_tokens, max_tokens)


def computed(cost: float) -> int:
    """Prompt tokens an iteration computed, from its cost (steps here take 10 ms flat)."""
    return round((cost - 0.01) / PER_TOKEN)


def run(batch: Batcher, now: float = 0.0) -> list[tuple[Job, str]]:
    """Iterations until the batch is empty."""
    ended = []
    while (cost := batch.begin()) is not None:
        now += cost
        ended += batch.end(now)
    return ended


def test_hashes_chain_so_equal_hashes_mean_equal_prefixes() -> None:
    a = block_hashes(list(range(12)), BLOCK)
    b = block_hashes([*range(8), 99, 9, 10, 11], BLOCK)
    c = block_hashes([7, *range(1, 12)], BLOCK)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c), "a changed first block changes every later hash"
    assert block_hashes(list(range(11)), BLOCK) == a[:2], "only full blocks are hashed"


def test_a_second_turn_hits_the_first_turns_blocks() -> None:
    batch = Batcher(PROFILE, 8, kv=KvCache(64, BLOCK))
    first = list(range(10))  # two full blocks and two tokens
    batch.add(job(first))
    assert computed(batch.begin() or 0) == 10
    run(batch)
    second = first + [50, 51, 52, 53, 54, 55]  # the history again, and a new message
    batch.add(turn := job(second))
    # its first two blocks were cached; the rest (16 - 8 tokens) is computed
    assert computed(batch.begin() or 0) == 8
    assert turn.cached_tokens == 8 and batch.hit_tokens == 8 and batch.prompt_tokens == 26


@pytest.mark.parametrize("shared", [0, 1, 2, 3])
def test_a_request_sharing_k_blocks_prefills_exactly_its_other_tokens(shared: int) -> None:
    batch = Batcher(PROFILE, 8, kv=KvCache(64, BLOCK))
    base = list(range(100, 116))  # four blocks
    batch.add(job(base))
    run(batch)
    other = base[: shared * BLOCK] + [900 + i for i in range(17 - shared * BLOCK)]
    batch.add(job(other))
    assert computed(batch.begin() or 0) == len(other) - shared * BLOCK


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    """vLLM needs the last token's logits: a hit covers at most the prompt less one token."""
    batch = Batcher(PROFILE, 8, kv=KvCache(64, BLOCK))
    batch.add(job(list(range(8))))
    run(batch)
    batch.add(job(list(range(8))))
    assert computed(batch.begin() or 0) == BLOCK


def test_eviction_reclaims_only_blocks_no_request_holds() -> None:
    events: list[tuple[str, list[int]]] = []
    kv = KvCache(6, BLOCK, lambda kind, hashes: events.append((kind, hashes)))
    old = block_hashes(list(range(8)), BLOCK)
    got = kv.hold(old, 2, 2)
    assert got is not None
    hold_old, _ = got
    kv.release(hold_old)  # idle, still cached
    running = block_hashes(list(range(50, 58)), BLOCK)
    got = kv.hold(running, 3, 2)
    assert got is not None and kv.free == 1 and kv.cached == 4
    # five more blocks: one free, two reclaimed from the idle ones, and no more
    assert kv.hold((), 5, 0) is None, "held blocks are never reclaimed"
    assert kv.hold((), 3, 0) is not None
    assert all(h in kv for h in running) and not any(h in kv for h in old)
    removed = [h for kind, hashes in events if kind == REMOVED for h in hashes]
    assert removed == [old[1], old[0]], "the last block of a prompt goes first"


def test_capacity_is_never_exceeded_and_events_build_the_exact_index() -> None:
    """Random conversations through a small cache with preemption: at every iteration held plus
    idle blocks fit the capacity, and the stored and removed events rebuild exactly the blocks
    the cache holds (what a precise prefix index of this replica is)."""
    rng = random.Random(3)
    index: set[int] = set()

    def hear(kind: str, hashes: list[int]) -> None:
        for h in hashes:
            assert (h in index) == (kind == REMOVED)
            (index.add if kind == STORED else index.discard)(h)

    kv = KvCache(40, BLOCK, hear)
    batch = Batcher(PROFILE, 16, kv=kv, max_batched_tokens=24)
    histories = [[rng.randrange(1000) for _ in range(rng.randrange(1, 12))] for _ in range(12)]
    now = 0.0
    done = 0
    for n in range(400):
        if rng.random() < 0.5:
            h = histories[rng.randrange(len(histories))]
            h += [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            del h[: max(0, len(h) - 60)]
            batch.add(job(list(h), rng.randrange(1, 12), f"r{n}"))
        cost = batch.begin()
        if cost is None:
            continue
        assert kv.held + (kv.cached - _held_hashes(batch)) <= kv.capacity
        assert kv.held == _held_hashes(batch) + sum(j.hold.private for j in batch.running if j.hold)
        now += cost
        done += sum(outcome == OK for _, outcome in batch.end(now))
        assert index == kv.hashes()
    done += sum(outcome == OK for _, outcome in run(batch, now))
    assert batch.in_flight == 0 and kv.held == 0 and index == kv.hashes()
    assert batch.preemptions > 0, "the cache was meant to be small enough to preempt"
    assert done > 100


def _held_hashes(batch: Batcher) -> int:
    return len({h for j in batch.running if j.hold for h in j.hold.hashes})


def test_a_preempted_request_gives_back_its_blocks_and_still_gets_every_token() -> None:
    kv = KvCache(5, BLOCK)
    batch = Batcher(PROFILE, 8, kv=kv)
    a, b = job(list(range(8)), 8, "a"), job(list(range(100, 108)), 8, "b")
    batch.add(a)
    batch.add(b)
    ended = run(batch)
    assert batch.preemptions >= 1
    assert sorted((j.request.request_id, outcome) for j, outcome in ended) == [
        ("a", OK),
        ("b", OK),
    ]
    assert a.remaining == 0 and b.remaining == 0 and kv.held == 0


def test_a_request_that_does_not_fit_holds_back_the_queue() -> None:
    """First come, first served, as vLLM: a prompt that does not fit waits, and so do those
    behind it, though they would fit."""
    batch = Batcher(PROFILE, 8, kv=KvCache(4, BLOCK))
    batch.add(big := job(list(range(12)), 8, "big"))
    batch.add(job(list(range(200, 216)), 2, "huge"))
    batch.add(small := job([1], 2, "small"))
    batch.begin()
    assert batch.running == [big] and small in batch.waiting


def test_chunked_prefill_spreads_a_prompt_over_iterations() -> None:
    batch = Batcher(PROFILE, 8, kv=KvCache(64, BLOCK), max_batched_tokens=10)
    batch.add(long := job(list(range(25)), 1))
    costs = []
    while long.first_token is None:
        cost = batch.begin()
        assert cost is not None
        costs.append(computed(cost))
        batch.end(len(costs))
    assert costs == [10, 10, 5] and long.first_token == 3


def test_the_simulator_keeps_a_cache_per_replica_and_counts_hits() -> None:
    sim = Simulator(
        [("a", "m", "d0"), ("b", "m", "d1")],
        {"m": PROFILE},
        slo=Slo(tpot_s=1.0),
        kv=[(64, BLOCK), (64, BLOCK)],
    )
    ids = list(range(20))
    sim.submit(request(ids, rid="1"), 0)
    sim.drain()
    sim.submit(request(ids + [5] * 8, rid="2"), 0)  # same replica: its history is cached
    sim.submit(request(ids + [6] * 8, rid="3"), 1)  # the other: nothing cached there
    sim.drain()
    a, b = (r.batch for r in sim.replicas)
    assert (a.hit_tokens, b.hit_tokens) == (20, 0)


def test_two_copies_of_a_prompt_in_flight_share_all_but_the_recomputed_last_block() -> None:
    kv = KvCache(64, BLOCK)
    batch = Batcher(PROFILE, 8, kv=kv)
    batch.add(first := job(list(range(8)), 4, "1"))
    batch.add(second := job(list(range(8)), 4, "2"))
    assert computed(batch.begin() or 0) == 8 + BLOCK
    assert first.hold is not None and second.hold is not None
    assert (len(first.hold.hashes), first.hold.private) == (2, 0)
    assert (len(second.hold.hashes), second.hold.private) == (1, 1)
    assert kv.held == 3 and kv.cached == 2
    run(batch)
    assert kv.held == 0 and kv.cached == 2


def test_a_cleared_cache_says_every_block_is_gone_and_refuses_while_any_is_held() -> None:
    events: list[tuple[str, list[int]]] = []
    kv = KvCache(16, BLOCK, lambda kind, hashes: events.append((kind, hashes)))
    got = kv.hold(block_hashes(list(range(12)), BLOCK), 3, 3)
    assert got is not None
    with pytest.raises(RuntimeError, match="still held"):
        kv.clear()
    kv.release(got[0])
    kv.clear()
    assert kv.cached == 0 and kv.free == 16
    assert sorted(events[-1][1]) == sorted(block_hashes(list(range(12)), BLOCK))
    assert events[-1][0] == REMOVED
