"""The client side of CONNECT-UDP (RFC 9298): `MasqueClient`, one QUIC connection to a MASQUE
proxy carrying any number of `Tunnel`s, each one UDP flow; and `UdpTunnel`, one of each.

    async with MasqueClient("127.0.0.1", proxy_port, key=KEY, verify=cert, scheduler="rr") as c:
        tunnel = await c.open_tunnel("10.0.0.5", 443, urgency=1)
        tunnel.local_address   # ("127.0.0.1", port): point any UDP client here, e.g. an inner
                               # aioquic connection, and its packets go to 10.0.0.5:443
        tunnel.send(b"ping")   # or drive the flow directly:
        reply = await tunnel.recv()

The connection speaks HTTP/3 (`H3Connection(quic, enable_webtransport=True)`: SETTINGS_H3_DATAGRAM,
with `max_datagram_frame_size` set). Each tunnel is an Extended CONNECT request (`:protocol
connect-udp`, the default template's path, `capsule-protocol: ?1`, `authorization: Bearer KEY`)
on a stream of its own; anything but a 2xx raises `TunnelRefused` with the status. Then the tunnel
opens a UDP socket on 127.0.0.1 (port 0 unless told); the first address that sends to it becomes
its local peer, and other senders are ignored.

Scheduling, as in chapter 2 of Chuppala (2024): the connection is a `ScheduledQuicConnection`,
and each tunnel's stream is tagged with a `StreamSpec`, so the stream scheduler orders the
tunnels' uploads against each other as it orders requests. A tunnel asked for with `urgency=u`
sends RFC 9218's `priority: u=<u>`, which the proxy schedules its downloads by, and is tagged
`priority=7-u` here, as `transport.qos` maps a class; `spec=` tags it otherwise here (the
thesis's priorities 1 to 10 are finer than RFC 9218's eight urgencies). An inner QUIC connection
orders its own streams with its own scheduler before its packets reach the tunnel: the hierarchy
is the two connections'.

Each UDP payload goes to the proxy as a DATAGRAM capsule (context 0) on the tunnel's stream
(`mode="capsule"`, the default: reliable and ordered, scheduled, works on any HTTP/3 path), or as
an HTTP/3 datagram (`mode="datagram"`: unreliable, like UDP, outside the stream scheduler, for
payloads up to `datagram_limit`, which the connection's `max_datagram_size` sets; larger ones
still go as capsules). Whatever comes back, capsule or datagram, goes to the local peer (or to
`recv()` before any local peer has sent). An inner QUIC connection needs nothing from aioquic's
internals: it is an ordinary UDP client of `local_address`.

A tunnel ends when the proxy ends or resets its stream, when the connection closes, or on its
`aclose()`; `recv()` then raises `TunnelClosed`.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any, Literal, cast

from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

from transport.connection import (
    CoalescingProtocol,
    ScheduledQuicConnection,
    adopt,
    connect_quic,
)
from transport.masque.capsule import (
    CapsuleError,
    CapsuleParser,
    DatagramPayloadError,
    parse_udp_payload,
    udp_capsule,
    udp_payload,
)
from transport.masque.connect_udp import template_path
from transport.masque.proxy import datagram_limit
from transport.schedulers import StreamSpec
from transport.udp import widen_receive_buffer

Mode = Literal["capsule", "datagram"]

_RECV_QUEUE = 1024
"""Payloads `recv()` holds before dropping (UDP semantics), while no local peer takes them."""


class TunnelRefused(Exception):
    """The proxy answered the CONNECT-UDP request with a status other than 2xx."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        super().__init__(f"proxy refused the tunnel: {status}")
        self.status = status
        self.headers = headers


class TunnelClosed(Exception):
    """The tunnel's stream or connection ended."""


class _ProxyClientProtocol(CoalescingProtocol):
    def __init__(self, quic: Any, *args: Any, scheduler: str, **kwargs: Any) -> None:
        super().__init__(adopt(quic, scheduler), *args, **kwargs)
        self.h3 = H3Connection(self._quic, enable_webtransport=True)
        self.tunnels: dict[int, Tunnel] = {}

    @property
    def quic(self) -> ScheduledQuicConnection:
        return cast(ScheduledQuicConnection, self._quic)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            why = f"connection closed: {event.reason_phrase or event.error_code}"
            for tunnel in list(self.tunnels.values()):
                tunnel._ended(why)
            return
        if isinstance(event, StreamReset) and (reset := self.tunnels.get(event.stream_id)):
            reset._ended(f"stream reset by the proxy ({event.error_code:#x})")
        for h3_event in self.h3.handle_event(event):
            stream_id = getattr(h3_event, "stream_id", None)
            if stream_id is not None and (owner := self.tunnels.get(stream_id)) is not None:
                owner._h3_event(h3_event)


class _LocalProtocol(asyncio.DatagramProtocol):
    def __init__(self, tunnel: Tunnel) -> None:
        self.tunnel = tunnel

    def datagram_received(self, data: bytes, addr: Any) -> None:
        tunnel = self.tunnel
        if tunnel.local_peer is None:
            tunnel.local_peer = addr
        elif addr != tunnel.local_peer:
            return
        tunnel.send(data)


class MasqueClient:
    """One QUIC connection to the CONNECT-UDP proxy at `host:port`, for many tunnels.

    `scheduler` orders the tunnels' streams (a registry name of `transport.schedulers`);
    `max_datagram_size` is the outer connection's QUIC packet size (aioquic's 1,200 by default;
    larger leaves room for an inner connection's 1,200-byte packets as HTTP/3 datagrams);
    `congestion_control` is aioquic's name for it ("reno", its default, or "cubic").

    `idle_timeout_s`: a proxy that dies sends no CONNECTION_CLOSE, so its tunnels would wait
    out aioquic's 60 s idle timeout. Here the connection's idle timeout is shorter and a PING
    goes out every third of it, so a live proxy keeps a quiet tunnel open and a dead one ends
    every tunnel (`TunnelClosed`) within about `idle_timeout_s`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        key: str | None = None,
        verify: bool | str | Path = True,
        server_name: str | None = None,
        scheduler: str = "rr",
        max_datagram_size: int | None = None,
        congestion_control: str = "reno",
        idle_timeout_s: float = 10.0,
    ) -> None:
        self.host, self.port = host, port
        self.key = key
        self.scheduler = scheduler
        self.idle_timeout_s = idle_timeout_s
        self._configuration = QuicConfiguration(
            is_client=True, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536,
            congestion_control_algorithm=congestion_control, idle_timeout=idle_timeout_s,
        )  # fmt: skip
        if max_datagram_size is not None:
            self._configuration.max_datagram_size = max_datagram_size
        if verify is False:
            self._configuration.verify_mode = ssl.CERT_NONE
        elif verify is not True:
            self._configuration.load_verify_locations(str(verify))
        self._configuration.server_name = server_name or host
        self.datagram_limit = datagram_limit(self._configuration)
        self._context: Any = None
        self._keep_alive: asyncio.Task[None] | None = None
        self.protocol: _ProxyClientProtocol | None = None

    async def __aenter__(self) -> MasqueClient:
        try:
            await self.connect()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def connect(self) -> None:
        def create_protocol(quic: Any, **kwargs: Any) -> _ProxyClientProtocol:
            return _ProxyClientProtocol(quic, scheduler=self.scheduler, **kwargs)

        self._context = connect_quic(
            self.host, self.port, configuration=self._configuration,
            create_protocol=create_protocol,
        )  # fmt: skip
        protocol = await self._context.__aenter__()
        assert isinstance(protocol, _ProxyClientProtocol)
        self.protocol = protocol
        self._keep_alive = asyncio.get_running_loop().create_task(self._ping_while_open())

    async def _ping_while_open(self) -> None:
        uid = 0
        while (protocol := self.protocol) is not None and not protocol._closed.is_set():
            await asyncio.sleep(self.idle_timeout_s / 3)
            uid += 1
            protocol.quic.send_ping(uid)
            protocol.transmit()

    async def open_tunnel(
        self,
        target_host: str,
        target_port: int,
        *,
        urgency: int | None = None,
        spec: StreamSpec | None = None,
        mode: Mode = "capsule",
        local_port: int = 0,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
        timeout_s: float | None = 30.0,
    ) -> Tunnel:
        """A tunnel to `target_host:target_port`, open (its local socket bound) once the proxy
        said 2xx; `TunnelRefused` otherwise, `TunnelClosed` if the connection went first.

        A connection holds as many tunnels at once as the proxy allows (QUIC's MAX_STREAMS;
        `MasqueProxy`'s `max_tunnels`, 128 by default); past that a request waits for one to
        close. `TimeoutError` if no answer came within `timeout_s` (None: wait for ever), with
        the count of open tunnels and the proxy's limit when that is why."""
        protocol = self.protocol
        if protocol is None:
            raise RuntimeError("MasqueClient is not connected; use `async with`")
        if urgency is not None and not 0 <= urgency <= 7:
            raise ValueError(f"an RFC 9218 urgency is 0 to 7, not {urgency}")
        stream_id = protocol.quic.get_next_available_stream_id()
        tunnel = Tunnel(self, stream_id, mode)
        protocol.tunnels[stream_id] = tunnel
        if spec is None and urgency is not None:
            spec = StreamSpec(priority=7 - urgency)
        if spec is not None:
            protocol.quic.set_stream_spec(stream_id, spec)
        headers = [
            (b":method", b"CONNECT"),
            (b":protocol", b"connect-udp"),
            (b":scheme", b"https"),
            (b":authority", f"{self.host}:{self.port}".encode()),
            (b":path", template_path(target_host, target_port).encode()),
            (b"capsule-protocol", b"?1"),
        ]
        if self.key is not None:
            headers.append((b"authorization", f"Bearer {self.key}".encode()))
        if urgency is not None:
            headers.append((b"priority", f"u={urgency}".encode()))
        protocol.h3.send_headers(stream_id, headers + (extra_headers or []), end_stream=False)
        protocol.transmit()
        try:
            await asyncio.wait_for(tunnel._open(local_port), timeout_s)
        except TimeoutError:
            limit = protocol.quic._remote_max_streams_bidi
            waiting = stream_id // 4 >= limit  # client bidi stream n is id 4n
            await tunnel.aclose()
            why = (
                f": this connection is at the proxy's limit of {limit} tunnels at once"
                if waiting else ""
            )  # fmt: skip
            raise TimeoutError(f"no answer to CONNECT-UDP within {timeout_s} s{why}") from None
        except BaseException:
            await tunnel.aclose()
            raise
        return tunnel

    async def aclose(self) -> None:
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            self._keep_alive = None
        protocol = self.protocol
        if protocol is not None:
            for tunnel in list(protocol.tunnels.values()):
                await tunnel.aclose()
        if self._context is not None:
            context, self._context = self._context, None
            if protocol is not None:
                protocol.close(error_code=ErrorCode.H3_NO_ERROR)
            await context.__aexit__(None, None, None)


class Tunnel:
    """One CONNECT-UDP flow on a `MasqueClient`'s connection (`MasqueClient.open_tunnel`)."""

    def __init__(self, client: MasqueClient, stream_id: int, mode: Mode) -> None:
        self.client = client
        self.stream_id = stream_id
        self.mode = mode
        self._local: asyncio.DatagramTransport | None = None
        self._parser = CapsuleParser()
        self._response: asyncio.Future[tuple[int, dict[str, str]]] = (
            asyncio.get_running_loop().create_future()
        )
        self._received: asyncio.Queue[bytes | None] = asyncio.Queue(_RECV_QUEUE)
        self.local_peer: Any = None
        self.closed: str | None = None
        """Why the tunnel ended, once it has."""
        self.sent_capsules = 0
        self.sent_datagrams = 0
        self.received_capsules = 0
        self.received_datagrams = 0

    @property
    def local_address(self) -> tuple[str, int]:
        if self._local is None:
            raise RuntimeError("the tunnel is not open")
        address = self._local.get_extra_info("sockname")
        return address[0], address[1]

    async def _open(self, local_port: int) -> None:
        status, fields = await self._response
        if not 200 <= status < 300:
            raise TunnelRefused(status, fields)
        self._local, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _LocalProtocol(self), local_addr=("127.0.0.1", local_port)
        )
        widen_receive_buffer(self._local.get_extra_info("socket"))

    def send(self, data: bytes) -> None:
        """Send one UDP payload to the target (dropped once the tunnel has closed)."""
        protocol = self.client.protocol
        if protocol is None or self.closed is not None:
            return
        payload = udp_payload(0, data)
        if self.mode == "datagram" and len(payload) <= self.client.datagram_limit:
            protocol.h3.send_datagram(self.stream_id, payload)
            self.sent_datagrams += 1
        else:
            protocol.h3.send_data(self.stream_id, udp_capsule(data), end_stream=False)
            self.sent_capsules += 1
        protocol.transmit_soon()

    async def recv(self) -> bytes:
        """The next UDP payload from the target that no local peer took."""
        if self.closed is not None and self._received.empty():
            raise TunnelClosed(self.closed)
        data = await self._received.get()
        if data is None:
            raise TunnelClosed(self.closed or "closed")
        return data

    async def aclose(self) -> None:
        """End the stream (the proxy then closes its UDP socket) and the local socket."""
        protocol = self.client.protocol
        if protocol is not None and self.closed is None:
            try:
                protocol.h3.send_data(self.stream_id, b"", end_stream=True)
                protocol.transmit()
            except Exception:  # the stream may already be finished or reset
                pass
            await asyncio.sleep(0.01)  # let the FIN and its acknowledgement leave
        self._ended("closed by the client")
        if protocol is not None:
            protocol.tunnels.pop(self.stream_id, None)

    def _deliver(self, http_datagram_payload: bytes) -> None:
        try:
            data = parse_udp_payload(http_datagram_payload)
        except DatagramPayloadError:
            return
        if data is None:
            return
        if self._local is not None and self.local_peer is not None:
            self._local.sendto(data, self.local_peer)
        elif not self._received.full():
            self._received.put_nowait(data)

    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            if not self._response.done():
                named = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
                status = int(named.pop(":status", "0"))
                if 100 <= status < 200:
                    return
                self._response.set_result((status, named))
            if event.stream_ended:
                self._ended("the proxy ended the stream")
        elif isinstance(event, DataReceived):
            try:
                capsules = self._parser.feed(event.data)
                if event.stream_ended:
                    self._parser.close()
            except CapsuleError as error:
                self._ended(f"malformed capsules from the proxy: {error}")
                protocol = self.client.protocol
                if protocol is not None:
                    protocol.quic.reset_stream(self.stream_id, ErrorCode.H3_MESSAGE_ERROR)
                    protocol.transmit()
                return
            for capsule in capsules:
                if capsule.is_datagram:
                    self.received_capsules += 1
                    self._deliver(capsule.value)
            if event.stream_ended:
                self._ended("the proxy ended the stream")
        elif isinstance(event, DatagramReceived):
            self.received_datagrams += 1
            self._deliver(event.data)

    def _ended(self, why: str) -> None:
        if self.closed is not None:
            return
        self.closed = why
        if not self._response.done():
            self._response.set_exception(TunnelClosed(why))
        if self._local is not None:
            self._local.close()
        if self._received.full():
            self._received.get_nowait()
        self._received.put_nowait(None)


class UdpTunnel:
    """One tunnel on a connection of its own: `async with UdpTunnel(host, port, target_host,
    target_port, key=..., verify=...) as t:` then `t.local_address`, `t.send`, `t.recv`."""

    def __init__(
        self,
        host: str,
        port: int,
        target_host: str,
        target_port: int,
        *,
        key: str | None = None,
        verify: bool | str | Path = True,
        server_name: str | None = None,
        mode: Mode = "capsule",
        local_port: int = 0,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
        max_datagram_size: int | None = None,
    ) -> None:
        self.client = MasqueClient(
            host, port, key=key, verify=verify, server_name=server_name,
            max_datagram_size=max_datagram_size,
        )  # fmt: skip
        self._target = target_host, target_port
        self._options: dict[str, Any] = {
            "mode": mode, "local_port": local_port, "extra_headers": extra_headers
        }  # fmt: skip
        self.tunnel: Tunnel | None = None

    async def __aenter__(self) -> Tunnel:
        await self.open()
        assert self.tunnel is not None
        return self.tunnel

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> Tunnel:
        try:
            await self.client.connect()
            self.tunnel = await self.client.open_tunnel(*self._target, **self._options)
        except BaseException:
            await self.aclose()
            raise
        return self.tunnel

    async def aclose(self) -> None:
        await self.client.aclose()
