"""Graceful stop: refuse new requests, let those in flight finish for a while, then cut the rest.

A `Drain` is one stop's state, shared by the servers and by the `Draining` gate in the app. On a
stop signal the servers `start` it (and over HTTP/3 send GOAWAY); from then on the gate answers
every new request with a 503 and `Connection: close`, and lets the requests already in flight
finish. At the end of the drain time the servers `cut` what is still running: the gate tells the
app its client is gone (`http.disconnect`), so that the app stops the work and accounts for it,
and ends the response so that its client sees an error, never a silent truncation.

The gate knows nothing of what requests mean: the app says what a refusal and the end of a cut
response look like, and how to count them (`Drain`'s callables).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transport import body_send

logger = logging.getLogger(__name__)

Scope = dict[str, Any]


class StreamCut(ConnectionResetError):
    """Raised to the app's `send()` once its request is cut (the client is gone, as far as the
    app is concerned, and nothing it sends counts as delivered); raised to the server when a
    started response has no tail to end it with, so that the server cuts its stream."""


def _plain_refusal(scope: Scope) -> tuple[bytes, bytes]:
    return b"text/plain; charset=utf-8", b"The server is shutting down.\n"


@dataclass
class Drain:
    refusal: Callable[[Scope], tuple[bytes, bytes]] = _plain_refusal
    """The content type and body of the 503 that refuses a request while draining."""
    cut_tail: Callable[[Scope, bytes], bytes | None] = lambda scope, content_type: None
    """The last bytes of a started response cut at the end of the drain, given its content
    type (an error event, for an event stream); None: the server cuts the stream itself (an
    HTTP/1.1 connection closed mid-body, an HTTP/3 stream reset), which a client also sees."""
    on_refuse: Callable[[Scope], None] = lambda scope: None
    """Called for each request refused while draining, by the gate or by HTTP/3 after GOAWAY."""
    on_cut: Callable[[Scope], None] = lambda scope: None
    """Called for each request cut at the end of the drain, before the app hears of it."""
    admit: Callable[[Scope], bool] = lambda scope: False
    """Requests served as usual while draining (a readiness probe that says so, metrics)."""
    draining: bool = False
    _in_flight: set[_Admitted] = field(default_factory=set)
    _idle: asyncio.Event | None = None

    def start(self) -> None:
        """From now on, refuse new requests."""
        self.draining = True

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def wait(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most `timeout_s`; True if none is left."""
        if not self._in_flight:
            return True
        self._idle = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        return not self._in_flight

    async def cut(self, grace_s: float = 5.0) -> int:
        """Cut every request still in flight; wait at most `grace_s` for the app to end them.
        Returns how many were cut."""
        cut = [admitted for admitted in self._in_flight if not admitted.cut]
        for admitted in cut:
            self.on_cut(admitted.scope)
            admitted.interrupt()
        if cut:
            await self.wait(grace_s)
        return len(cut)

    async def refuse(self, scope: Scope, send: Any) -> None:
        """Answer 503 with the refusal body (and close an HTTP/1.x connection after it)."""
        content_type, body = self.refusal(scope)
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        if scope.get("http_version") != "3":  # HTTP/3 forbids connection-specific fields
            headers.append((b"connection", b"close"))
        with contextlib.suppress(OSError):  # the client left first: nobody to tell
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})

    def _enter(self, scope: Scope) -> _Admitted:
        admitted = _Admitted(scope)
        self._in_flight.add(admitted)
        return admitted

    def _leave(self, admitted: _Admitted) -> None:
        self._in_flight.discard(admitted)
        if not self._in_flight and self._idle is not None:
            self._idle.set()


@dataclass(eq=False)  # hashed by identity
class _Admitted:
    """A request the gate let in."""

    scope: Scope
    cut: bool = False
    started: bool = False
    finished: bool = False
    content_type: bytes = b""
    receiving: set[asyncio.Task[Any]] = field(default_factory=set)
    """The tasks of the app waiting in the server's receive() now."""
    interrupted: set[asyncio.Task[Any]] = field(default_factory=set)

    def interrupt(self) -> None:
        """Cut: a receive() waiting now returns http.disconnect, as a later one will.

        It is cancelled where it waits, in the server's receive(), which loses nothing (a queue's
        get, an event's wait), and the gate turns that into the disconnect. Racing each
        receive() against the cut in a task of its own would cost every request a few loop
        iterations, enough to lose races the servers have with their clients."""
        self.cut = True
        for task in self.receiving:
            self.interrupted.add(task)
            task.cancel()


class Draining:
    """ASGI middleware: the gate of a `Drain`. Outside it, nothing is refused or cut."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        drain = self.drain
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if drain.draining and not drain.admit(scope):
            drain.on_refuse(scope)
            await drain.refuse(scope, send)
            return
        admitted = drain._enter(scope)

        async def gated_receive() -> dict[str, Any]:
            if admitted.cut:
                return {"type": "http.disconnect"}
            task = asyncio.current_task()
            assert task is not None
            admitted.receiving.add(task)
            try:
                return await receive()
            except asyncio.CancelledError:
                if task not in admitted.interrupted:
                    raise
                admitted.interrupted.discard(task)
                if task.uncancel() > 0:  # cancelled by someone else as well
                    raise
                return {"type": "http.disconnect"}
            finally:
                admitted.receiving.discard(task)

        def started(message: dict[str, Any]) -> dict[str, Any]:
            admitted.started = True
            headers = list(message.get("headers", []))
            admitted.content_type = next(
                (v for k, v in headers if k.lower() == b"content-type"), b""
            )
            if drain.draining and scope.get("http_version") != "3":
                # The connection will not outlive the drain: let its client know not to send
                # another request on it.
                return {**message, "headers": [*headers, (b"connection", b"close")]}
            return message

        def gate(onward: Any) -> Any:
            async def gated(message: dict[str, Any]) -> None:
                if admitted.cut:
                    raise StreamCut("the server is stopping")
                if message["type"] == "http.response.start":
                    message = started(message)
                elif message["type"] == "http.response.body" and not message.get("more_body"):
                    admitted.finished = True
                await onward(message)

            return gated

        gated_send = gate(send)
        # The same gate for a body sent past the app's middleware (`transport.body_send`).
        if (outer_body := body_send.offered(scope)) is not None:
            body_send.replace(scope, gate(outer_body))

        try:
            try:
                await self.app(scope, gated_receive, gated_send)
            except Exception:
                if not admitted.cut:
                    raise
                # What the app does after its client is gone is its business: a cut request
                # ends as the gate ends it, below.
            if admitted.cut and not admitted.finished:
                await self._end_cut(admitted, send)
        finally:
            drain._leave(admitted)

    async def _end_cut(self, admitted: _Admitted, send: Any) -> None:
        if not admitted.started:
            await self.drain.refuse(admitted.scope, send)
            return
        tail = self.drain.cut_tail(admitted.scope, admitted.content_type)
        if tail is None:
            raise StreamCut("response cut: the server stopped before it ended")
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": tail, "more_body": False})
