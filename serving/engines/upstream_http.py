"""The upstream leg's HTTP/1.1 client: a streaming POST on a pooled keep-alive connection, its
server-sent events' data handed over as the bytes arrive.

aiohttp did this (and still does the rest of a remote engine's HTTP: its probe and its load
scrape). Per token it fed the bytes through its stream reader, woke the reading task through
it, and split the events in an async generator above that: a third of the upstream leg's CPU
(`python -m benchmarks.engine_paths --paths leg-shipped,leg-raw`). Here httptools (the parser
uvicorn uses) parses the response in the connection's own `data_received`, which splits the
events there and wakes the reader once for all that one read brought.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

CONNECT_S = 5.0
"""Seconds to open a connection to the upstream."""

_PAUSE_EVENTS = 256
"""Events read but not yet taken at which the connection stops reading (a reader held up by
its client), resumed once the reader has taken them all."""


class UpstreamClosed(ConnectionError):
    """The connection ended before the response did, or the response could not be parsed."""


class _NeverTaken(UpstreamClosed):
    """The connection ended before any of the response came."""


class UpstreamResponse:
    """One response on one connection: its status once the head has come, then its body, as
    the data of its server-sent events (`events`) or whole (`body`)."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.complete = False
        """The whole response has come: its connection may carry the next request."""
        self.began = False
        """A byte of the response has come."""
        self._keep_alive = False
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._data: deque[bytes] = deque()
        self._rest = b""
        self._body = bytearray()
        self._waiter: asyncio.Future[None] | None = None
        self._error: Exception | None = None

    # httptools' callbacks, from the connection's data_received.

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self._body += body
            return
        events = (self._rest + body).split(b"\n\n")
        self._rest = events.pop()
        for event in events:
            for line in event.splitlines():
                if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
                    self._data.append(data)
        if len(self._data) > _PAUSE_EVENTS:
            self._connection.pause()
        self._wake()

    def on_message_complete(self) -> None:
        # Asked here: httptools answers for the message being parsed, and none is after this.
        self._keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._wake()

    def fail(self, error: Exception) -> None:
        """The connection ended or broke before the response did."""
        if self.complete or self._error is not None:
            return
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a reader that gave up waiting leaves it unread
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _more(self) -> None:
        self._connection.resume()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # The reader's side.

    async def head(self) -> None:
        await self._head

    async def events(self) -> AsyncIterator[bytes]:
        """The data of each event but `[DONE]`, to the response's end. Raises UpstreamClosed
        if the connection ends first."""
        data = self._data
        while True:
            while data:
                yield data.popleft()
            if self._error is not None:
                raise self._error
            if self.complete:
                return
            await self._more()

    async def body(self) -> bytes:
        """The whole body of a response that is not a stream of events (an error's)."""
        while not self.complete:
            if self._error is not None:
                raise self._error
            await self._more()
        return bytes(self._body)

    def release(self) -> None:
        """Done with it: its connection goes back to the pool if the response came whole and the
        upstream keeps the connection open, else it is closed (vLLM aborts a request whose
        connection closes)."""
        self._connection.done(self.complete and self._keep_alive)

    def close(self) -> None:
        """Cut the response short: the connection is closed, and its reader raises
        UpstreamClosed."""
        self.fail(UpstreamClosed("the response was cut short here"))
        self._connection.done(False)


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.idle_since = 0.0
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports have asyncio.Transport's methods but not
        # its class (`--loop uvloop`).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes nobody asked for: the connection's state is unknown
            self._close()
            return
        response.began = True
        try:
            response.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response.fail(UpstreamClosed(f"a response that is not HTTP/1.1: {exc}"))
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.forget(self)
        if self.response is not None:
            self.response.fail(UpstreamClosed(f"the upstream closed the connection ({exc})"))

    def usable(self, now: float) -> bool:
        transport = self.transport
        return (
            transport is not None
            and not transport.is_closing()
            and now - self.idle_since < self.pool.keepalive_s
        )

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def done(self, reusable: bool) -> None:
        self.response = None
        if reusable and self.transport is not None and not self.transport.is_closing():
            self.resume()
            self.idle_since = time.monotonic()
            self.pool.idle.append(self)
        else:
            self._close()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class UpstreamPool:
    """Keep-alive connections to one origin (`http://host:port` or https), one request at a
    time on each. A connection idle for `keepalive_s` is not used again: it should be under the
    upstream's own keep-alive timeout, so that no request goes out on one it is closing."""

    def __init__(self, url: str, keepalive_s: float) -> None:
        origin = urlsplit(url)
        self.host = origin.hostname or "127.0.0.1"
        secure = origin.scheme == "https"
        self.port = origin.port or (443 if secure else 80)
        self.ssl = ssl.create_default_context() if secure else None
        self.keepalive_s = keepalive_s
        self.idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._host_header = origin.netloc.encode()
        self._closed = False

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """Send the request; return once the response's head has come. Raises OSError where it
        could not be sent or no head came (UpstreamClosed: the connection ended first). A
        pooled connection that ends before any of the response came is replaced once by a new
        one: the upstream closed it as it went out, and so never took the request."""
        head = b"".join(
            [b"POST ", path.encode(), b" HTTP/1.1\r\nhost: ", self._host_header,
             b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n",
             *(f"{name}: {value}\r\n".encode() for name, value in headers.items()), b"\r\n"]
        )  # fmt: skip
        connection = self._pooled()
        if connection is not None:
            try:
                return await self._send(connection, head + body)
            except _NeverTaken:  # sent again on a new connection, unless `close` cut it
                pass
        return await self._send(await self._connect(), head + body)

    def _pooled(self) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()
            if connection.usable(now):
                return connection
            connection.done(False)
        return None

    async def _connect(self) -> _Connection:
        if self._closed:
            raise UpstreamClosed("the connection pool is closed")
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_S):
            _, connection = await loop.create_connection(
                lambda: _Connection(self), self.host, self.port, ssl=self.ssl
            )
        self._all.add(connection)
        return connection

    async def _send(self, connection: _Connection, request: bytes) -> UpstreamResponse:
        response = connection.response = UpstreamResponse(connection)
        assert connection.transport is not None
        connection.transport.write(request)
        try:
            await response.head()
        except UpstreamClosed as exc:
            response.close()
            if response.began:
                raise
            raise _NeverTaken(str(exc)) from exc
        except BaseException:
            response.close()
            raise
        return response

    def forget(self, connection: _Connection) -> None:
        self._all.discard(connection)
        if connection in self.idle:
            self.idle.remove(connection)

    def close(self) -> None:
        """Every connection closed; a response still being read, or a request still waiting
        for its response's head, raises UpstreamClosed. A closed pool sends nothing more."""
        self._closed = True
        for connection in list(self._all):
            if connection.response is not None:
                connection.response.close()
            else:
                connection.done(False)
        self.idle.clear()
