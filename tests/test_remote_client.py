"""RemoteEngine's upstream leg against an in-process upstream that sends exactly the bytes each
test needs: vLLM's chunk layout, split anywhere, errors before and after the stream begins, a
connection dropped mid-stream. The same engine against a real `vllm serve` is
tests/test_remote.py's; through the whole server against the null upstream,
tests/test_upstream.py's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from config.deployment import ReplicaConfig
from serving.engines.base import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
)
from serving.engines.remote import RemoteEngine, WrongModel
from workloads import Message, Request, TokenIds

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DIED = b'data: {"error": {"message": "engine died"}}\n\n'


def chunk(text: str, completion: int, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    usage = {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion}
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "up",
               "choices": [choice], "usage": usage}  # fmt: skip
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def answer(words: list[str], finish: str = "length") -> bytes:
    last = len(words) - 1
    body = b"".join(chunk(w, i + 1, finish if i == last else None) for i, w in enumerate(words))
    return body + b"data: [DONE]\n\n"


class Upstream:
    """An aiohttp server whose chat answer is `respond`; it records what it saw."""

    def __init__(
        self, respond: Handler, models: tuple[str, ...] = ("up",), read_timeout_s: float = 5.0
    ) -> None:
        self.respond = respond
        self.read_timeout_s = read_timeout_s
        self.models = models
        self.bodies: list[dict[str, Any]] = []
        self.peers: list[Any] = []
        self.disconnected = asyncio.Event()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": m} for m in self.models]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json() | {"path": request.path})
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername"))
        try:
            return await self.respond(request)
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise

    async def __aenter__(self) -> RemoteEngine:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.engine = RemoteEngine(replica(f"http://127.0.0.1:{port}/v1"), self.read_timeout_s)
        try:
            await self.engine.start()
        except BaseException:
            await self.__aexit__()
            raise
        return self.engine

    async def __aexit__(self, *exc_info: object) -> None:
        await self.engine.close()
        await self.runner.cleanup()


def replica(url: str) -> ReplicaConfig:
    return ReplicaConfig(
        name="remote/up", model="up", source="up", device=None, url=url, served_name="up",
        memory_fraction=None, kv_cache_gib=None, cpu_cores=None, engine_args={},
        chat_template=None, fallback_chat_template=None, build=None,
    )  # fmt: skip


def chat(max_tokens: int = 8, request_id: str = "r1") -> Request:
    return Request(request_id, 0.0, (Message("user", "hi"),), max_tokens, "free-tier")


def sends(*pieces: bytes, status: int = 200, pause: float = 0.0) -> Handler:
    """A handler that writes `pieces` one write each, `pause` apart."""

    async def respond(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=status, headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            await asyncio.sleep(pause)
        await response.write_eof()
        return response

    return respond


async def collect(engine: RemoteEngine, request: Request, **sampling: Any) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(request, Sampling(**sampling))]


async def test_a_stream_arrives_exact_however_its_bytes_are_split() -> None:
    words = [" Hello", " wörld", ",", " ünïcode ✓", "!"]
    body = answer(words)
    for size in (len(body), 7, 1):  # whole, odd pieces, a byte at a time
        pieces = [body[i : i + size] for i in range(0, len(body), size)]
        async with Upstream(sends(*pieces)) as engine:
            deltas = await collect(engine, chat())
        assert "".join(d.text for d in deltas) == "".join(words), size
        assert [d.tokens for d in deltas] == [1] * len(words)
        assert deltas[-1].finish_reason == "length" and deltas[0].prompt_tokens == 3


async def test_the_request_is_vllms_with_continuous_usage_and_our_request_id() -> None:
    upstream = Upstream(sends(answer([" a"])))
    async with upstream as engine:
        await collect(engine, chat(request_id="abc"), temperature=0.5, stop=("x",))
        prompt = Request("p", 0.0, TokenIds((1, 2, 3)), 4, "free-tier")
        await collect(engine, prompt)
    first, second = upstream.bodies
    assert first["path"] == "/v1/chat/completions"
    assert first["messages"] == [{"role": "user", "content": "hi"}]
    assert first["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (first["model"], first["temperature"], first["stop"]) == ("up", 0.5, ["x"])
    assert second["path"] == "/v1/completions" and second["prompt"] == [1, 2, 3]


async def test_requests_in_turn_share_one_pooled_connection() -> None:
    # The stream's end comes a moment after [DONE], as over a network: the client must read to
    # it, not stop at [DONE] and cut the connection.
    upstream = Upstream(sends(chunk(" a", 1, "length"), b"data: [DONE]\n\n", pause=0.02))
    async with upstream as engine:
        for i in range(3):
            await collect(engine, chat(request_id=str(i)))
    assert len(set(upstream.peers)) == 1, upstream.peers


async def test_vllms_unfinished_reasons_reach_the_gateway_as_they_are() -> None:
    # The gateway turns 'abort' and 'error' into an engine error (serving.engines.base.UNFINISHED).
    async with Upstream(sends(answer([" a", " b"], finish="abort"))) as engine:
        deltas = await collect(engine, chat())
    assert deltas[-1].finish_reason == "abort"


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(chunk(" a", 1) + DIED, id="error-event"),
        pytest.param(chunk(" a", 1) + b"data: [DONE]\n\n", id="ended-unfinished"),
        pytest.param(chunk(" a", 1) + b"data: {not json\n\n", id="not-json"),
    ],
)  # fmt: skip
async def test_a_stream_that_goes_wrong_after_it_began_is_an_engine_error(body: bytes) -> None:
    async with Upstream(sends(body)) as engine:
        with pytest.raises(EngineError) as caught:
            await collect(engine, chat())
    assert not isinstance(caught.value, EngineUnavailable)
    if b"engine died" in body:
        assert "engine died" in str(caught.value)


def one_chunk_then(then: Callable[[web.Request], Awaitable[None]]) -> Handler:
    """A handler that sends one chunk, then does `then`: cuts the connection, or goes silent."""

    async def respond(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk(" a", 1))
        await then(request)
        return response

    return respond


async def cut(request: web.Request) -> None:
    await asyncio.sleep(0.05)
    assert request.transport is not None
    request.transport.abort()  # no terminating chunk: the stream is cut


async def go_silent(request: web.Request) -> None:
    await asyncio.sleep(30)


async def test_a_connection_dropped_mid_stream_is_an_engine_error_and_marks_it_down() -> None:
    async with Upstream(one_chunk_then(cut)) as engine:
        received: list[TokenDelta] = []
        with pytest.raises(EngineError, match="lost"):
            async for delta in engine.generate(chat(), Sampling()):
                received.append(delta)
        assert [d.text for d in received] == [" a"]
        assert not engine.healthy()


async def test_a_stream_that_goes_silent_is_cut_after_the_read_timeout() -> None:
    async with Upstream(one_chunk_then(go_silent), read_timeout_s=0.2) as engine:
        with pytest.raises(EngineError, match="in time"):
            await asyncio.wait_for(collect(engine, chat()), 5)
        assert engine.healthy()  # one silent stream is not the server gone


async def test_refusals_before_the_stream_keep_their_meaning() -> None:
    bad = {"error": {"message": "max_tokens is too large", "param": "max_tokens", "code": 400}}

    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.json_response(bad, status=400)

    async with Upstream(refuse) as engine:
        with pytest.raises(InvalidRequest) as caught:
            await collect(engine, chat())
    assert (caught.value.message, caught.value.param) == ("max_tokens is too large", "max_tokens")

    async def busy(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "draining"}}, status=503)

    async with Upstream(busy) as engine:
        with pytest.raises(EngineUnavailable, match="draining"):
            await collect(engine, chat())


@pytest.mark.parametrize("asked", [{"logprobs": 2}, {"echo": True}])
async def test_logprobs_and_echo_are_refused_saying_so(asked: dict[str, Any]) -> None:
    upstream = Upstream(sends(answer([" a"])))
    async with upstream as engine:
        with pytest.raises(InvalidRequest, match="does not relay logprobs or echo") as caught:
            await collect(engine, chat(), **asked)
    assert caught.value.param == next(iter(asked))
    assert upstream.bodies == []  # never sent


async def test_a_client_that_leaves_aborts_the_upstream_request() -> None:
    pieces = [chunk(f" w{i}", i + 1) for i in range(200)]
    upstream = Upstream(sends(*pieces, pause=0.01))
    async with upstream as engine:
        first = asyncio.Event()

        async def pump() -> None:  # as the gateway reads an engine, in a task it cancels
            async for _ in engine.generate(chat(200), Sampling()):
                first.set()

        task = asyncio.create_task(pump())
        await first.wait()
        task.cancel()
        await asyncio.wait_for(upstream.disconnected.wait(), 5)
        assert engine.unfinished() == 0 and engine.healthy()


async def test_abort_ends_the_stream_without_marking_the_upstream_down() -> None:
    upstream = Upstream(sends(*[chunk(f" w{i}", i + 1) for i in range(200)], pause=0.01))
    async with upstream as engine:
        deltas: AsyncIterator[TokenDelta] = engine.generate(chat(200), Sampling())
        await anext(deltas)
        await engine.abort("r1")
        with pytest.raises(EngineError, match="aborted"):
            async for _ in deltas:
                pass
        await asyncio.wait_for(upstream.disconnected.wait(), 5)
        assert engine.unfinished() == 0 and engine.healthy()


async def test_an_upstream_serving_another_model_is_a_configuration_error() -> None:
    with pytest.raises(WrongModel, match="set served_name"):
        async with Upstream(sends(answer([" a"])), models=("other",)):
            pass


def usage_chunk(cached: int) -> bytes:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    payload = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "up",
               "choices": [], "usage": usage}  # fmt: skip
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def test_the_last_delta_carries_the_cached_tokens_of_the_usage_chunk_after_it() -> None:
    body = chunk(" a", 1) + chunk(" b", 2, "length") + usage_chunk(2) + b"data: [DONE]\n\n"
    async with Upstream(sends(body)) as engine:
        deltas = await collect(engine, chat())
    assert [(d.text, d.finish_reason, d.cached_tokens) for d in deltas] == [
        (" a", None, None), (" b", "length", 2)
    ]  # fmt: skip


async def test_an_answer_whose_connection_breaks_after_its_end_is_whole() -> None:
    """Cut after the finish chunk, before the usage chunk and [DONE]: the answer was complete."""

    async def finish_then_cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk(" a", 1) + chunk(" b", 2, "length"))
        await cut(request)
        return response

    async with Upstream(finish_then_cut) as engine:
        deltas = await collect(engine, chat())
    assert [(d.text, d.finish_reason, d.cached_tokens) for d in deltas] == [
        (" a", None, None), (" b", "length", None)
    ]  # fmt: skip
