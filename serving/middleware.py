"""The API's ASGI middleware and the server's stop in OpenAI's shapes: admission control at the
door (`ShedAtTheDoor`), the drain's refusals and cut streams (`stopping_drain`), and the request's
account as the transport tagged it (`record_of`)."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Message as AsgiMessage
from starlette.types import Receive, Scope, Send

from serving import outcomes
from serving.gateway import AUTO, Gateway
from serving.metrics import Metrics
from serving.outcomes import RequestRecord
from serving.protocol import asked_for
from serving.render import error_body, error_response, event
from transport.drain import Drain
from transport.qos import RequestTag, path_of, tag_of

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})
"""Served as usual while the server stops: they start no work, and /readyz says it is stopping."""


def stopping_drain(metrics: Metrics) -> Drain:
    """The server's stop (`transport.drain`) in OpenAI's shapes, counted in `metrics`: a request
    refused while draining gets a 503 with code `shutting_down` and counts as draining; an event
    stream cut at the end of the drain ends with an error event and [DONE], as a stream whose
    engine fails does, and counts as stopped."""
    message = "The server is shutting down and takes no new requests; retry elsewhere."
    refusal = json.dumps(error_body(503, message, "shutting_down")).encode()
    cut = event(
        error_body(503, "The server stopped before this response was complete.", "shutting_down")
    )
    tail = f"{cut}data: [DONE]\n\n".encode()

    def on_refuse(scope: Scope) -> None:
        if tag_of(scope) is not None:  # every request is tagged before the gate (build_app)
            metrics.rejected(outcomes.DRAINING, record_of(scope))

    def on_cut(scope: Scope) -> None:
        tag = tag_of(scope)
        if tag is not None:
            metrics.cut(tag.request_id)

    return Drain(
        refusal=lambda scope: (b"application/json", refusal),
        cut_tail=lambda scope, content_type: (
            tail if content_type.startswith(b"text/event-stream") else None
        ),
        on_refuse=on_refuse,
        on_cut=on_cut,
        admit=lambda scope: scope["method"] in ("GET", "HEAD") and scope["path"] in PROBES,
    )


GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class ShedAtTheDoor:
    """ASGI middleware: a request for generation that admission control would shed is answered
    429 `overloaded` before the API's handler parses it (`Gateway.turn_away`). It reads the
    body (already capped by `BodyLimit`) and hands it on to the app unchanged."""

    def __init__(self, app: Any, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tag = tag_of(scope)
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATION_PATHS
            or tag is None
            or tag.qos_class is None
        ):
            await self.app(scope, receive, send)
            return
        body, ended = b"", False
        while not ended:
            message = await receive()
            if message["type"] != "http.request":  # gone before the body came
                await self.app(scope, _replay(message, receive), send)
                return
            body += message.get("body", b"")
            ended = not message.get("more_body", False)
        try:
            model, max_tokens = asked_for(json.loads(body))
        # Not JSON, not UTF-8, or nested past the parser's recursion limit: the handler says
        # so (400).
        except (ValueError, RecursionError):
            model, max_tokens = AUTO, None
        overloaded = self.gateway.turn_away(record_of(scope), model, max_tokens)
        if overloaded is not None:
            await error_response(overloaded)(scope, receive, send)
            return
        whole = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replay(whole, receive), send)


def _replay(first: AsgiMessage, receive: Receive) -> Receive:
    """`receive`, giving `first` before anything else."""
    pending = [first]

    async def replayed() -> AsgiMessage:
        return pending.pop() if pending else await receive()

    return replayed


def record_of(scope: Scope) -> RequestRecord:
    """A request's account as it reached the app: its tag, and the protocol it came over."""
    tag = request_tag(scope)
    path = path_of(scope)
    return RequestRecord(
        tag.request_id,
        tag.qos_class,
        tag.arrival,
        tier=tag.tier,
        via_edge=tag.via_edge,
        protocol=scope.get("http_version"),
        client_rtt_s=None if path is None else round(path.rtt_s, 6),
        client_loss=None if path is None else round(path.loss, 6),
    )


def request_tag(scope: Scope) -> RequestTag:
    tag = tag_of(scope)
    assert tag is not None, "TagRequests tags every HTTP request"
    return tag
