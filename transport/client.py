"""An HTTP/3 client on one long-lived QUIC connection, with a stream scheduler for its requests.

`Http3Client` multiplexes requests as streams on one connection: the edge front-end forwards
through it and the load generator drives the server with it. A server allows a connection only
so many open streams (QUIC's MAX_STREAMS); a request past that waits in the client until the
server grants more, and `Response.sent_at` says when it really went out. `Http3Pool` spreads
requests over several connections so that they need not wait. `python -m transport.client URL`
fetches one URL.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

from transport.connection import (
    CoalescingProtocol,
    ScheduledQuicConnection,
    StatelessReset,
    StreamExpired,
    adopt,
    connect_quic,
)
from transport.eloquent import HEADER as ELOQUENT_HEADER
from transport.eloquent import EloquentReceiver, ReceiverLane
from transport.eloquent.driver import datagram_sender
from transport.schedulers import StreamSpec


class StreamError(Exception):
    """The response stream ended abnormally: reset by the peer or the connection closed."""

    def __init__(
        self, message: str, error_code: int | None = None, connection: str | None = None
    ) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.connection = connection
        """The name of the client (`Http3Client.name`) whose connection raised it."""


@dataclass
class Response:
    stream_id: int
    status: int
    headers: dict[str, str]
    _client: Http3Client
    _chunks: asyncio.Queue[bytes | StreamError | None]
    lane: ReceiverLane | None = None
    """Set when the response carries Eloquent datagrams: its receiver has the render times."""
    sent_at: float = 0.0
    """time.perf_counter() when the request could go out: at once, or when the server granted
    the stream credit it waited for."""
    credit_wait_s: float = 0.0
    """How long it waited for that credit; 0 if it did not."""
    connection: str = ""
    """The name of the client (connection) that carried it."""
    _done: bool = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        while not self._done:
            chunk = await self._chunks.get()
            if chunk is None:
                self._done = True
                return
            if isinstance(chunk, StreamError):
                self._done = True
                raise chunk
            if chunk:
                yield chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_bytes()])

    async def iter_lines(self) -> AsyncIterator[str]:
        buffer = b""
        async for chunk in self.iter_bytes():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode().rstrip("\r")
        if buffer:
            yield buffer.decode()

    def send_datagram(self, payload: bytes) -> None:
        """An HTTP/3 datagram on this request's stream (for a `request(datagrams=...)`)."""
        self._client._send_datagram(self.stream_id, payload)

    def close(self) -> None:
        """Abandon the response: the server sees the stream reset (a client disconnect)."""
        if not self._done:
            self._done = True
            self._client._cancel(self.stream_id)


@dataclass
class _Pending:
    headers: asyncio.Future[list[tuple[bytes, bytes]]]
    chunks: asyncio.Queue[bytes | StreamError | None] = field(default_factory=asyncio.Queue)
    lane: ReceiverLane | None = None
    datagrams: Callable[[bytes], None] | None = None
    """Takes the stream's datagrams as they come, for a caller that forwards them itself."""


_ENDED_LANES = 32
"""Ended responses whose datagrams the client still acknowledges (a few seconds' worth)."""
PROBE_S = 0.25
"""Seconds. A connection with requests open that has heard nothing from the server for this
long sends a PING. A client whose requests are all sent has nothing else to send, so a server
that lost the connection would never be asked, and could not reset it (a request waiting in a
queue of the engines is as quiet); answered, it costs two small packets per probe."""


class _ClientProtocol(CoalescingProtocol):
    def __init__(self, quic: Any, scheduler: str = "rr", name: str = "", **kwargs: Any) -> None:
        super().__init__(adopt(quic, scheduler), **kwargs)
        self.name = name
        self.quic.ack_every = 2
        self.h3 = H3Connection(self._quic, enable_webtransport=True)
        self.pending: dict[int, _Pending] = {}
        self.closed: StreamError | None = None
        self._blocked: deque[tuple[int, asyncio.Future[float]]] = deque()
        """Streams opened past the server's stream limit, in id order, and who waits on them."""
        self._abandoned: set[int] = set()
        """Streams cancelled while past the limit: reset once the limit covers them."""
        self._ended: dict[int, ReceiverLane] = {}
        """Eloquent lanes of the last responses that ended, oldest first: still acknowledging."""
        self._quiet_since = self._loop.time()
        self._probe: asyncio.TimerHandle | None = None

    @property
    def quic(self) -> ScheduledQuicConnection:
        return cast(ScheduledQuicConnection, self._quic)  # adopted in __init__

    @property
    def stream_credit(self) -> int:
        """How many more request streams the server allows now; negative when some wait."""
        quic = self._quic
        # aioquic keeps these as plain attributes and has no public accessor.
        return quic._remote_max_streams_bidi - quic._local_next_stream_id_bidi // 4

    def receiver_lane(self, stream_id: int, chunks: asyncio.Queue) -> ReceiverLane:
        """An Eloquent receiver for a response: it puts the body's bytes in `chunks`."""

        send = datagram_sender(self._quic, self.h3, stream_id, self.transmit_soon)
        return ReceiverLane(EloquentReceiver(), send, self._loop, chunks.put_nowait)

    def until_sendable(self, stream_id: int) -> asyncio.Future[float]:
        """Resolves with time.perf_counter() once the server's stream limit covers `stream_id`."""
        future: asyncio.Future[float] = self._loop.create_future()
        if stream_id // 4 < self._quic._remote_max_streams_bidi:
            future.set_result(time.perf_counter())
        elif self.closed is not None:
            future.set_exception(self.closed)
        else:
            self._blocked.append((stream_id, future))
        return future

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._quiet_since = self._loop.time()
        super().datagram_received(data, addr)
        # A MAX_STREAMS frame may have come: what it unblocked is sent in the next loop pass.
        limit = self._quic._remote_max_streams_bidi
        while self._blocked and self._blocked[0][0] // 4 < limit:
            _, future = self._blocked.popleft()
            if not future.done():
                future.set_result(time.perf_counter())
        for stream_id in [s for s in self._abandoned if s // 4 < limit]:
            self._abandoned.discard(stream_id)
            self.cancel(stream_id)

    def watch(self) -> None:
        """Probe the server (PROBE_S) while requests are open."""
        if self._probe is None and self.closed is None:
            self._probe = self._loop.call_at(self._quiet_since + PROBE_S, self._probe_due)

    def _probe_due(self) -> None:
        self._probe = None
        if not self.pending or self.closed is not None:
            return
        if self._loop.time() - self._quiet_since >= PROBE_S:
            self._quic.send_ping(0)
            self.transmit_soon()
            self._quiet_since = self._loop.time()  # the next probe a PROBE_S later
        self.watch()

    def cancel(self, stream_id: int) -> None:
        """Reset a request stream and stop its response: the server sees the client leave.

        aioquic would send RESET_STREAM and STOP_SENDING at once even for a stream past the
        server's limit, which the server must answer by closing the whole connection
        (STREAM_LIMIT_ERROR). Such a stream is reset when the limit reaches it instead."""
        if stream_id // 4 >= self._quic._remote_max_streams_bidi:
            self._abandoned.add(stream_id)
            return
        with suppress(ValueError):  # the stream already finished
            self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self.transmit_soon()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamReset | StreamExpired):
            code = getattr(event, "error_code", ErrorCode.H3_REQUEST_CANCELLED)
            reset = StreamError(f"stream reset (error {code:#x})", code, self.name)
            self._fail(event.stream_id, reset)
        elif isinstance(event, ConnectionTerminated):
            self.closed = closed = _why_closed(event, self.name)
            for stream_id in list(self.pending):
                self._fail(stream_id, closed)
            while self._blocked:
                _, future = self._blocked.popleft()
                if not future.done():
                    future.set_exception(closed)
        for h3_event in self.h3.handle_event(event):
            self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        stream_id: int | None = getattr(event, "stream_id", None)
        pending = self.pending.get(stream_id) if stream_id is not None else None
        if stream_id is None or pending is None:
            if isinstance(event, DatagramReceived) and event.stream_id in self._ended:
                # The server had not heard that we hold everything: tell it again, or it
                # re-sends until it gives up (or until it sees the stream acknowledged).
                self._ended[event.stream_id].datagram(event.data)
            return
        lane = pending.lane
        if isinstance(event, HeadersReceived):
            if lane is not None and (ELOQUENT_HEADER, b"1") in event.headers:
                lane.activate()  # events that datagrams delivered before the headers go now
            else:
                pending.lane = lane = None
            if not pending.headers.done():
                pending.headers.set_result(event.headers)
        elif isinstance(event, DataReceived):
            if lane is not None:
                lane.stream(event.data)
            else:
                pending.chunks.put_nowait(event.data)
        elif isinstance(event, DatagramReceived):
            if pending.datagrams is not None:
                pending.datagrams(event.data)
            elif lane is not None:
                lane.datagram(event.data)
        if getattr(event, "stream_ended", False):
            if lane is not None:
                lane.end()
                self._ended[stream_id] = lane
                while len(self._ended) > _ENDED_LANES:
                    del self._ended[next(iter(self._ended))]
            pending.chunks.put_nowait(None)
            self.pending.pop(stream_id, None)

    def _fail(self, stream_id: int, error: StreamError) -> None:
        pending = self.pending.pop(stream_id, None)
        if pending is None:
            return
        if not pending.headers.done():
            pending.headers.set_exception(error)
        pending.chunks.put_nowait(error)


def _why_closed(event: ConnectionTerminated, name: str) -> StreamError:
    if isinstance(event, StatelessReset):
        return StreamError(
            "connection reset by the server, which no longer knows it (a stateless reset: the "
            "process that held it is gone); what was in flight on it is lost",
            connection=name,
        )
    return StreamError(
        f"connection closed: {event.reason_phrase or 'no reason'} (error {event.error_code:#x})",
        event.error_code,
        name,
    )


def client_configuration(
    verify: bool | str = True, server_name: str | None = None, congestion_control: str = "reno"
) -> QuicConfiguration:
    """`verify`: True (system CAs), False (accept any certificate) or a CA/cert file path.
    `congestion_control`: as `Http3Settings.congestion_control`."""
    configuration = QuicConfiguration(
        is_client=True,
        alpn_protocols=H3_ALPN,
        max_datagram_frame_size=65536,
        congestion_control_algorithm=congestion_control,
    )
    if verify is False:
        configuration.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, str):
        configuration.load_verify_locations(verify)
    configuration.server_name = server_name
    return configuration


_ACK_FLUSH_S = 0.01
"""Ten times aioquic's ack delay: time for the last acknowledgement to leave before a close."""


class Http3Client:
    """`async with Http3Client(host, port) as client: response = await client.request(...)`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        verify: bool | str = True,
        scheduler: str = "rr",
        server_name: str | None = None,
        congestion_control: str = "reno",
        name: str = "",
    ) -> None:
        self.host, self.port = host, port
        self.authority = f"{host}:{port}"
        self.name = name
        """Told apart from other connections in `Response.connection`."""
        self._configuration = client_configuration(verify, server_name or host, congestion_control)
        self._scheduler = scheduler
        self._context: Any = None
        self._protocol: _ClientProtocol | None = None

    async def __aenter__(self) -> Http3Client:
        def create_protocol(connection: Any, **kwargs: Any) -> _ClientProtocol:
            return _ClientProtocol(connection, self._scheduler, self.name, **kwargs)

        self._context = connect_quic(
            self.host, self.port, configuration=self._configuration,
            create_protocol=create_protocol,
        )  # fmt: skip
        self._protocol = cast(_ClientProtocol, await self._context.__aenter__())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._context is not None:
            if self.is_open:
                # aioquic acknowledges what it received after its ack delay (1 ms), and a
                # CONNECTION_CLOSE sent first carries no acknowledgement; a server that counts a
                # response as delivered only once it is acknowledged (ours) would count the last
                # one as cancelled. One short wait lets the acknowledgement go out first.
                await asyncio.sleep(_ACK_FLUSH_S)
            await self._context.__aexit__(None, None, None)
            self._context = None

    @property
    def closed(self) -> StreamError | None:
        """Why the connection closed, once it has."""
        return self._protocol.closed if self._protocol is not None else None

    @property
    def is_open(self) -> bool:
        return self._protocol is not None and self._protocol.closed is None

    @property
    def protocol(self) -> _ClientProtocol:
        if self._protocol is None:
            raise RuntimeError("Http3Client is not connected; use `async with`")
        if self._protocol.closed is not None:
            raise self._protocol.closed
        return self._protocol

    async def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        spec: StreamSpec | None = None,
        eloquent: bool = False,
        datagrams: Callable[[bytes], None] | None = None,
    ) -> Response:
        """Send a request on a new stream and wait for the response headers.
        `spec` tags the stream for this connection's scheduler. `eloquent` asks for the body's
        events in datagrams too (`x-eloquent: 1`); `Response.lane` then has the receiver.
        `datagrams` takes the stream's datagrams raw instead, for a caller that forwards them
        (`Response.send_datagram` sends the other way); the request's headers say the rest.
        Past the server's stream limit the request waits for credit (aioquic holds its bytes);
        `Response.sent_at` says when it went out."""
        protocol = self.protocol
        quic = protocol.quic
        stream_id = quic.get_next_available_stream_id()
        if spec is not None:
            quic.set_stream_spec(stream_id, spec)
        pending = _Pending(asyncio.get_running_loop().create_future())
        if eloquent or datagrams is not None:
            # Eloquent is for lossy paths, where the server's loss recovery and window must hear
            # of every packet at once: acknowledging every second one raised its stall ratio at
            # RTT 200 ms from 21% to 26-27% (experiments.eloquent_live, one run each).
            quic.ack_every = 1
        if datagrams is not None:
            pending.datagrams = datagrams
        elif eloquent:
            pending.lane = protocol.receiver_lane(stream_id, pending.chunks)
            headers = {**(headers or {}), ELOQUENT_HEADER.decode(): "1"}
        protocol.pending[stream_id] = pending
        protocol.watch()
        fields = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self.authority.encode()),
            (b":path", path.encode()),
        ] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        protocol.h3.send_headers(stream_id, fields, end_stream=not body)
        if body:
            protocol.h3.send_data(stream_id, body, end_stream=True)
        protocol.transmit_soon()
        sendable = protocol.until_sendable(stream_id)
        queued_at = time.perf_counter()
        try:
            sent_at = await sendable
            raw = await pending.headers
        except asyncio.CancelledError:
            self._cancel(stream_id)
            raise
        finally:
            # A connection that closes fails both; the headers' failure, the same one, is
            # taken here so that asyncio does not log it as never retrieved.
            if pending.headers.done() and not pending.headers.cancelled():
                pending.headers.exception()
        named = {k.decode(): v.decode() for k, v in raw}
        status = int(named.pop(":status", "0"))
        return Response(
            stream_id, status, named, self, pending.chunks, pending.lane, sent_at,
            max(0.0, sent_at - queued_at), self.name,
        )  # fmt: skip

    @property
    def stream_credit(self) -> int:
        """Requests that can go out now without waiting for the server's stream credit."""
        return self.protocol.stream_credit

    def _send_datagram(self, stream_id: int, payload: bytes) -> None:
        protocol = self._protocol
        if protocol is not None and protocol.closed is None:
            protocol.h3.send_datagram(stream_id, payload)
            protocol.transmit_soon()

    def _cancel(self, stream_id: int) -> None:
        protocol = self._protocol
        if protocol is None or protocol.closed is not None:
            return
        protocol.pending.pop(stream_id, None)
        protocol.cancel(stream_id)


class Http3Pool:
    """`connections` QUIC connections to one server, opened together; each request goes on the
    one with the most stream credit left, so that up to `connections` times the server's stream
    limit can be in flight before any request waits. A connection that closes (or is reset) is
    reopened for the next request.

    Connections are named `slot.generation`: "3.0" is the fourth slot's first connection, "3.1"
    the one that replaced it.

    `others`: more addresses of the same service (front-end hosts behind one name): slot i
    connects to the (i mod n)-th address, and requests go to the addresses in turn, as a
    client's DNS round robin or a load balancer spreads them."""

    def __init__(
        self,
        host: str,
        port: int,
        connections: int = 1,
        others: Sequence[tuple[str, int]] = (),
        **kwargs: Any,
    ) -> None:
        if connections < 1:
            raise ValueError(f"connections must be at least 1, got {connections}")
        self.host, self.port = host, port
        self.addresses = [(host, port), *others]
        if connections < len(self.addresses):
            raise ValueError(f"{connections} connections cannot reach {len(self.addresses)} "
                             "addresses")  # fmt: skip
        self._kwargs = kwargs
        self.connections = connections
        self.clients: list[Http3Client] = []
        self._opened = [0] * connections
        self._lock = asyncio.Lock()
        self._turn = itertools.count()

    async def __aenter__(self) -> Http3Pool:
        opened = await asyncio.gather(
            *(self._open(slot) for slot in range(self.connections)), return_exceptions=True
        )
        self.clients = [client for client in opened if isinstance(client, Http3Client)]
        if failed := next((r for r in opened if isinstance(r, BaseException)), None):
            await self.__aexit__(None, None, None)
            raise failed
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.gather(
            *(client.__aexit__(None, None, None) for client in self.clients),
            return_exceptions=True,
        )

    async def request(self, *args: Any, **kwargs: Any) -> Response:
        """`Http3Client.request` on the connection with the most stream credit."""
        return await (await self._pick()).request(*args, **kwargs)

    async def _pick(self) -> Http3Client:
        # A loop: another connection may close while one reopens.
        while not all(client.is_open for client in self.clients):
            async with self._lock:
                for slot, client in enumerate(self.clients):
                    if not client.is_open:
                        await client.__aexit__(None, None, None)
                        self.clients[slot] = await self._open(slot)
        clients = self.clients
        if len(self.addresses) > 1:
            where = next(self._turn) % len(self.addresses)
            clients = clients[where :: len(self.addresses)]
        return max(clients, key=lambda client: client.stream_credit)

    async def _open(self, slot: int) -> Http3Client:
        host, port = self.addresses[slot % len(self.addresses)]
        fresh = Http3Client(host, port, name=f"{slot}.{self._opened[slot]}", **self._kwargs)
        self._opened[slot] += 1
        await asyncio.wait_for(fresh.__aenter__(), timeout=10)
        return fresh


def split_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"https://{url}")
    return parts.hostname or "localhost", parts.port or 443


async def _fetch_cli(args: Any) -> int:
    import sys

    host, port = split_url(args.url)
    path = urlsplit(args.url).path or "/"
    if urlsplit(args.url).query:
        path += "?" + urlsplit(args.url).query
    headers = dict(h.split(":", 1) for h in args.header)
    headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
    body = args.data.encode() if args.data is not None else b""
    method = args.request or ("POST" if body else "GET")
    verify: bool | str = args.cacert or not args.insecure
    async with Http3Client(host, port, verify=verify) as client:
        response = await client.request(method, path, headers, body)
        if args.include:
            print(f"HTTP/3 {response.status}")
            for name, value in response.headers.items():
                print(f"{name}: {value}")
            print()
        async for chunk in response.iter_bytes():
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
    return 0 if response.status < 400 else 1


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m transport.client",
        description="One HTTP/3 request, its body printed as it streams (a small curl).",
    )
    parser.add_argument("url", help="e.g. https://localhost:8443/v1/models")
    parser.add_argument("-X", "--request", help="method (default: GET, or POST with --data)")
    parser.add_argument("-H", "--header", action="append", default=[], help="'name: value'")
    parser.add_argument("-d", "--data", help="request body")
    parser.add_argument("-i", "--include", action="store_true", help="print status and headers")
    parser.add_argument("--cacert", help="trust this certificate (the server's .certs/cert.pem)")
    parser.add_argument(
        "--insecure", action="store_true", help="accept any certificate (self-signed servers)"
    )
    return asyncio.run(_fetch_cli(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
