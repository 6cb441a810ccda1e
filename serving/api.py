"""The OpenAI-compatible HTTP API: its routes, the responses they send, and its error handlers.
Routes parse, call the gateway, and answer (in the shapes of `serving.render`); nothing more.

It knows the gateway's interface only: not the policy, the engines or the transport underneath.
Its middleware (`serving.middleware`) runs before it, and the request bodies are those of
`serving.protocol`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from serving import outcomes
from serving.engines.base import TokenDelta
from serving.gateway import AUTO, Gateway, GatewayError, Generation
from serving.metrics import Metrics
from serving.middleware import record_of, request_tag
from serving.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from serving.render import Answer, Relay, Shape, error, error_response, served_by
from transport import body_send
from transport.drain import Drain
from transport.http3 import ResponseNotDelivered
from transport.qos import DEADLINE, QosRejected, path_of
from workloads import Message, TokenIds
from workloads import Request as LlmRequest

log = logging.getLogger(__name__)

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


class _Api(FastAPI):
    """FastAPI, offering its server's `send` to the responses that stream, for their bodies to go
    past the middleware (`transport.body_send`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            body_send.offer(scope, send)
        await super().__call__(scope, receive, send)


def create_app(
    gateway: Gateway, lifespan: Lifespan | None = None, drain: Drain | None = None
) -> FastAPI:
    """The API. Every HTTP request must reach it tagged (`transport.qos.TagRequests`). `drain`:
    the server's stop, which /readyz reports (`stopping_drain` makes one that speaks OpenAI)."""
    app = _Api(title="QoS-aware LLM serving", lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        prompt = tuple(m.to_message() for m in body.messages)
        return await _serve(gateway, body, prompt, raw, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        prompts = body.prompts
        if len(prompts) == 1:
            return await _serve(gateway, body, prompts[0], raw, chat=False)
        return await _serve_batch(gateway, body, prompts, raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(time.time())
        cards = [
            {
                "id": AUTO,
                "object": "model",
                "created": created,
                "owned_by": "router",
                "replicas": [r.name for r in gateway.replicas],
            }
        ]
        for model in gateway.deployment.models:
            cards.append(
                {
                    "id": model,
                    "object": "model",
                    "created": created,
                    "owned_by": "serving",
                    "replicas": [r.name for r in gateway.replicas if r.model == model],
                }
            )
        return {"object": "list", "data": cards}

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Liveness: the server answers and at least one replica can take a request."""
        replicas = {r.name: r.engine.healthy() for r in gateway.replicas}
        ok = any(replicas.values())
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "replicas": replicas},
            status_code=200 if ok else 503,
        )

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Readiness: every replica the deployment names is up; else 503, naming those down.
        Replicas on other hosts' engine hosts are the exception: they count only while none
        is up, since one engine host lost must not take every front-end out of its load
        balancer (the router routes around it). While the server stops (draining) 503 too,
        so that a load balancer sends no more."""
        replicas = {r.name: r.engine.healthy() for r in gateway.replicas}
        down = [name for name, up in replicas.items() if not up]
        fleet = {r.name for r in gateway.replicas if r.config.engine_host is not None}
        unready = any(n not in fleet for n in down) or bool(fleet) and fleet <= set(down)
        draining = drain is not None and drain.draining
        status = "draining" if draining else "unready" if unready else "ready"
        return JSONResponse(
            {"status": status, "down": down, "replicas": replicas},
            status_code=503 if unready or draining else 200,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.exposition(), media_type="text/plain; version=0.0.4")

    _install_error_handlers(app, gateway.metrics)
    return app


async def _serve(
    gateway: Gateway,
    body: GenerateRequest,
    prompt: str | TokenIds | tuple[Message, ...],
    raw: Request,
    chat: bool,
) -> Response:
    generation = await _unless_disconnected(
        raw.receive, _start(gateway, body, prompt, raw, chat), abandon=lambda g: g.aclose()
    )
    headers = _headers([generation], raw)
    shape = Shape(generation, chat, body.top_logprobs_asked, body.echoes)
    if body.stream:
        return GenerationStream(generation, shape.sse(body.include_usage, relay=True), headers)
    answer = (await _complete([generation], raw.receive))[0]
    return WholeAnswer([generation], shape.whole(answer), headers)


async def _serve_batch(
    gateway: Gateway, body: CompletionRequest, prompts: list[str | TokenIds], raw: Request
) -> Response:
    """A completion of several prompts: each is a request of its own to the gateway (routed,
    admitted and counted alone, as vLLM's server schedules each alone), answered together as
    one choice per prompt. If any fails, the others are aborted and the error is the answer."""
    starts = [_start(gateway, body, prompt, raw, False, i) for i, prompt in enumerate(prompts)]
    generations = await _unless_disconnected(raw.receive, _all_started(starts))
    shapes = [Shape(g, False, body.top_logprobs_asked, body.echoes) for g in generations]
    answers = await _complete(generations, raw.receive)
    choices = [
        shape.choice(answer, i)
        for i, (shape, answer) in enumerate(zip(shapes, answers, strict=True))
    ]
    return WholeAnswer(
        generations,
        shapes[0].batch(f"cmpl-{request_tag(raw.scope).request_id}", generations, choices),
        _headers(generations, raw),
    )


async def _start(
    gateway: Gateway,
    body: GenerateRequest,
    prompt: str | TokenIds | tuple[Message, ...],
    raw: Request,
    chat: bool,
    index: int | None = None,
) -> Generation:
    """Dispatch one prompt and wait for its first token; `index`: its place in a batch."""
    tag = request_tag(raw.scope)
    if tag.rejected is not None:
        raise tag.rejected
    assert tag.qos_class is not None
    record = record_of(raw.scope)
    if index is not None:
        record = dataclasses.replace(record, request_id=f"{record.request_id}-{index}")
    request = LlmRequest(
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{record.request_id}",
        arrival=tag.arrival,
        prompt=prompt,
        max_tokens=body.max_tokens,
        qos_class=tag.qos_class,
        task=body.task,
        path=path_of(raw.scope),
    )
    deadline = raw.scope["extensions"].get(DEADLINE)
    sampling = body.sampling()
    raw.state.dispatched = True  # the gateway counts it from here, however it ends
    return await gateway.start(
        request, sampling, body.model, record, tag.api_key, deadline, index is None
    )


async def _all_started(starts: Sequence[Awaitable[Generation]]) -> list[Generation]:
    """Every generation started, or none left open: if one fails (or the wait is cancelled),
    the others are cancelled or closed, and the first error raised."""
    tasks = [asyncio.ensure_future(start) for start in starts]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    await task.result().aclose()
        raise


def _headers(generations: list[Generation], raw: Request) -> dict[str, str]:
    model, replica = served_by(generations)
    qos_class = request_tag(raw.scope).qos_class or ""
    return {"x-model": model, "x-replica": replica, "x-qos-class": qos_class}


class GenerationStream(StreamingResponse):
    """Server-sent events for one generation.

    It watches for the client going away while it streams (Starlette, for ASGI 2.4 servers, only
    notices on the next failed write, which can be long while a request waits in a queue), and
    it closes the generation however the stream ends, which frees the replica. The request
    counts as ok only if the whole stream went out: over HTTP/3 the last send returns once the
    client has acknowledged everything, and raises if the stream is reset before.
    """

    def __init__(
        self, generation: Generation, events: AsyncIterator[str | Relay], headers: dict[str, str]
    ):
        # Starlette's iterator is left empty: `_stream` sends `events`, which may hold a Relay.
        super().__init__((), media_type="text/event-stream", headers=headers)
        self.generation = generation
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self._stream(send, body_send.body_send(scope, send))
                    except OSError:
                        pass  # the client is gone; the watcher sees it too
                    else:
                        self.generation.delivered()
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.generation.aclose()

    async def _stream(self, send: Send, body: Send) -> None:
        """Starlette's `stream_response`, but each event goes to `body`, past the five of six
        wrappers that want the response's start only (docs/results/frontend-capacity.md), and
        the plain chunks from the engine's task (`Generation.relay`)."""
        start = {"type": "http.response.start", "status": self.status_code}
        await send(start | {"headers": self.raw_headers})
        async for chunk in self.events:
            if isinstance(chunk, Relay):
                await self.generation.relay(_writer(chunk.render, body))
            else:
                data = chunk.encode()
                await body({"type": "http.response.body", "body": data, "more_body": True})
        await body({"type": "http.response.body", "body": b"", "more_body": False})


def _writer(render: Callable[[str], str], body: Send) -> Callable[[TokenDelta], Awaitable[None]]:
    async def write(delta: TokenDelta) -> None:
        data = render(delta.text).encode()
        await body({"type": "http.response.body", "body": data, "more_body": True})

    return write


class WholeAnswer(JSONResponse):
    """A whole (not streamed) answer: it counts as ok once sent, and closes its generations."""

    def __init__(
        self, generations: list[Generation], content: dict[str, Any], headers: dict[str, str]
    ):
        super().__init__(content, headers=headers)
        self.generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
            for generation in self.generations:
                generation.delivered()
        except OSError:
            pass  # the client is gone: HTTP/3 says so when the answer's last send fails
        finally:
            with anyio.CancelScope(shield=True):
                for generation in self.generations:
                    await generation.aclose()


async def _complete(generations: list[Generation], receive: Receive) -> list[Answer]:
    """The generations' whole outputs, unless the client disconnects or one fails first; then
    every one is aborted. They stay open for `WholeAnswer` to send."""
    answers = [Answer() for _ in generations]

    async def collect(generation: Generation, answer: Answer) -> None:
        async for delta in generation:
            answer.add(delta)

    tasks = [
        asyncio.ensure_future(collect(g, a)) for g, a in zip(generations, answers, strict=True)
    ]
    try:
        await _unless_disconnected(receive, asyncio.gather(*tasks))
    except BaseException:
        with anyio.CancelScope(shield=True):
            for task in tasks:  # the others of a batch, where one failed
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for generation in generations:
                await generation.aclose()
        raise
    return answers


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


T = TypeVar("T")


async def _unless_disconnected(
    receive: Receive, work: Awaitable[T], abandon: Callable[[T], Awaitable[object]] | None = None
) -> T:
    """The result of `work`, unless the client disconnects first: then `work` is cancelled (or,
    if it had just finished, its result handed to `abandon`) and ClientGone raised."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work_task, watch_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch_task):
            task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if watch_task.cancelled():
        return work_task.result()  # the work finished first, or raised: either way, its outcome
    if abandon is not None and not work_task.cancelled() and work_task.exception() is None:
        await abandon(work_task.result())
    raise ClientGone()


def _install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    # GatewayErrors are counted where they happen; these are refused before the gateway sees them.
    @app.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(QosRejected)
    async def qos_rejected(raw: Request, exc: QosRejected) -> JSONResponse:
        metrics.rejected(
            outcomes.INVALID if exc.status == 400 else outcomes.REFUSED, record_of(raw.scope)
        )
        codes = {401: "invalid_api_key", 403: "qos_class_not_granted"}
        return error(exc.status, exc.message, codes.get(exc.status, "invalid_qos_class"))

    @app.exception_handler(RequestValidationError)
    async def invalid(raw: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.rejected(outcomes.INVALID, record_of(raw.scope))
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error(400, f"The body is not valid JSON: {first.get('msg')}.", "invalid_json")
        field = ".".join(loc) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        where = field or "the request body (a JSON object)"
        return error(400, f"{where}: {message}", "invalid_value", field)

    @app.exception_handler(HTTPException)
    async def http_error(raw: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, ValueError | RecursionError):
            # FastAPI's answer to a body json.loads raised on other than a JSONDecodeError: not
            # UTF-8, or nested past its recursion limit. A request all the same: counted. (It
            # answers a body cut short the same way, a ClientDisconnect: that one is a body
            # over the limit, which BodyLimit counted as it refused it, or a client gone.)
            metrics.rejected(outcomes.INVALID, record_of(raw.scope))
            message = "The body is not valid JSON: it must be UTF-8, and not nested that deep."
            return error(400, message, "invalid_json")
        return error(exc.status_code, str(exc.detail), None)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the status is for access logs

    @app.exception_handler(Exception)
    async def unexpected(raw: Request, exc: Exception) -> Response:
        if isinstance(exc, ResponseNotDelivered):
            # The client left (or its stream passed its deadline) while an answer was going
            # out, one written outside the routes, such as the door's 429: nothing went wrong
            # here. Under overload this came by the hundred, each with a traceback.
            log.info("answer not delivered: %s", exc)
            return Response(status_code=499)
        log.exception("unexpected error")
        # An API request the gateway never took is counted here; one it took, it counted.
        if raw.url.path.startswith("/v1/") and not getattr(raw.state, "dispatched", False):
            metrics.rejected(outcomes.INTERNAL, record_of(raw.scope))
        return error(500, "Internal server error; see the server log.", "internal_error")
