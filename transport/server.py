"""Serve one ASGI app over HTTP/3 (UDP) and HTTP/1.1 (TCP, uvicorn) at once; or, with
`Listen.tls`, HTTP/1.1 and HTTP/2 over TLS on the TCP side (hypercorn), with the QUIC certificate.

The app's lifespan runs once, here, not once per server. HTTP/1.1 answers carry `Alt-Svc` so that
clients that can, move to HTTP/3 (RFC 7838). The HTTP/3 server tags each request at its HEADERS
(`Http3Settings.tag`); the HTTP/1.1 server stamps when it began to read one, for the app's
`transport.qos.TagRequests` to tag it with.

A stop signal (SIGTERM, SIGINT) stops it gracefully (`DualServer.stop_gracefully`,
`transport.drain`): new requests are refused (HTTP/1.1: 503 and `Connection: close`; HTTP/3:
GOAWAY, then H3_REQUEST_REJECTED), those in flight get `Listen.drain_s` to finish, the rest are
cut, and then the servers close and the app's lifespan ends (its engines stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import hypercorn.asyncio
import hypercorn.config
import uvicorn
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.protocol.h2 import H2Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from transport.drain import Drain, Draining
from transport.http3 import ASGIApp, Http3Server, Http3Settings, Lifespan
from transport.qos import ARRIVAL, PATH
from transport.tcpinfo import tcp_path

logger = logging.getLogger(__name__)


def alt_svc_value(h3_port: int, max_age: int = 86400) -> str:
    """The `alt-svc` header that points HTTP/1.1 and HTTP/2 clients at the HTTP/3 port."""
    return f'h3=":{h3_port}"; ma={max_age}'


class AltSvc:
    """Adds `alt-svc: h3=":PORT"` to every answer not already sent over HTTP/3 (hypercorn's,
    with TLS; uvicorn adds it as a default header)."""

    def __init__(self, app: ASGIApp, h3_port: int) -> None:
        self.app = app
        self.value = alt_svc_value(h3_port).encode()

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
        # Ours hold plain values (a time, a path), where uvicorn's scope type wants dicts.
        extensions: dict[str, Any] = {ARRIVAL: time.monotonic()}
        self.scope["extensions"] = extensions
        path = tcp_path(self.transport.get_extra_info("socket"))
        if path is not None:
            extensions[PATH] = path


class _UvicornWithoutSignals(uvicorn.Server):
    """Leaves signals to `DualServer` (see where it starts uvicorn)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


_TLS_GRACE_S = 5.0
"""How long hypercorn lets its connections finish once told to stop."""
_TLS_CLOSE_S = 1.0
"""How long a client may take to answer TLS's close_notify when the server stops."""

_TLS_CONNECTIONS: dict[tuple[Any, Any], asyncio.StreamWriter] = {}
"""hypercorn's connections, by (client address, server address) as its scopes name them, until
they are closed (its `run` awaits the close, TLS's close_notify included): for `TlsPath`, since
hypercorn hands an app no way to the socket its request came on, and for the stop to cut."""


def _register_tls_connections() -> None:
    """Keep each hypercorn connection in `_TLS_CONNECTIONS` until it is closed, for `TlsPath` to
    read the kernel's measurement of the client's path from its socket, and for the server's
    stop to cut (`_cut_tls_connections`)."""
    run = TCPServer.run
    if getattr(run, "registers", False):
        return

    async def registering(self: TCPServer) -> None:
        sock = self.writer.get_extra_info("socket")
        try:
            key = (sock.getpeername()[:2], sock.getsockname()[:2])
        except OSError:  # gone before it was served
            await run(self)
            return
        _TLS_CONNECTIONS[key] = self.writer
        try:
            await run(self)
        finally:
            _TLS_CONNECTIONS.pop(key, None)

    registering.registers = True  # type: ignore[attr-defined]
    TCPServer.run = registering  # type: ignore[method-assign]


def _cut_tls_connections() -> None:
    """Close every TLS connection still open at once, without TLS's closing handshake.

    hypercorn closes a connection with a close_notify and waits for the client's, for as long
    as asyncio's ssl_shutdown_timeout (30 s; hypercorn sets none): a client that keeps an idle
    connection and does not answer held the server's exit for 30 s, which then logged a
    traceback ('SSL shutdown timed out'). Browsers and pooling clients do keep such connections."""
    for writer in list(_TLS_CONNECTIONS.values()):
        writer.transport.abort()


class TlsPath:
    """ASGI middleware for the TLS server: the client's path (`qos.PATH`) from `TCP_INFO` of the
    connection's socket, as the HTTP/1.1 server's protocol stamps it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("client") and scope.get("server"):
            writer = _TLS_CONNECTIONS.get((tuple(scope["client"]), tuple(scope["server"])))
            path = tcp_path(writer.get_extra_info("socket") if writer is not None else None)
            if path is not None:
                scope.setdefault("extensions", {})[PATH] = path
        await self.app(scope, receive, send)


@dataclass
class Listen:
    host: str = "127.0.0.1"
    tcp_port: int | None = 8000
    """None: no HTTP/1.1."""
    udp_port: int | None = 8443
    """None: no HTTP/3."""
    drain_s: float = 30.0
    """After a stop signal, how long requests in flight may go on before they are cut."""
    tls: bool = False
    """TCP: HTTP/1.1 and HTTP/2 over TLS (hypercorn), with HTTP/3's certificate, instead of
    plain HTTP/1.1 (uvicorn). Browsers honour `Alt-Svc: h3` only from an HTTPS origin."""
    tcp_socket: socket.socket | None = None
    """A listening socket already bound to `tcp_port`, to serve on instead of binding one: a
    worker's, handed down by its supervisor (`transport.workers`)."""
    udp_socket: socket.socket | None = None
    """Likewise for HTTP/3, bound to `udp_port`."""
    ready_fd: int | None = None
    """A pipe to the supervisor: one byte once the servers listen, and closed."""


class WithoutLifespan:
    """Hides the app's lifespan from a server that would run it again (hypercorn always does):
    `DualServer` runs it once for both servers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return


def _tolerate_data_after_the_response() -> None:
    """hypercorn 0.18 takes a whole HTTP/2 connection down (a KeyError, every stream on it cut)
    when DATA arrives for a stream it has closed: that is every request whose answer comes before
    its body has all arrived, such as a 413 for a body past the limit. Until its fix is released
    (pgjones/hypercorn#334), such DATA is acknowledged, so the connection's flow-control window is
    not lost, and dropped, as that fix does; and the stream is reset with NO_ERROR, so that the
    client stops its upload."""
    handle_events = H2Protocol._handle_events
    if getattr(handle_events, "tolerant", False):
        return

    async def tolerant(self: H2Protocol, events: list[h2.events.Event]) -> None:
        for event in events:  # one at a time: a stream may close between two of them
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self.connection.acknowledge_received_data(
                    event.flow_controlled_length, event.stream_id
                )
                # The answer is whole, so the rest of the body can stop (RFC 9113 8.1); it would
                # wait for stream credit that a closed stream never gives.
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
                await self._flush()
            else:
                await handle_events(self, [event])

    tolerant.tolerant = True  # type: ignore[attr-defined]
    H2Protocol._handle_events = tolerant  # type: ignore[method-assign]


class DualServer:
    """Start with `async with DualServer(...)`; `ports` holds what was bound (port 0 picks one)."""

    def __init__(
        self,
        app: ASGIApp,
        listen: Listen,
        h3: Http3Settings,
        log_level: str = "info",
        access_log: bool = True,
        drain: Drain | None = None,
    ) -> None:
        """`drain`: the stop state whose `Draining` gate the app has installed itself, where it
        wants it; None wraps the app in a gate of its own, with a plain-text refusal."""
        if drain is None:
            drain = Drain()
            app = Draining(app, drain)
        self.drain = drain
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
        self._hypercorn_stop = asyncio.Event()
        self._hypercorn_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> DualServer:
        await self._lifespan.startup()
        try:
            if self.listen.udp_port is not None:
                self._h3 = Http3Server(self.app, self.h3_settings, self.drain)
                await self._h3.start(self.listen.host, self.listen.udp_port, self.listen.udp_socket)
                self.udp_port = self._h3.port
            if self.listen.tcp_port is not None and self.listen.tls:
                await self._start_tls()
            elif self.listen.tcp_port is not None:
                await self._start_tcp()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start_tcp(self) -> None:
        # uvicorn adds its default headers to every response itself: `AltSvc`'s wrapper of the
        # app's sends would be one more call on every token of a stream.
        alt_svc = [("alt-svc", alt_svc_value(self.udp_port))] if self.udp_port is not None else []
        config = uvicorn.Config(
            self.app,
            headers=alt_svc,
            host=self.listen.host,
            port=self.listen.tcp_port or 0,
            lifespan="off",
            log_level=self.log_level,
            access_log=self.access_log,
            # Idle keep-alive connections stay open longer than any client keeps one in its pool
            # (aiohttp's TCPConnector: 15 s, its default keepalive_timeout; httpx, and so the
            # openai client: 5 s, Limits.keepalive_expiry) and than the proxies that may pool
            # them in front (nginx's upstream keepalive_timeout and an AWS ALB's idle timeout:
            # 60 s; AWS asks targets for more), so that the client always closes first. With
            # uvicorn's default, 5 s, the server closes connections aiohttp still pools: a
            # request sent on one as it closes fails (ServerDisconnectedError; a POST is not
            # retried). An idle connection costs a file descriptor and a few KiB, nothing more
            # (limit_concurrency is off, below).
            timeout_keep_alive=75,
            # Connections the kernel has accepted while the loop is busy (uvicorn's default,
            # named for the record; Linux caps it at net.core.somaxconn, 4096 since 5.4). It only
            # matters for new connections: clients reuse theirs (aiohttp opens at most 100 per
            # host, the openai client up to 1000). A burst past it loses SYNs, which clients
            # resend after 1 s (TCP's initial RTO): rather queue them here, where the app
            # answers at once, and under overload with a counted 429 (admission control).
            backlog=2048,
            # None: uvicorn's limit answers a bare text 503 from its own app, before ours, so such
            # refusals would miss the request log and metrics, carry no x-request-id and no
            # OpenAI error body; and it counts idle keep-alive connections as busy. Load is
            # bounded where it is counted: admission control (429 overloaded), per-key limits
            # (429 rate_limit_exceeded), and HTTP/3's per-connection stream limit.
            limit_concurrency=None,
            # Requests in flight had their drain time (`stop_gracefully`) before uvicorn is told
            # to stop; this bounds only what came after: a probe admitted while draining, a
            # response still being written. Past it, uvicorn cancels the task and closes the
            # connection.
            timeout_graceful_shutdown=5,
            http=ArrivalStampingProtocol,
        )
        # Signals are ours (serve_forever), not uvicorn's. uvicorn 0.54 takes SIGINT and SIGTERM
        # for the whole of serve() (capture_signals: signal.signal, which asyncio's wakeup fd
        # does not prevent from reaching our handler too): it would stop accepting at the first
        # signal, close connections after its own timeout, and raise the signal again when done,
        # cutting the drain short. (Its install_signal_handlers, overridden here before, is gone.)
        self._uvicorn = _UvicornWithoutSignals(config)
        sockets = [self.listen.tcp_socket] if self.listen.tcp_socket is not None else None
        self._uvicorn_task = asyncio.create_task(self._uvicorn.serve(sockets))
        while not self._uvicorn.started:
            if self._uvicorn_task.done():
                self._uvicorn_task.result()
                raise RuntimeError(f"HTTP/1.1 server did not start on port {config.port}")
            await asyncio.sleep(0.01)
        self.tcp_port = self._uvicorn.servers[0].sockets[0].getsockname()[1]

    async def _start_tls(self) -> None:
        _tolerate_data_after_the_response()
        _register_tls_connections()
        app = AltSvc(self.app, self.udp_port) if self.udp_port is not None else self.app
        app = TlsPath(app)
        # Bound here, not by hypercorn, so that port 0 can be read back; hypercorn owns it then.
        listener = self.listen.tcp_socket or socket.create_server(
            (self.listen.host, self.listen.tcp_port or 0), backlog=2048
        )
        self.tcp_port = listener.getsockname()[1]
        config = hypercorn.config.Config()
        config.bind = [f"fd://{listener.detach()}"]
        config.certfile, config.keyfile = self.h3_settings.certfile, self.h3_settings.keyfile
        config.alpn_protocols = ["h2", "http/1.1"]
        config.keep_alive_timeout = 75  # as uvicorn's, above
        # hypercorn closes a connection after 1,000 requests (an HTTP/2 GOAWAY), and httpx, for
        # one, then fails every request it had queued for that connection: one client's
        # connection would lose requests at 48 req/s after 21 s. uvicorn has no such limit.
        config.keep_alive_max_requests = sys.maxsize
        config.graceful_timeout = _TLS_GRACE_S
        config.loglevel = self.log_level.upper()
        config.accesslog = logging.getLogger("hypercorn.access") if self.access_log else None
        self._hypercorn_task = asyncio.create_task(
            hypercorn.asyncio.serve(
                WithoutLifespan(app), config, shutdown_trigger=self._hypercorn_stop.wait
            )
        )
        await asyncio.sleep(0)
        if self._hypercorn_task.done():
            self._hypercorn_task.result()

    async def stop_gracefully(self, drain_s: float, hurry: asyncio.Event | None = None) -> None:
        """Refuse new requests (HTTP/3: GOAWAY first), give those in flight `drain_s` to finish
        (or until `hurry` is set), then cut the rest. The servers still run after it."""
        self.drain.start()
        if self._h3 is not None:
            self._h3.goaway()
        logger.info(
            "stopping: refusing new requests, %d in flight may finish within %g s",
            self.drain.in_flight,
            drain_s,
        )
        waits = [asyncio.ensure_future(self.drain.wait(drain_s))]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        if self.drain.in_flight:
            cut = await self.drain.cut()
            logger.warning("stopping: cut %d request(s) still in flight", cut)
        else:
            logger.info("stopping: every request in flight finished")

    async def __aexit__(self, *exc_info: object) -> None:
        if self._h3 is not None:
            self._h3.close()
        if self._uvicorn is not None and self._uvicorn_task is not None:
            self._uvicorn.should_exit = True
            with contextlib.suppress(Exception):
                await self._uvicorn_task
        if self._hypercorn_task is not None:
            self._hypercorn_stop.set()
            # The drain is over: every request has ended. hypercorn closes each connection with
            # TLS's close_notify and waits for the client's; a second is enough for a client
            # that answers, and the rest are cut (before hypercorn's own grace ends: a
            # connection it has cancelled by then no longer yields to the cut).
            await asyncio.wait([self._hypercorn_task], timeout=_TLS_CLOSE_S)
            _cut_tls_connections()
            with contextlib.suppress(Exception):
                await self._hypercorn_task
        await self._lifespan.shutdown()


async def serve_forever(
    server: DualServer, on_ready: Callable[[DualServer], Awaitable[None] | None] | None = None
) -> None:
    """Run until SIGINT or SIGTERM, then stop gracefully: drain for `server.listen.drain_s`
    (a second signal cuts the drain short), close, and end the app's lifespan."""
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        (hurry if stop.is_set() else stop).set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    async with server:
        if server.listen.ready_fd is not None:
            tell_ready(server.listen.ready_fd)
        if on_ready is not None:
            ready = on_ready(server)
            if ready is not None:
                await ready
        await stop.wait()
        await server.stop_gracefully(server.listen.drain_s, hurry)
        logger.info("shutting down")


def tell_ready(fd: int) -> None:
    """Tell the supervisor at the other end of `fd` that this worker serves (`transport.workers`:
    it stops standing in for the worker then)."""
    with contextlib.suppress(OSError):  # a supervisor that is gone has no use for it
        os.write(fd, b"1")
    with contextlib.suppress(OSError):
        os.close(fd)
