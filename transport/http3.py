"""Serve any ASGI app over HTTP/3 on aioquic, one request per bidirectional stream.

Why not hypercorn: it hard-codes its QUIC configuration (no datagrams) and creates its
QuicConnection by a module-global name, so neither Eloquent's datagrams nor the stream scheduler
could be plugged in (hypercorn 0.17's `hypercorn/protocol/quic.py`). aioquic's example server
has no backpressure, lifespan or disconnect handling. This module adds exactly those:
- backpressure: `send()` of a response body waits while the stream holds more than
  `high_water` unacknowledged bytes, so a slow reader never makes us buffer without bound; a
  request body is buffered up to `max_body_bytes`, past which the stream stops reading (the app's
  `BodyLimit` answers 413), and the per-connection stream count is held to `max_streams` (QUIC's
  own MAX_STREAMS);
- lifespan: `Lifespan` runs the app's startup and shutdown, once, whoever serves it;
- disconnects: a stream reset (or its response refused with STOP_SENDING) by the client, a
  stream dropped at its deadline by the scheduler, or a closed connection turns into
  `http.disconnect` on the app's `receive()`;
- the end of a response: the `send()` of its last part returns once the client has acknowledged
  all of it, FIN included, and raises `ResponseNotDelivered` if the stream is reset first, so
  that an app never counts as delivered a response its client saw cut short. An ACK counts even
  for a packet aioquic had already sent again at a probe timeout (`send_acknowledged`): a client
  that reads the answer and closes at once never acknowledges the copy.
Each request is tagged once, when its HEADERS arrive, by `tag(headers, now)`: the tag's stream spec
goes to the connection's scheduler and the whole tag to the app, in `scope["extensions"]`, with
what the connection has measured of the client's path (`qos.PATH`) and a way to move the response
stream's deadline (`qos.DEADLINE`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast
from urllib.parse import unquote

from aioquic.asyncio.server import QuicServer
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import H3_ALPN, ErrorCode, FrameType, H3Connection, encode_frame
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, HeadersReceived
from aioquic.h3.exceptions import H3Error
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

from transport.connection import (
    CoalescingProtocol,
    ScheduledQuicConnection,
    StreamExpired,
    adopt,
    serve_quic,
    udp_transport,
)
from transport.drain import Drain
from transport.eloquent import DATAGRAM_ALLOWANCE, EloquentSender, SenderLane
from transport.eloquent import HEADER as ELOQUENT_HEADER
from transport.eloquent.driver import datagram_sender
from transport.eloquent.sse import SseEvents
from transport.limits import DEFAULT_MAX_BODY_BYTES
from transport.qos import DEADLINE, PATH, TAG, StreamDeadline, Tagger
from transport.stateless_reset import ResetKey
from transport.udp import BatchedDatagramTransport

logger = logging.getLogger(__name__)

ASGIApp = Callable[..., Any]

SERVER_HEADER = b"qos-llm-serving"
EVENT_TRACE = os.environ.get("HTTP3_EVENT_TRACE")
"""A file to append `stream_id position time` to for every event of every event-stream response,
when it is written (the event loop's clock, time.monotonic(), which every network namespace of
the machine shares): the generation times `experiments.eloquent_live` scores late tokens by."""

DATAGRAMS = "eloquent.datagrams"
"""The ASGI extension that hands an app the HTTP/3 datagrams of a request that asked for
Eloquent (`DatagramTap`), for an app that forwards them itself: the edge."""


class ResponseNotDelivered(ConnectionError):
    """The stream was reset (by the client, at its deadline, or with its connection) before the
    client acknowledged the whole response. ASGI servers raise an OSError from `send()` to a
    client that is gone; this is ours, raised where a response ends."""


@dataclass
class Http3Settings:
    certfile: str
    keyfile: str
    scheduler: str = "rr"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_streams: int = 128
    """Concurrent request streams per connection; QUIC's MAX_STREAMS holds the client to it.

    128 is aioquic's own default (quic/connection.py), kept: aioquic raises the credit as streams
    end, so it caps what one connection has open at once, not how many it ever sends. What it
    bounds is one connection's buffers: each stream may hold a request body up to
    `max_body_bytes` and `high_water` of response, 128 x (4 MiB + 256 KiB), about 0.5 GiB at
    worst. A client that wants more in flight opens more connections (the edge's pool, the
    replay's --connections); load past capacity is refused where it is counted (admission)."""
    flush_interval: float = 0.001
    """Seconds a busy connection gathers response bytes before its next packets
    (`CoalescingProtocol`); 0 sends after every event-loop pass. A millisecond is a fortieth of
    the per-token deadline. Longer gathers more tokens a packet (5 ms halved the packets and
    ACKs per token at 48 req/s on paper-4gpu-sim over 8 connections) but saved only about 6% of
    the CPU per token there, for up to 5 ms more per token: docs/results/http3-vs-http1.md."""
    high_water: int = 256 * 1024
    """Unacknowledged response bytes per stream past which the app's send() waits."""
    idle_timeout: float = 60.0
    """aioquic's default, kept. Unlike HTTP/1.1 keep-alive there is no race to win: the effective
    idle timeout is the smaller of the two endpoints' max_idle_timeout (RFC 9000 10.1), so both
    know when it ends (ours and transport.client's are both 60 s). It is far above the longest
    silence on a busy connection (a class deadline to the first token: 7 s at most)."""
    max_datagram_frame_size: int | None = 65536
    tag: Tagger | None = None
    """Classifies each request as it arrives; None leaves streams untagged."""
    congestion_control: str = "reno"
    """aioquic's `reno` (its default) or `cubic`, as Linux TCP and quic-go use: on a lossy path
    CUBIC recovers from a loss early in slow start far sooner (Chuppala (2024)'s microbenchmark over
    3G: real-time completion 91.5% under Reno, 100% under CUBIC, `experiments.transport_micro`)."""

    reset_key: ResetKey | None = None
    """Stateless resets (`transport.stateless_reset`): packets for connections this server does
    not know are answered with a reset made from this key. None: dropped, as aioquic does."""

    def quic_configuration(self) -> QuicConfiguration:
        configuration = QuicConfiguration(
            is_client=False,
            alpn_protocols=H3_ALPN,
            idle_timeout=self.idle_timeout,
            max_datagram_frame_size=self.max_datagram_frame_size,
            congestion_control_algorithm=self.congestion_control,
        )
        configuration.load_cert_chain(self.certfile, self.keyfile)
        return configuration


class Lifespan:
    """The ASGI lifespan protocol, run once for an app that several servers share."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._receive: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        self._task = asyncio.create_task(self._run())
        await self._receive.put({"type": "lifespan.startup"})
        message = await self._sent.get()
        if message["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"application startup failed: {message.get('message', '')}")
        # Otherwise `.complete`, or `_run`'s own word that the app returned without one: an app
        # that does not speak lifespan (ASGI lets it just return) serves without it.

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._receive.put({"type": "lifespan.shutdown"})
        await self._sent.get()
        await self._task

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}
        try:
            await self._app(scope, self._receive.get, self._sent.put)
        except Exception as exc:  # an app without lifespan support may raise; startup says so
            await self._sent.put({"type": "lifespan.startup.failed", "message": repr(exc)})
        else:  # wakes a startup (or shutdown) still waiting, if the app returned without a word
            await self._sent.put({"type": "lifespan.unsupported"})


class Http3Server:
    """Serves `app` on UDP `host:port`. The caller runs the app's `Lifespan`.

    `drain` is the server's stop (`transport.drain`): once it starts, `goaway()` tells every
    connection, and each one made later, to open no more requests; those that still come are
    rejected with H3_REQUEST_REJECTED, which tells their client that they were not processed and
    may be retried elsewhere (RFC 9114 5.2), and counted with `drain.on_refuse`."""

    def __init__(self, app: ASGIApp, settings: Http3Settings, drain: Drain | None = None) -> None:
        self.app = app
        self.settings = settings
        self.drain = drain if drain is not None else Drain()
        self._server: QuicServer | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> None:
        """Serve on `host:port`, or on `sock`, a UDP socket already bound there."""

        def create_protocol(connection: Any, **kwargs: Any) -> _Http3Protocol:
            return _Http3Protocol(adopt(connection, self.settings.scheduler), self, **kwargs)

        self._server = await serve_quic(
            host, port, sock, self.settings.reset_key,
            configuration=self.settings.quic_configuration(), create_protocol=create_protocol,
        )  # fmt: skip
        self.port = udp_transport(self._server).get_extra_info("sockname")[1]

    def goaway(self) -> None:
        """Send GOAWAY on every connection (connections made later get it once they speak
        HTTP/3)."""
        if self._server is not None:
            for protocol in set(self._server._protocols.values()):
                if isinstance(protocol, _Http3Protocol):
                    protocol.goaway()

    def close(self) -> None:
        if self._server is not None:
            # RFC 9114 5.2: a graceful shutdown closes with H3_NO_ERROR. aioquic's default code,
            # 0, is QUIC's NO_ERROR, which HTTP/3 does not define as an application error code.
            for protocol in set(self._server._protocols.values()):
                protocol.close(error_code=ErrorCode.H3_NO_ERROR)
            transport = udp_transport(self._server)
            if isinstance(transport, BatchedDatagramTransport):
                logger.info(
                    "HTTP/3 socket: %d datagrams in %d reads, GSO %s, %d sends dropped on a full "
                    "socket", transport.received, transport.reads,
                    "on" if transport.gso else "off", transport.dropped,
                )  # fmt: skip
            self._server.close()


class _Http3Protocol(CoalescingProtocol):
    def __init__(self, quic: ScheduledQuicConnection, server: Http3Server, **kwargs: Any) -> None:
        super().__init__(quic, **kwargs)
        self._server = server
        self._settings = server.settings
        self._h3: H3Connection | None = None
        self._requests: dict[int, _RequestStream] = {}
        self.lanes: dict[int, SenderLane | DatagramTap] = {}
        """Who takes each stream's datagrams: Eloquent senders, which outlive their request until
        everything is acknowledged, and taps that apps forward through."""
        self.blocked_writers: dict[int, _RequestStream] = {}
        """Writers waiting for ACKs, by stream: woken by their own stream's ACKs only."""
        self.unflushed: dict[int, _RequestStream] = {}
        """Responses with body bytes written since the last transmit (`_RequestStream.flush`)."""
        self._next_request_id = 0
        """The lowest client bidirectional stream id not yet seen: what GOAWAY would carry."""
        self._goaway_id: int | None = None
        # aioquic has no setting for it; the Limit object has been there since 1.0. `sent` too:
        # aioquic sends MAX_STREAMS only once `value` outgrows what it believes it has sent.
        limit = quic._local_max_streams_bidi
        limit.value = limit.sent = self._settings.max_streams
        quic.watch_acks()
        self.flush_interval = self._settings.flush_interval

    @property
    def quic(self) -> ScheduledQuicConnection:
        return cast(ScheduledQuicConnection, self._quic)  # as __init__ was given it

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated):
            if event.alpn_protocol in H3_ALPN:
                self._h3 = H3Connection(self._quic, enable_webtransport=True)
                if self._server.drain.draining:
                    self.goaway()
        elif isinstance(event, StreamReset | StreamExpired | StopSendingReceived):
            # STOP_SENDING: the client wants no more of the response (aioquic has already reset
            # our side of the stream), which is a disconnect as much as a reset is.
            request = self._requests.pop(event.stream_id, None)
            if request is not None:
                request.disconnect()
            lane = self.lanes.get(event.stream_id)
            if lane is not None:
                lane.close()
        elif isinstance(event, ConnectionTerminated):
            for request in self._requests.values():
                request.disconnect()
            self._requests.clear()
            for lane in list(self.lanes.values()):
                lane.close()
        if self._h3 is not None:
            try:
                h3_events = self._h3.handle_event(event)
            except H3Error as exc:  # aioquic closes the connection itself; nothing to answer
                logger.info("HTTP/3 error from %s: %s", self._peer(), exc)
                return
            for h3_event in h3_events:
                self._h3_event_received(h3_event)

    def transmit(self) -> None:
        # Every response's body written since the last transmit goes onto its stream now, in
        # one DATA frame each: one frame header, one stream write and one change of the
        # scheduler's state per stream per transmit, however many events the app wrote.
        if self.unflushed:
            unflushed, self.unflushed = self.unflushed, {}
            for request in unflushed.values():
                request.flush()
        super().transmit()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        # ACKs may have drained response buffers: wake the writers waiting on them. Only those
        # of the streams acknowledged: waking every waiting writer on every datagram cost a task
        # switch per open response per ACK (a sixth of the server's CPU at 96 req/s).
        for stream_id in self.quic.take_acked():
            request = self.blocked_writers.get(stream_id)
            if request is not None:
                request.wake_writer()

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            if event.stream_id in self._requests:
                return  # trailers: ignored
            self._start_request(event)
        elif isinstance(event, DataReceived):
            request = self._requests.get(event.stream_id)
            if request is not None:
                request.body_received(event.data, event.stream_ended)
        elif isinstance(event, DatagramReceived):
            lane = self.lanes.get(event.stream_id)
            if lane is not None:
                lane.datagram(event.data)

    def _start_request(self, event: HeadersReceived) -> None:
        pseudo: dict[bytes, bytes] = {}
        headers: list[tuple[bytes, bytes]] = []
        for name, value in event.headers:
            if name.startswith(b":"):
                pseudo[name] = value
            else:
                headers.append((name, value))
        if b":authority" in pseudo:
            headers.insert(0, (b"host", pseudo[b":authority"]))
        raw_path, _, query = pseudo.get(b":path", b"/").partition(b"?")
        extensions: dict[str, Any] = {}
        if self._settings.tag is not None:
            # The asyncio loop's clock is time.monotonic(), so stream deadlines and the app's
            # clocks agree.
            named = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
            tag = extensions[TAG] = self._settings.tag(named, time.monotonic())
            self.quic.set_stream_spec(event.stream_id, tag.spec)
            extensions[DEADLINE] = StreamDeadline(
                tag.spec, partial(self.quic.set_stream_spec, event.stream_id)
            )
        path = self.quic.path_estimate()
        if path is not None:
            extensions[PATH] = path
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "3",
            "method": pseudo.get(b":method", b"GET").decode("latin-1"),
            "scheme": "https",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self._peer(),
            "server": udp_transport(self).get_extra_info("sockname")[:2],
            "extensions": extensions,
        }
        if self._goaway_id is not None and event.stream_id >= self._goaway_id:
            self._reject(event.stream_id, scope)
            return
        self._next_request_id = max(self._next_request_id, event.stream_id + 4)
        request = _RequestStream(self, event.stream_id, scope)
        if dict(headers).get(ELOQUENT_HEADER, b"").lower() in (b"1", b"true"):
            request.tap = extensions[DATAGRAMS] = DatagramTap(self, event.stream_id)
            self.lanes[event.stream_id] = request.tap
            self.quic.datagram_allowance = DATAGRAM_ALLOWANCE
        self._requests[event.stream_id] = request
        if event.stream_ended:
            request.body_received(b"", True)
        request.task = asyncio.ensure_future(request.run(self._server.app))

    def _peer(self) -> tuple[str, int]:
        peer = self._transport.get_extra_info("peername") if self._transport else None
        if peer is None:  # a server's socket is unconnected: the connection knows the path
            addr = self._quic._network_paths[0].addr if self._quic._network_paths else ("", 0)
            return (str(addr[0]), int(addr[1]))
        return (str(peer[0]), int(peer[1]))

    def goaway(self) -> None:
        """Ask the client to open no more requests on this connection (RFC 9114 5.2); the
        requests it has opened so far may finish.

        aioquic 1.7 has no way to send GOAWAY (H3Connection only checks one that arrives, and
        ignores its payload), so the frame goes onto our control stream here. Its id is the
        lowest client-initiated bidirectional stream id this server has not seen HEADERS on:
        every request below it is being processed; any at or above it is rejected, unprocessed.
        """
        if self._h3 is None or self._goaway_id is not None:
            return  # not HTTP/3 yet (ProtocolNegotiated sends it then), or already sent
        self._goaway_id = self._next_request_id
        control = self._h3._local_control_stream_id
        assert control is not None, "H3Connection opens its control stream when it is made"
        frame = encode_frame(FrameType.GOAWAY, encode_uint_var(self._goaway_id))
        self.quic.send_stream_data(control, frame)
        self.transmit_soon()

    def _reject(self, stream_id: int, scope: dict[str, Any]) -> None:
        """A request opened after GOAWAY: not processed, so its client may retry it elsewhere."""
        with contextlib.suppress(ValueError):  # its client already finished sending
            self.quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_REJECTED)
        with contextlib.suppress(ValueError):
            self.quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_REJECTED)
        self.transmit_soon()
        self._server.drain.on_refuse(scope)

    def request_finished(self, stream_id: int) -> None:
        self._requests.pop(stream_id, None)
        if isinstance(self.lanes.get(stream_id), DatagramTap):
            self.lanes.pop(stream_id)

    def sender_lane(self, stream_id: int) -> SenderLane:
        """An Eloquent sender beside a response stream, on the event loop's clock."""

        send = datagram_sender(self.quic, self.h3, stream_id, self.transmit_soon)

        def rtt() -> float | None:
            loss = self._quic._loss  # aioquic keeps its RTT estimate here, with no accessor
            return loss._rtt_smoothed if loss._rtt_initialized else None

        def done() -> None:
            if self.lanes.get(stream_id) is lane:
                del self.lanes[stream_id]

        loop = asyncio.get_running_loop()
        lane = SenderLane(EloquentSender(), send, loop, rtt, done)
        self.lanes[stream_id] = lane
        return lane

    @property
    def h3(self) -> H3Connection:
        assert self._h3 is not None
        return self._h3


@dataclass(eq=False)  # hashed by identity: it sits in the protocol's set of blocked writers
class _RequestStream:
    protocol: _Http3Protocol
    stream_id: int
    scope: dict[str, Any]
    task: asyncio.Future[None] | None = None  # held: the loop keeps only weak references
    _body: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    _body_bytes: int = 0
    _overflowed: bool = False
    _disconnected: bool = False
    _started: bool = False
    _finished: bool = False
    _response: tuple[int, list[tuple[bytes, bytes]]] | None = None
    _drained: asyncio.Event = field(default_factory=asyncio.Event)
    tap: DatagramTap | None = None
    """Set when the request asked for Eloquent."""
    _lane: SenderLane | None = None
    _trace: _EventTrace | None = None
    _unsent: list[bytes] = field(default_factory=list)
    """Body written by the app and not yet on the stream: it goes at the next transmit."""
    _unsent_bytes: int = 0
    _unsent_end: bool = False

    async def run(self, app: ASGIApp) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except ResponseNotDelivered:
            pass  # the client is gone: there is no one left to answer
        except Exception:
            logger.exception("ASGI app failed on stream %d", self.stream_id)
            if not self._started:
                self._respond_plain(500, b"Internal Server Error")
            elif not self._finished:
                self._reset(ErrorCode.H3_INTERNAL_ERROR)
        else:
            # An app that returned without finishing its answer must not leave a client that is
            # still there hanging. One that left is not waiting: an app may rightly stop for it
            # before answering (under overload, thousands of times a second).
            if not self._finished and not self._disconnected:
                if self._started:
                    self._write(b"", end_stream=True)
                else:
                    logger.error("ASGI app returned no response on stream %d", self.stream_id)
                    self._respond_plain(500, b"Internal Server Error")
        finally:
            self.protocol.request_finished(self.stream_id)

    def body_received(self, data: bytes, ended: bool) -> None:
        if self._disconnected or self._overflowed:
            return
        self._body_bytes += len(data)
        self._body.put_nowait({"type": "http.request", "body": data, "more_body": not ended})
        if self._body_bytes > self.protocol._settings.max_body_bytes:
            # Buffer no more. The app's own cap (transport.limits.BodyLimit) answers the 413 and
            # counts it when it reads past its limit; an app without one sees the client leave.
            self._overflowed = True
            self._body.put_nowait({"type": "http.disconnect"})
            self._stop_reading()

    def _stop_reading(self) -> None:
        with contextlib.suppress(ValueError):  # already finished
            self.protocol.quic.stop_stream(self.stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self.protocol.transmit_soon()

    def disconnect(self) -> None:
        self._disconnected = True
        self._drop_unsent()
        if self._lane is not None:
            self._lane.close()
        self._body.put_nowait({"type": "http.disconnect"})
        self._drained.set()

    def wake_writer(self) -> None:
        # A writer that has sent its end waits for ACKs, not for room: any ACK may be the last.
        if self._finished or self._buffered() <= self.protocol._settings.high_water // 2:
            self._drained.set()

    async def receive(self) -> dict[str, Any]:
        if self._disconnected and self._body.empty():
            return {"type": "http.disconnect"}
        return await self._body.get()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        ends = kind == "http.response.body" and not message.get("more_body", False)
        if self._disconnected and ends:
            raise ResponseNotDelivered(f"stream {self.stream_id} was reset")
        if self._disconnected or self._finished:
            return  # as uvicorn: the app learns of the disconnect from receive()
        if kind == "http.response.start":
            status, headers = int(message["status"]), list(message.get("headers", []))
            content_type = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
            events = content_type.startswith(b"text/event-stream")
            if events and EVENT_TRACE:
                self._trace = _EventTrace(EVENT_TRACE, self.stream_id)
            if self.tap is not None and not self.tap.claimed and events:
                self._lane = self.protocol.sender_lane(self.stream_id)
                headers.append((ELOQUENT_HEADER, b"1"))
            self._response = (status, headers)
        elif kind == "http.response.body":
            if not self._started:
                assert self._response is not None, "http.response.body before start"
                self._send_headers(*self._response)
            more = bool(message.get("more_body", False))
            body = message.get("body", b"")
            self._write(body, end_stream=not more)
            if self._trace is not None:
                self._trace.write(body)
            if self._lane is not None and not self._disconnected:
                self._lane.body(body, ended=not more)
            if more:
                high_water = self.protocol._settings.high_water
                while self._buffered() > high_water and not self._disconnected:
                    await self._acks()
                return
            # Buffered is not delivered: until the client acknowledges the FIN, a reset can still
            # cut the response short.
            quic = self.protocol.quic
            while not quic.send_acknowledged(self.stream_id) and not self._disconnected:
                await self._acks()
            if self._disconnected:
                raise ResponseNotDelivered(f"stream {self.stream_id} was reset before its end")
            if self._lane is not None:
                # The client has every byte of the stream: datagrams can bring it nothing more.
                # Without this, a lost last ACK kept the sender re-sending until it gave up.
                self._lane.close()

    async def _acks(self) -> None:
        """Waits until ACKs drain this stream's buffer, or the client leaves."""
        self._drained.clear()
        self.protocol.blocked_writers[self.stream_id] = self
        try:
            await self._drained.wait()
        finally:
            self.protocol.blocked_writers.pop(self.stream_id, None)

    def _send_headers(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._started = True
        self.protocol.h3.send_headers(
            self.stream_id,
            [(b":status", str(status).encode()), (b"server", SERVER_HEADER)]
            + [(name.lower(), value) for name, value in headers],
        )

    def _write(self, data: bytes, end_stream: bool) -> None:
        """Queue body bytes for the stream; they go onto it at the next transmit (`flush`)."""
        if data:
            self._unsent.append(data)
            self._unsent_bytes += len(data)
        self._unsent_end = end_stream
        self._finished = end_stream
        self.protocol.unflushed[self.stream_id] = self
        self.protocol.transmit_soon()

    def flush(self) -> None:
        """Put the queued body onto the stream as one DATA frame."""
        if self._disconnected:
            return
        data, end = b"".join(self._unsent), self._unsent_end
        self._unsent, self._unsent_bytes = [], 0
        try:
            self.protocol.h3.send_data(self.stream_id, data, end)
        except (ValueError, AssertionError, RuntimeError, H3Error):  # reset under us
            self.disconnect()

    def _drop_unsent(self) -> None:
        """The stream is gone or reset: what the app wrote last never goes out."""
        self._unsent, self._unsent_bytes = [], 0
        self.protocol.unflushed.pop(self.stream_id, None)

    def _respond_plain(self, status: int, body: bytes) -> None:
        if self._disconnected:
            return
        self._send_headers(status, [(b"content-type", b"text/plain")])
        self._write(body, end_stream=True)

    def _reset(self, code: int) -> None:
        self._finished = True
        self._drop_unsent()
        with contextlib.suppress(ValueError):
            self.protocol.quic.reset_stream(self.stream_id, code)
        self.protocol.transmit_soon()

    def _buffered(self) -> int:
        stream = self.protocol.quic._streams.get(self.stream_id)
        if stream is None:
            return self._unsent_bytes
        # aioquic keeps no public count of a stream's unacknowledged bytes.
        return self._unsent_bytes + stream.sender._buffer_stop - stream.sender._buffer_start


class _EventTrace:
    """Appends when each event of one response was written (`EVENT_TRACE`)."""

    def __init__(self, path: str, stream_id: int) -> None:
        self._path = path
        self._stream_id = stream_id
        self._events = SseEvents()
        self._position = 0

    def write(self, body: bytes) -> None:
        now = time.monotonic()
        lines = []
        for _ in self._events.feed(body):
            lines.append(f"{self._stream_id} {self._position} {now:.6f}\n")
            self._position += 1
        if lines:
            with open(self._path, "a") as trace:
                trace.writelines(lines)


class DatagramTap:
    """One request stream's HTTP/3 datagrams, for an app that forwards Eloquent itself.

    An app claims them by setting `receive` before it starts its response: the server then runs
    no Eloquent sender of its own on the stream, hands every datagram from the client to
    `receive`, and `send` puts one on the stream toward the client, until the request ends."""

    def __init__(self, protocol: _Http3Protocol, stream_id: int) -> None:
        self._protocol = protocol
        self.stream_id = stream_id
        self.receive: Callable[[bytes], None] | None = None
        self._send = datagram_sender(protocol.quic, protocol.h3, stream_id, protocol.transmit_soon)

    @property
    def claimed(self) -> bool:
        return self.receive is not None

    def send(self, payload: bytes) -> None:
        if self._protocol.lanes.get(self.stream_id) is self:  # else the stream is gone
            self._send(payload)

    def datagram(self, payload: bytes) -> None:
        if self.receive is not None:
            self.receive(payload)

    def close(self) -> None:
        self._protocol.lanes.pop(self.stream_id, None)
