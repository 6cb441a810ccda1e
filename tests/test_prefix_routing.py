"""Prefix-aware routing (router/prefix.py), the conversations workload and the simulator's
closed-loop client, in virtual time."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from config import Slo, load_deployment
from config.schema import ProfileModel
from router.closed_loop import run_closed_loop
from router.kv_cache import block_hashes
from router.prefix import PrefixAffinity, PrefixHash, PrefixIndex, within_bound
from router.sim import OK, Simulator
from router.view import ClusterView, ReplicaState
from workloads import Message, Request
from workloads.conversations import (
    SHAREGPT_16,
    FourCharacters,
    conversations,
    kubeai_benchmark_prompts,
    turns,
)

OBS = np.zeros(1, dtype=np.float32)
BLOCK = 4
PROFILE = ProfileModel(prefill_s_per_token=0.0001, step_s={1: 0.01, 256: 0.05})


def view(loads: list[int], models: list[str] | None = None) -> ClusterView:
    models = models or ["m"] * len(loads)
    return ClusterView(
        tuple(
            ReplicaState(f"r{i}", m, n, True)
            for i, (n, m) in enumerate(zip(loads, models, strict=True))
        )
    )


def chat(first: str, turn: int, ids: list[int] | None = None) -> Request:
    messages = (Message("user", first),) + tuple(Message("user", f"t{i}") for i in range(turn))
    blocks = block_hashes(ids, BLOCK) if ids is not None else None
    return Request(f"q{turn}", 0.0, messages, 8, "free-tier", blocks=blocks)


def test_bounded_load_hashing_never_exceeds_its_bound() -> None:
    rng = random.Random(0)
    policy = PrefixHash([f"r{i}" for i in range(6)])
    loads = [0] * 6
    for n in range(3000):
        v = view(loads)
        _, bound = within_bound(v, "m", policy.load_factor)
        pick = policy.choose(OBS, chat(f"conversation {rng.randrange(5)}", n), v)
        assert loads[pick] + 1 <= bound
        loads[pick] += 1
        if rng.random() < 0.5:  # one ends somewhere
            busy = [i for i, x in enumerate(loads) if x]
            loads[rng.choice(busy)] -= 1
    # Under load that grows without end, it stays within 1.25 x the mean.
    assert max(loads) <= 1.25 * sum(loads) / 6 + 1


def test_one_ring_per_model_keeps_a_request_on_its_models_replicas() -> None:
    names = [f"r{i}" for i in range(6)]
    models = ["small", "big"] * 3
    quality = {"t": {"small": 0.5, "big": 1.0}}
    policy = PrefixHash(names, models, quality)
    for k in range(50):
        request = replace(chat(f"conversation {k}", 0), task="t")
        assert models[policy.choose(OBS, request, view([0] * 6, models))] == "big"
        only_small = view([0] * 6, models).only([m == "small" for m in models])
        assert models[policy.choose(OBS, request, only_small)] == "small"


def test_the_approximate_index_follows_the_routers_own_decisions() -> None:
    policy = PrefixAffinity(PrefixIndex(4, [8, 8, 8, 8]), precise=False)
    history = list(range(40))
    first = policy.choose(OBS, chat("a", 0, history), view([2, 0, 1, 1]))
    assert first == 1, "nothing cached anywhere: the least loaded"
    # the next turn carries the history: it goes where the history went, though busier
    assert policy.choose(OBS, chat("a", 1, history + [7] * 8), view([2, 2, 1, 1])) == 1
    # ...up to the load bound, ceil((total + 1) / 4 x 1.25) + SLACK: 13 at 12 running, not at 13
    assert policy.choose(OBS, chat("a", 2, history + [7] * 12), view([0, 12, 0, 0])) == 1
    assert policy.choose(OBS, chat("a", 3, history + [7] * 16), view([0, 13, 0, 0])) != 1
    # A replica's share is bounded by its cache: 8 blocks; the oldest are forgotten.
    assert len(policy.index.held_by(1)) <= 8


def test_the_index_matches_the_longest_prefix_per_replica() -> None:
    index = PrefixIndex(3)
    a = block_hashes(list(range(20)), BLOCK)  # five blocks
    index.event(0, "stored", a[:2])
    index.event(1, "stored", a)
    index.event(2, "stored", a[1:])  # not a prefix: its first block is missing
    assert index.match(a, [0, 1, 2]) == {0: 2, 1: 5, 2: 0}
    index.event(1, "removed", a[3:])
    assert index.match(a, [0, 1]) == {0: 2, 1: 3}


def _kubeai_like(n_conv: int = 12, seed: int = 0) -> list[Request]:
    convs = conversations(SHAREGPT_16, n_conv, seed)
    out = []
    for r in kubeai_benchmark_prompts(convs, max_prompts=60, requests=300):
        ids = [ord(c) for m in r.prompt for c in m.content][: (r.prompt_tokens or 0)]  # type: ignore[union-attr]
        out.append(
            replace(r, blocks=block_hashes(ids, BLOCK), max_tokens=min(r.max_tokens or 1, 32))
        )
    return out


def _sim(replicas: int, on_event=None, blocks: int = 4000) -> Simulator:  # type: ignore[no-untyped-def]
    return Simulator(
        [(f"r{i}", "m", f"d{i}") for i in range(replicas)],
        {"m": PROFILE},
        Slo(tpot_s=1.0),
        kv=[(blocks * BLOCK, BLOCK)] * replicas,
        max_batched_tokens=2048,
        on_kv_event=on_event,
    )


def test_the_twins_kv_events_build_exactly_the_index_each_engine_holds() -> None:
    index = PrefixIndex(4)
    policy = PrefixAffinity(index, precise=True)
    sim = _sim(4, policy.event, blocks=600)  # small: blocks are reclaimed, and so removed
    done = run_closed_loop(sim, lambda r, v: policy.choose(OBS, r, v), _kubeai_like(), 16)
    assert all(f.outcome == OK for f in done) and len(done) == 300
    for i, replica in enumerate(sim.replicas):
        assert replica.batch.kv is not None
        assert index.held_by(i) == replica.batch.kv.hashes()
    assert sum(r.batch.kv.cached for r in sim.replicas if r.batch.kv) < 4 * 600 + 1


def test_prefix_routing_finds_more_of_the_cache_than_spreading() -> None:
    hits = {}
    for name in ("round-robin", "precise"):
        policy = PrefixAffinity(PrefixIndex(4), precise=True)
        sim = _sim(4, policy.event, blocks=800)  # too small for every conversation everywhere
        turn = itertools.count()
        precise = name == "precise"

        def route(r: Request, v: ClusterView, p: PrefixAffinity = policy) -> int:
            return p.choose(OBS, r, v) if precise else next(turn) % 4  # noqa: B023

        run_closed_loop(sim, route, _kubeai_like(), 16)
        hits[name] = sum(r.batch.hit_tokens for r in sim.replicas) / sum(
            r.batch.prompt_tokens for r in sim.replicas
        )
    assert hits["precise"] > hits["round-robin"] + 0.2


@pytest.mark.parametrize("concurrency", [1, 5, 40])
def test_the_closed_loop_keeps_exactly_n_requests_in_flight(concurrency: int) -> None:
    sim = _sim(2)
    after: dict[float, int] = {}  # send time -> requests in flight once it is sent

    def route(request: Request, v: ClusterView) -> int:
        after[sim.now] = sum(r.batch.in_flight for r in sim.replicas) + 1
        return len(after) % 2

    requests = _kubeai_like()[:120]
    done = run_closed_loop(sim, route, requests, concurrency)
    assert len(done) == 120
    # Everything is ready at once: whenever requests end, as many go out, back to exactly N,
    # until the last are out.
    sends = list(after.values())
    assert set(sends[:-1]) == {concurrency} and sends[-1] <= concurrency


def test_the_ordered_closed_loop_sends_a_turn_after_the_previous_answer() -> None:
    convs = conversations(SHAREGPT_16, 6, seed=1)
    requests = [replace(r, max_tokens=min(r.max_tokens or 1, 16)) for r in turns(convs)]
    sim = _sim(2)
    done = run_closed_loop(sim, lambda r, v: 0, requests, 4, rate=5.0, ordered=True)
    assert len(done) == len(requests)
    by_id = {f.request.request_id: f for f in done}
    for r in requests:
        head, _, k = r.request_id.rpartition("t")
        if int(k) > 0:
            previous = by_id[f"{head}t{int(k) - 1}"]
            assert by_id[r.request_id].arrival >= previous.last_token
    in_flight_sessions = max(
        sum(1 for f in done if f.arrival <= t < f.last_token) for t in np.linspace(0, 30, 300)
    )
    assert in_flight_sessions <= 4


def test_kubeai_benchmark_prompts_repeat_a_few_hundred_prompts_in_shuffled_passes() -> None:
    requests = kubeai_benchmark_prompts(
        conversations(SHAREGPT_16, 40, 0), max_prompts=100, requests=350
    )
    prompts = [r.prompt for r in requests]
    assert len(set(prompts)) == 100 and prompts[:100] == prompts[100:200]
    assert len({r.request_id for r in requests}) == 350
    assert all(r.max_tokens is not None and r.max_tokens >= 4 for r in requests)


def test_conversation_turns_carry_the_whole_history() -> None:
    (conv,) = conversations(SHAREGPT_16, 1, 5)
    requests = turns([conv], count=FourCharacters())
    assert len(requests) == len(conv.messages) // 2 >= SHAREGPT_16.min_turns
    for k, r in enumerate(requests):
        assert r.prompt == conv.messages[: 2 * k + 1]


def test_the_kubeai_deployment_routes_with_every_prefix_policy() -> None:
    from router.policies import make_policy

    dep = load_deployment(name="kubeai-l4-sim")
    for name in ("prefix-hash", "prefix-approx", "prefix-precise", "random-replica"):
        policy = make_policy(dep, name)
        v = ClusterView(tuple(ReplicaState(r.name, r.model, 0, True) for r in dep.replicas))
        assert 0 <= policy.choose(OBS, chat("x", 0, list(range(64))), v) < 8


def test_the_kubeai_experiment_puts_prefix_routing_far_ahead_of_round_robin() -> None:
    """The experiment's own path at a small scale, in virtual time: the calibrated L4 twin, the
    KubeAI benchmark's recipe, counted by the deployment's tokenizer."""
    from experiments.prefix_aware import Scale, counter, run_table, seed_requests

    dep = load_deployment(name="kubeai-l4-sim")
    scale = Scale(conversations=40, prompts=300, requests=1500, runs=((1600, 400.0),))
    requests = seed_requests(counter(dep), scale, seed=0, uneven=False)
    assert all(r.blocks and r.prompt_tokens for r in requests)
    rows = {r["policy"]: r for r in run_table(dep, requests, ["round-robin", "prefix-precise"],
                                              scale, seed=0)}  # fmt: skip
    assert rows["prefix-precise"]["hit_rate"] > rows["round-robin"]["hit_rate"]
    assert rows["prefix-precise"]["mean_ttft_ms"] * 3 < rows["round-robin"]["mean_ttft_ms"]


def test_a_request_admission_refuses_ends_shed_and_its_conversation_goes_on() -> None:
    convs = conversations(SHAREGPT_16, 3, seed=2)
    requests = [replace(r, max_tokens=4) for r in turns(convs)]
    sim = _sim(2)
    refused = {requests[0].request_id}
    done = run_closed_loop(
        sim, lambda r, v: None if r.request_id in refused else 0, requests, 2, ordered=True
    )
    assert len(done) == len(requests)
    assert [f.outcome for f in done if f.request.request_id in refused] == ["shed"]


def test_the_dqn_chooses_the_model_and_prefix_placement_the_replica() -> None:
    from experiments.prefix_aware import run_paper

    rows = run_paper([0], [4.0], ["dqn", "dqn+prefix-precise"], duration=8.0)
    assert [r["policy"] for r in rows] == ["dqn", "dqn+prefix-precise"]
    assert all(r["requests"] > 5 and 0 < r["mean_reward"] <= 1 for r in rows)
    assert rows[1]["hit_rate"] > 0
