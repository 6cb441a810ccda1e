"""Serve one ASGI app over HTTP/3 (UDP) and HTTP/1.1 (TCP, uvicorn) at once.

The app's lifespan runs once, here, not once per server. HTTP/1.1 answers carry `Alt-Svc` so that
clients that can, move to HTTP/3 (RFC 7838). The HTTP/3 server tags each request at its HEADERS
(`Http3Settings.tag`); the HTTP/1.1 server stamps when it began to read one, for the app's
`transport.qos.TagRequests` to tag it with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from transport.http3 import ASGIApp, Http3Server, Http3Settings, Lifespan
from transport.qos import ARRIVAL

logger = logging.getLogger(__name__)


class AltSvc:
    """Adds `alt-svc: h3=":PORT"` to every answer not already sent over HTTP/3."""

    def __init__(self, app: ASGIApp, h3_port: int, max_age: int = 86400) -> None:
        self.app = app
        self.value = f'h3=":{h3_port}"; ma={max_age}'.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("http_version") == "3":
            await self.app(scope, receive, send)
            return

        async def send_with_alt_svc(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"alt-svc", self.value)],
                }
            await send(message)

        await self.app(scope, receive, send_with_alt_svc)


class ArrivalStampingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, stamping each request with the time its first bytes were
    parsed: the earliest this server can know of it. The app sees the request later, after the
    headers and whatever else the event loop had to do first."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {ARRIVAL: time.monotonic()}


@dataclass
class Listen:
    host: str = "127.0.0.1"
    tcp_port: int | None = 8000
    """None: no HTTP/1.1."""
    udp_port: int | None = 8443
    """None: no HTTP/3."""


class DualServer:
    """Start with `async with DualServer(...)`; `ports` holds what was bound (port 0 picks one)."""

    def __init__(
        self,
        app: ASGIApp,
        listen: Listen,
        h3: Http3Settings,
        log_level: str = "info",
        access_log: bool = True,
    ) -> None:
        self.app = app
        self.listen = listen
        self.h3_settings = h3
        self.log_level = log_level
        self.access_log = access_log
        self.tcp_port: int | None = None
        self.udp_port: int | None = None
        self._lifespan = Lifespan(app)
        self._h3: Http3Server | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._uvicorn_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DualServer:
        await self._lifespan.startup()
        try:
            if self.listen.udp_port is not None:
                self._h3 = Http3Server(self.app, self.h3_settings)
                await self._h3.start(self.listen.host, self.listen.udp_port)
                self.udp_port = self._h3.port
            if self.listen.tcp_port is not None:
                await self._start_tcp()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start_tcp(self) -> None:
        app = AltSvc(self.app, self.udp_port) if self.udp_port is not None else self.app
        config = uvicorn.Config(
            app,
            host=self.listen.host,
            port=self.listen.tcp_port or 0,
            lifespan="off",
            log_level=self.log_level,
            access_log=self.access_log,
            timeout_graceful_shutdown=5,
            http=ArrivalStampingProtocol,
        )
        self._uvicorn = uvicorn.Server(config)
        # Signals are ours (serve_forever), not uvicorn's.
        self._uvicorn.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._uvicorn_task = asyncio.create_task(self._uvicorn.serve())
        while not self._uvicorn.started:
            if self._uvicorn_task.done():
                self._uvicorn_task.result()
                raise RuntimeError(f"HTTP/1.1 server did not start on port {config.port}")
            await asyncio.sleep(0.01)
        self.tcp_port = self._uvicorn.servers[0].sockets[0].getsockname()[1]

    async def __aexit__(self, *exc_info: object) -> None:
        if self._h3 is not None:
            self._h3.close()
        if self._uvicorn is not None and self._uvicorn_task is not None:
            self._uvicorn.should_exit = True
            with contextlib.suppress(Exception):
                await self._uvicorn_task
        await self._lifespan.shutdown()


async def serve_forever(
    server: DualServer, on_ready: Callable[[DualServer], Awaitable[None] | None] | None = None
) -> None:
    """Run until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        if on_ready is not None:
            ready = on_ready(server)
            if ready is not None:
                await ready
        await stop.wait()
        logger.info("shutting down")
