"""Simulated engines: the Engine contract kept without a model, the simulator's batching in real
time, failure injection only where a deployment names it, and a live server that serves the
paper's twelve replicas on this machine."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import yaml

from config import ConfigError, Deployment, load_deployment, resolve
from config.deployment import Simulation
from config.schema import Faults, ModelsFile
from router.admission import AdmitAll, Shed
from router.policies import make_policy
from router.view import ClusterView
from serving.engines.base import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
)
from serving.engines.prompts import _INLINE_TOKENIZE_CHARS, output_budget
from serving.engines.simulated import SimulatedCluster, SimulatedEngine
from serving.gateway import MAX_RETRIES, EngineFailed, Gateway, Overloaded
from serving.metrics import Metrics
from serving.outcomes import RequestRecord
from serving.replicas import Backoff, Replica, ReplicaSet, Supervisor
from tests.support.servers import ROOT, Server, wait_until
from workloads import Message, Request

HELLO = (Message("user", "Hello there"),)
EXACT = Sampling(ignore_eos=True)


def request(rid: str, max_tokens: int | None = 8, prompt: str | tuple = HELLO) -> Request:
    return Request(rid, 0.0, prompt, max_tokens, "free-tier", "copa")


def deployment(faults: Faults | None = None, name: str = "embedded-sim"):  # noqa: ANN201
    dep = load_deployment(ROOT / "models.yaml", name)
    if faults is not None:
        assert dep.simulation is not None
        dep = dataclasses.replace(
            dep, simulation=dataclasses.replace(dep.simulation, faults=faults)
        )
    return dep


@pytest.fixture
async def engine() -> AsyncIterator[SimulatedEngine]:
    engine = SimulatedCluster(deployment()).engine(deployment().replicas[0])
    await engine.start()
    yield engine
    await engine.close()


async def collect(engine: SimulatedEngine, req: Request, sampling: Sampling) -> list[TokenDelta]:
    return [d async for d in engine.generate(req, sampling)]


async def test_max_tokens_are_generated_one_per_step(engine: SimulatedEngine) -> None:
    deltas = await collect(engine, request("a", 7), EXACT)
    assert sum(d.tokens for d in deltas) == 7
    assert [d.finish_reason for d in deltas][-1] == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    text = "".join(d.text for d in deltas)
    assert len(text.split()) == 7  # one word per token
    assert engine.unfinished() == 0


async def test_the_text_is_the_seeds(engine: SimulatedEngine) -> None:
    def text(deltas: list[TokenDelta]) -> str:
        return "".join(d.text for d in deltas)

    first = await collect(engine, request("a", 12), Sampling(ignore_eos=True, seed=1))
    again = await collect(engine, request("b", 12), Sampling(ignore_eos=True, seed=1))
    other = await collect(engine, request("c", 12), Sampling(ignore_eos=True, seed=2))
    assert text(first) == text(again) != text(other)


async def test_without_ignore_eos_a_request_may_end_early(engine: SimulatedEngine) -> None:
    deltas = await collect(engine, request("a", 2000), Sampling(seed=0))
    assert deltas[-1].finish_reason == "stop"
    assert sum(d.tokens for d in deltas) < 2000


async def test_min_tokens_ends_the_twins_answer_there(engine: SimulatedEngine) -> None:
    # A replay of recorded answers sends each one's length as min_tokens (workloads.replay).
    deltas = await collect(engine, request("a", None), Sampling(seed=0, min_tokens=37))
    assert sum(d.tokens for d in deltas) == 37 and deltas[-1].finish_reason == "stop"
    capped = await collect(engine, request("b", 20), Sampling(seed=0, min_tokens=37))
    assert sum(d.tokens for d in capped) == 20 and capped[-1].finish_reason == "length"
    from workloads.replay import request_body

    drawn = dataclasses.replace(request("c", 64), answer_tokens=30)
    assert request_body(drawn, "auto", ignore_eos=False)["min_tokens"] == 30
    assert "min_tokens" not in request_body(drawn, "auto", ignore_eos=True)
    assert "min_tokens" not in request_body(request("d", 64), "auto", ignore_eos=False)


async def test_a_stop_string_ends_the_text_before_it(engine: SimulatedEngine) -> None:
    whole = "".join(
        d.text for d in await collect(engine, request("a", 30), Sampling(seed=5, ignore_eos=True))
    )
    stop = whole.split()[3]  # the fourth word: it comes up within the first four tokens
    deltas = await collect(
        engine, request("b", 30), Sampling(seed=5, ignore_eos=True, stop=(stop,))
    )
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finish_reason == "stop"
    assert stop not in text and whole.startswith(text)
    assert engine.unfinished() == 0


async def test_a_prompt_longer_than_the_context_gets_vllms_400(engine: SimulatedEngine) -> None:
    long = request("a", 10, prompt=" ".join(["the"] * 3000))
    with pytest.raises(InvalidRequest) as refused:
        await collect(engine, long, EXACT)
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.message.startswith("This model's maximum context length is 2048 tokens")
    too_much = request("b", 2048)
    with pytest.raises(InvalidRequest, match="However, you requested"):
        await collect(engine, too_much, EXACT)
    assert engine.unfinished() == 0


async def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenised(
    engine: SimulatedEngine,
) -> None:
    hostile = request("huge", 10, prompt="a" * 3_000_000)  # under the 4 MB body limit
    with pytest.raises(InvalidRequest, match="3000000 characters") as refused:
        await collect(engine, hostile, EXACT)
    assert refused.value.code == "context_length_exceeded"
    assert engine.unfinished() == 0


def test_the_400_is_the_same_for_every_engine_kind() -> None:
    with pytest.raises(InvalidRequest) as refused:
        output_budget(request("a", 100), 2000, 2048)
    assert refused.value.param == "max_tokens"
    assert "(2000 in the prompt, 100 in the completion)" in refused.value.message


async def test_closing_the_stream_frees_the_slot(engine: SimulatedEngine) -> None:
    stream = engine.generate(request("a", 500), EXACT)
    await anext(stream)
    assert engine.unfinished() == 1
    await stream.aclose()
    assert engine.unfinished() == 0


async def test_batch_cap_queues_the_rest() -> None:
    dep = deployment()
    replica = dataclasses.replace(
        dep.replicas[0], engine_args={**dep.replicas[0].engine_args, "max_num_seqs": 2}
    )
    engine = SimulatedCluster(dep).engine(replica)
    await engine.start()
    try:
        streams = [engine.generate(request(f"r{i}", 50), EXACT) for i in range(3)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.wait(firsts[:2])
        # The first two run; the third waits for a slot and has no token yet.
        assert not firsts[2].done()
        assert engine._batch.in_flight == 3 and len(engine._batch.running) == 2
        await streams[0].aclose()
        await firsts[2]  # a slot freed: it is admitted
        for s in streams[1:]:
            await s.aclose()
        assert engine.unfinished() == 0
    finally:
        await engine.close()


async def test_injected_errors_fail_requests_part_way() -> None:
    dep = deployment(Faults(error_rate=1.0))
    engine = SimulatedCluster(dep).engine(dep.replicas[0])
    await engine.start()
    try:
        for i in range(3):
            with pytest.raises(EngineError, match="simulated failure"):
                await collect(engine, request(f"r{i}", 20), EXACT)
        assert engine.unfinished() == 0
    finally:
        await engine.close()


async def test_faults_name_their_replicas() -> None:
    dep = deployment(Faults(error_rate=1.0, replicas=["cpu/tiny-m"]))
    cluster = SimulatedCluster(dep)
    spared, failing = cluster.engine(dep.replicas[0]), cluster.engine(dep.replicas[1])
    await spared.start()
    await failing.start()
    try:
        assert sum(d.tokens for d in await collect(spared, request("a", 5), EXACT)) == 5
        with pytest.raises(EngineError):
            await collect(failing, request("b", 5), EXACT)
    finally:
        await spared.close()
        await failing.close()


async def test_an_engine_that_dies_ends_its_requests_and_comes_back() -> None:
    dep = deployment(Faults(fail_after_s=0.5, restart_s=0.1))
    replica = Replica(dep.replicas[0], SimulatedCluster(dep).engine(dep.replicas[0]))
    await replica.engine.start()
    supervisor = asyncio.create_task(Supervisor(replica, Backoff(first_s=0.05), poll_s=0.02).run())
    try:
        with pytest.raises(EngineError, match="died"):
            await collect(replica.engine, request("a", 1000), EXACT)
        await asyncio.wait_for(_until(lambda: replica.restarts > 0), 4)
        assert replica.restarts == 1 and replica.engine.healthy()
        deltas = await collect(replica.engine, request("b", 3), EXACT)
        assert sum(d.tokens for d in deltas) == 3
    finally:
        supervisor.cancel()
        await replica.engine.close()


async def test_a_reused_request_id_gets_only_its_own_tokens(engine: SimulatedEngine) -> None:
    # A client may choose its request's id: one aborted mid-iteration frees the id, and the next
    # request with it must not take the token the iteration made for the first.
    first = engine.generate(request("same", 500), EXACT)
    await anext(first)
    await first.aclose()  # between iterations' ends: the running iteration still holds its job
    deltas = await collect(engine, request("same", 3), EXACT)
    assert sum(d.tokens for d in deltas) == 3
    assert deltas[-1].finish_reason == "length"


async def test_a_request_that_reaches_a_dead_engine_is_refused_not_held(
    engine: SimulatedEngine,
) -> None:
    # Long enough to be tokenised in a thread: the engine dies while it is.
    late = request("late", 5, prompt="hi " * (_INLINE_TOKENIZE_CHARS // 3 + 1))
    pending = asyncio.ensure_future(anext(engine.generate(late, EXACT)))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    engine._die()
    assert not engine.healthy()
    with pytest.raises(EngineUnavailable):
        await asyncio.wait_for(pending, 5)


def spec_with(**deployment: object) -> dict:
    spec = yaml.safe_load((ROOT / "models.yaml").read_text())
    spec["deployments"]["twin"] = {"placement": "paper-4gpu", **deployment}
    return spec


def test_faults_are_refused_outside_a_simulated_deployment() -> None:
    spec = spec_with(profile="seed-calibrated", simulation={"faults": {"error_rate": 0.5}})
    with pytest.raises(ValueError, match="only a deployment with engine: simulated takes it"):
        ModelsFile.model_validate(spec)


def test_a_simulated_deployment_needs_a_profile_and_known_replicas() -> None:
    with pytest.raises(ValueError, match="needs a latency profile"):
        ModelsFile.model_validate(spec_with(engine="simulated"))
    spec = ModelsFile.model_validate(spec_with(
        engine="simulated", profile="seed-calibrated",
        simulation={"faults": {"replicas": ["cuda:9/opt-125m"], "error_rate": 1.0}},
    ))  # fmt: skip
    with pytest.raises(ConfigError, match="unknown cuda:9/opt-125m"):
        resolve(spec, "twin", ROOT)
    with pytest.raises(ValueError, match="no step times for opt-1.3b, opt-125m, opt-6.7b"):
        ModelsFile.model_validate(spec_with(engine="simulated", profile="embedded-measured"))


def test_time_scale_scales_the_profile_for_everyone() -> None:
    spec = ModelsFile.model_validate(spec_with(
        engine="simulated", profile="seed-calibrated", simulation={"time_scale": 0.01}
    ))  # fmt: skip
    twin = resolve(spec, "twin", ROOT)
    assert twin.simulation is not None and twin.profile is not None
    original = spec.profiles["seed-calibrated"].models["opt-6.7b"]
    scaled = twin.profile.models["opt-6.7b"]
    assert scaled.step_s[1] == pytest.approx(original.step_s[1] * 0.01)
    assert scaled.prefill_s_per_token == pytest.approx(original.prefill_s_per_token * 0.01)
    assert isinstance(twin.simulation, Simulation)


def test_the_paper_deployment_serves_live(paper_twin: Server) -> None:
    ready = httpx.get(f"{paper_twin.url}/readyz").json()
    assert len(ready["replicas"]) == 12 and all(ready["replicas"].values()), ready
    body = {"model": "auto", "task": "copa", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 6, "ignore_eos": True}  # fmt: skip
    answer = httpx.post(f"{paper_twin.url}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert reply["model"] in {"opt-125m", "opt-1.3b", "opt-6.7b"}
    assert reply["usage"]["completion_tokens"] == 6
    assert answer.headers["x-replica"].endswith(reply["model"])
    labels = {"qos_class": answer.headers["x-qos-class"], "model": reply["model"], "outcome": "ok"}
    wait_until(lambda: paper_twin.metric("serving_requests_total", **labels) >= 1)


def test_the_servers_time_scale_applies_on_top_of_the_files() -> None:
    twin = load_deployment(name="paper-4gpu-sim")
    faster = twin.with_time_scale(0.001)
    assert twin.profile is not None and faster.profile is not None
    before, after = twin.profile.models["opt-6.7b"], faster.profile.models["opt-6.7b"]
    assert after.step_s[1] == pytest.approx(before.step_s[1] * 0.001)
    assert faster.simulation is not None and faster.simulation.time_scale == pytest.approx(0.001)
    with pytest.raises(ConfigError, match="needs engine: simulated"):
        load_deployment(name="paper-4gpu").with_time_scale(0.001)
    with pytest.raises(ConfigError, match="above 0"):
        twin.with_time_scale(0)
    with pytest.raises(ConfigError, match="above 0"):
        twin.with_time_scale(float("nan"))
    # On a file that already scales its times (0.01), the two factors multiply.
    spec = ModelsFile.model_validate(spec_with(
        engine="simulated", profile="seed-calibrated", simulation={"time_scale": 0.01}
    ))  # fmt: skip
    both = resolve(spec, "twin", ROOT).with_time_scale(0.1)
    assert both.simulation is not None and both.simulation.time_scale == pytest.approx(0.001)
    original = spec.profiles["seed-calibrated"].models["opt-6.7b"]
    assert both.profile is not None
    assert both.profile.models["opt-6.7b"].step_s[1] == pytest.approx(original.step_s[1] * 0.001)


async def test_a_reader_that_stalls_holds_its_replica_no_longer_than_the_engine() -> None:
    # A client that died mid-stream stops reading; its response is held until the connection
    # times out, but the replica is free, for the router and admission control, once the
    # engine has generated the last token.
    twin = deployment().with_time_scale(0.01)
    replicas = ReplicaSet.from_deployment(twin)
    await replicas.start()
    try:
        gateway = Gateway(twin, replicas, make_policy(twin, "least-load"), Metrics(replicas))
        stalled = dataclasses.replace(request("stalled", 32), arrival=time.monotonic())
        generation = await gateway.start(stalled, EXACT)
        replica = generation.replica
        assert replica.running == 1
        await asyncio.wait_for(_until(lambda: replica.engine.unfinished() == 0), 30)
        await asyncio.wait_for(_until(lambda: replica.running == 0), 5)
        assert replica.owed == 0
        await generation.aclose()  # the connection times out: counted, and nothing goes negative
        assert (replica.running, replica.owed) == (0, 0)
        count = gateway.metrics.requests.labels("free-tier", replica.model, "cancelled")
        assert count._value.get() == 1
    finally:
        await replicas.close()


@asynccontextmanager
async def twin_failing(
    faults: Faults, name: str = "embedded-sim"
) -> AsyncIterator[tuple[Deployment, ReplicaSet]]:
    """The twin `name` with `faults`, at a hundredth of its profile's step times, its engines
    started until the block ends."""
    twin = deployment(faults, name).with_time_scale(0.01)
    replicas = ReplicaSet.from_deployment(twin)
    await replicas.start()
    try:
        yield twin, replicas
    finally:
        await replicas.close()


def first_fails() -> Faults:
    """Replica 0 fails every request at its first token (one token asked for); the others none."""
    return Faults(error_rate=1.0, replicas=[deployment().replicas[0].name])


class First:
    """A policy that always picks replica 0, so that a test knows where a request goes first."""

    def choose(self, obs, request, view):  # type: ignore[no-untyped-def]
        return 0


async def test_a_replica_that_fails_before_the_first_token_is_left_for_another() -> None:
    # Replica 0 fails every request at its first token: nothing has reached the client, so the
    # request is routed again, without 0, and answered whole by the other.
    async with twin_failing(first_fails()) as (twin, replicas):
        failing = twin.replicas[0].name
        gateway = Gateway(twin, replicas, First(), Metrics(replicas))
        asked = dataclasses.replace(request("again", 1), arrival=time.monotonic())
        record = RequestRecord(asked.request_id, asked.qos_class, asked.arrival)
        generation = await gateway.start(asked, EXACT, record=record)
        deltas = [d async for d in generation]
        generation.delivered()
        await generation.aclose()
        assert generation.replica.name != failing
        assert sum(d.tokens for d in deltas) == 1 and deltas[-1].finish_reason == "length"
        assert record.retries == [{"replica": failing, "reason": "engine_error"}]
        assert gateway.metrics.retries.labels("engine_error")._value.get() == 1
        served = gateway.metrics.requests.labels("free-tier", generation.model, "ok")
        assert served._value.get() == 1
        assert all((r.running, r.owed) == (0, 0) for r in replicas)


class SheddingAfterTheFirst(AdmitAll):
    """Admission control that lets the first request's first routing in, and sheds after."""

    def __init__(self) -> None:
        self.checks = 0

    def check(self, request: Request, view: ClusterView, now: float) -> ClusterView | Shed:
        self.checks += 1
        return view if self.checks == 1 else Shed(estimate_s=9.0, budget_s=1.0)


async def test_a_request_sent_on_after_its_replica_failed_it_is_not_shed() -> None:
    # It was let in once: its second routing is not refused for the wait its first one cost.
    async with twin_failing(first_fails()) as (twin, replicas):
        failing = twin.replicas[0].name
        admission = SheddingAfterTheFirst()
        gateway = Gateway(twin, replicas, First(), Metrics(replicas), admission=admission)
        asked = dataclasses.replace(request("again", 1), arrival=time.monotonic())
        generation = await gateway.start(asked, EXACT)
        assert [d.finish_reason async for d in generation][-1] == "length"
        await generation.aclose()
        assert admission.checks == 2 and generation.replica.name != failing
        with pytest.raises(Overloaded):  # a new request is shed, as admission control says
            await gateway.start(dataclasses.replace(asked, request_id="new"), EXACT)


async def test_a_request_every_replica_fails_is_retried_twice_then_ends_in_the_last_error() -> None:
    async with twin_failing(Faults(error_rate=1.0), "paper-4gpu-sim") as (twin, replicas):
        gateway = Gateway(twin, replicas, First(), Metrics(replicas))
        asked = dataclasses.replace(request("doomed", 1), arrival=time.monotonic())
        record = RequestRecord(asked.request_id, asked.qos_class, asked.arrival)
        with pytest.raises(EngineFailed, match="simulated failure"):
            await gateway.start(asked, EXACT, record=record)
        assert [r["reason"] for r in record.retries] == ["engine_error"] * MAX_RETRIES
        assert len({r["replica"] for r in record.retries} | {record.replica}) == 3
        failed = gateway.metrics.requests.labels("free-tier", record.model, "engine_error")
        assert failed._value.get() == 1
        assert all((r.running, r.owed) == (0, 0) for r in replicas)


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def test_the_twin_counts_tokens_as_the_engines_tokenizer_does() -> None:
    # The twin loads the embedded tokenizer without transformers' AutoTokenizer (which imports
    # torch); what it counts must not change.
    from transformers import AutoTokenizer

    from serving.embedded import ensure_built
    from serving.engines.prompts import load_tokenizer

    tiny = load_deployment(name="embedded-sim").replicas[0]
    assert tiny.build is not None
    ensure_built(tiny.source, tiny.build)
    light, auto = load_tokenizer(tiny.source), AutoTokenizer.from_pretrained(tiny.source)
    assert type(light) is type(auto)
    chat = [{"role": "user", "content": "Héllo, wörld! 123"}, {"role": "assistant", "content": "x"}]
    template = load_deployment(name="embedded-sim").replicas[0].fallback_chat_template
    for text in ("", "The cat sat on the mat", "Héllo, wörld! 123 \n\t  spaces"):
        assert light.encode(text) == auto.encode(text)
        assert light.encode(text, add_special_tokens=False) == auto.encode(
            text, add_special_tokens=False
        )
    rendered = [
        t.apply_chat_template(chat, chat_template=template, add_generation_prompt=True,
                              tokenize=False)
        for t in (light, auto)
    ]  # fmt: skip
    assert rendered[0] == rendered[1]
    assert len(light) == len(auto) and light.get_vocab() == auto.get_vocab()


async def test_the_gateway_counts_a_prompt_once_before_it_routes() -> None:
    """Admission control, the router and a prefix index see the prompt's real token count and
    block hashes; the twin takes them as they are; a prompt no context could hold is a 400."""
    from router.prefix import PrefixAffinity, PrefixIndex
    from serving.engines.prompts import gateway_counter
    from serving.gateway import BadRequest

    twin = deployment().with_time_scale(0.01)
    replicas = ReplicaSet.from_deployment(twin)
    await replicas.start()
    seen: list[Request] = []
    affinity = PrefixAffinity(PrefixIndex(len(twin.replicas)), precise=False)

    class Watching:
        def choose(self, obs, request, view):  # type: ignore[no-untyped-def]
            seen.append(request)
            return affinity.choose(obs, request, view)

    try:
        gateway = Gateway(twin, replicas, Watching(), Metrics(replicas))
        gateway.counter = gateway_counter(twin)
        assert gateway.counter is not None
        long = "Tell me about the river. " * 80  # 2,000 characters
        asked = dataclasses.replace(request("long", 4, long), arrival=time.monotonic())
        generation = await gateway.start(asked, EXACT)
        async for _ in generation:
            pass
        await generation.aclose()
        (routed,) = seen
        ids = gateway.counter.prompts.encode(asked)
        assert routed.prompt_tokens == len(ids) > 100
        assert routed.blocks is not None and len(routed.blocks) == len(ids) // 128
        assert generation.prompt_tokens == len(ids), "the twin took the gateway's count"
        assert len(affinity.index) == len(routed.blocks)
        huge = dataclasses.replace(request("huge", 4, "x" * 10_000_000), arrival=time.monotonic())
        with pytest.raises(BadRequest, match="maximum context length"):
            await gateway.start(huge, EXACT)
        assert len(seen) == 1, "refused before routing"
    finally:
        await replicas.close()


async def test_the_twins_kv_events_build_exactly_the_index_its_engines_hold() -> None:
    from router.prefix import PrefixAffinity, PrefixIndex
    from serving.engines.prompts import gateway_counter

    twin = deployment().with_time_scale(0.01)
    replicas = ReplicaSet.from_deployment(twin)
    index = PrefixIndex(len(twin.replicas))
    policy = PrefixAffinity(index, precise=True)
    for i, replica in enumerate(replicas):
        replica.engine.publish_kv_events(functools.partial(policy.event, i))  # type: ignore[attr-defined]
    await replicas.start()
    try:
        gateway = Gateway(twin, replicas, policy, Metrics(replicas))
        gateway.counter = gateway_counter(twin)
        history = "Tell me about the river and the stone. " * 40
        for turn in range(6):
            prompt = (Message("user", history), Message("user", f"and then, part {turn}?"))
            asked = dataclasses.replace(request(f"t{turn}", 4, prompt), arrival=time.monotonic())
            generation = await gateway.start(asked, EXACT)
            async for _ in generation:
                pass
            await generation.aclose()
        held = [replica.engine._batch.kv.hashes() for replica in replicas]  # type: ignore[attr-defined]
        assert sum(map(len, held)) > 0
        for i, blocks in enumerate(held):
            assert index.held_by(i) == blocks
        # Every turn shares the history: after the first, each went where it was cached.
        assert sum(1 for blocks in held if blocks) == 1
        # An engine that dies loses its cache, and the index hears it.
        home = next(i for i, blocks in enumerate(held) if blocks)
        replicas[home].engine._die()  # type: ignore[attr-defined]
        assert index.held_by(home) == set() == replicas[home].engine._batch.kv.hashes()  # type: ignore[attr-defined]
    finally:
        await replicas.close()


async def test_a_live_request_reads_as_the_simulator_reads_it() -> None:
    """The gateway's features of a request equal the simulator's (`router.route.Observer`, what
    the training environment shows its agent) for the same request: its counted prompt, the
    default max_tokens of a request that sets none, and the output the predictor expects, once
    taught the same served answer."""
    from router.admission import AdmitAll
    from router.features import FeatureEncoder
    from router.route import Observer
    from router.sim import OK, Finished
    from router.view import ClusterView
    from serving.engines.prompts import gateway_counter

    twin = deployment().with_time_scale(0.01)
    replicas = ReplicaSet.from_deployment(twin)
    await replicas.start()
    encoder = FeatureEncoder.for_deployment(twin)
    live: list[tuple[object, Request]] = []

    class Watching:
        def __init__(self) -> None:
            self.encoder = encoder

        def choose(self, obs, request, view):  # type: ignore[no-untyped-def]
            live.append((obs.copy(), request))
            return 0

    try:
        gateway = Gateway(twin, replicas, Watching(), Metrics(replicas), admission=AdmitAll())
        gateway.counter = gateway_counter(twin)
        assert gateway.counter is not None
        sim = Observer(twin, encoder, AdmitAll())
        text = "Tell me about the river and the stone. " * 40
        start, served = time.monotonic(), 0
        for k in range(2):  # the second after the first was served, and taught
            asked = dataclasses.replace(request(f"r{k}", None, text), arrival=start + k)
            generation = await gateway.start(asked, Sampling(seed=k))
            async for _ in generation:
                pass
            generation.delivered()
            await generation.aclose()
            obs, routed = live[-1]
            counted = await gateway.counter.count(asked, twin.max_model_len)
            assert routed.prompt_tokens == counted.prompt_tokens > 300
            idle = ClusterView(tuple(r._replace(running=0, owed=0)
                                     for r in replicas.view(None).replicas))  # fmt: skip
            seen = sim.observe(counted, idle)
            assert not isinstance(seen, Exception) and isinstance(seen, tuple)
            assert list(seen[0]) == list(obs)  # type: ignore[call-overload]
            lengths = seen[0][encoder.lengths_at : encoder.lengths_at + 3] * 512
            assert lengths[1] == twin.max_model_len - counted.prompt_tokens, "vLLM's default"
            expected = 256 if k == 0 else min(served, lengths[1])  # the prior, then the taught
            assert lengths[2] == pytest.approx(expected, rel=1e-5)
            served = generation.completion_tokens
            sim.served([Finished(counted, 0, "tiny-s", 0, 0, 1, served, True, OK)])
    finally:
        await replicas.close()
