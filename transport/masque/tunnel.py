"""The client side of CONNECT-UDP (RFC 9298): `UdpTunnel`, one UDP flow through a MASQUE proxy.

    async with UdpTunnel("127.0.0.1", proxy_port, "10.0.0.5", 443, key=KEY, verify=cert) as t:
        t.local_address        # ("127.0.0.1", port): point any UDP client here, e.g. an inner
                               # aioquic connection, and its packets go to 10.0.0.5:443
        t.send(b"ping")        # or drive the flow directly:
        reply = await t.recv()

It opens one QUIC connection to the proxy with HTTP/3 (`H3Connection(quic,
enable_webtransport=True)`: SETTINGS_H3_DATAGRAM, with `max_datagram_frame_size` set), sends the
Extended CONNECT request (`:protocol connect-udp`, the default template's path, `capsule-protocol:
?1`, `authorization: Bearer KEY`), and waits for the answer: anything but 2xx raises
`TunnelRefused` with the status. Then it opens a UDP socket on 127.0.0.1 (port 0 unless told); the
first address that sends to it becomes the tunnel's local peer, and other senders are ignored.

Each UDP payload goes to the proxy as a DATAGRAM capsule (context 0) on the request stream
(`mode="capsule"`, the default: reliable and ordered, no size limit, works on any HTTP/3 path), or
as an HTTP/3 datagram (`mode="datagram"`: unreliable, like UDP, for payloads up to
`MAX_H3_DATAGRAM_PAYLOAD`; larger ones still go as capsules). Whatever comes back, capsule or
datagram, goes to the local peer (or to `recv()` before any local peer has sent). An inner QUIC
connection needs nothing from aioquic's internals: it is an ordinary UDP client of
`local_address`.

The tunnel ends when the proxy ends or resets the stream, when its connection closes, or on
`close()`/leaving the `async with`; `recv()` then raises `TunnelClosed`.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any, Literal

from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

from transport.masque.capsule import (
    CapsuleError,
    CapsuleParser,
    DatagramPayloadError,
    parse_udp_payload,
    udp_capsule,
    udp_payload,
)
from transport.masque.connect_udp import template_path
from transport.masque.proxy import MAX_H3_DATAGRAM_PAYLOAD

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


class _ProxyClientProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic, enable_webtransport=True)
        self.tunnel: UdpTunnel | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            if self.tunnel is not None:
                self.tunnel._ended(f"connection closed: {event.reason_phrase or event.error_code}")
            return
        tunnel = self.tunnel
        if (
            isinstance(event, StreamReset)
            and tunnel is not None
            and event.stream_id == tunnel.stream_id
        ):
            tunnel._ended(f"stream reset by the proxy ({event.error_code:#x})")
        for h3_event in self.h3.handle_event(event):
            if self.tunnel is not None:
                self.tunnel._h3_event(h3_event)


class _LocalProtocol(asyncio.DatagramProtocol):
    def __init__(self, tunnel: UdpTunnel) -> None:
        self.tunnel = tunnel

    def datagram_received(self, data: bytes, addr: Any) -> None:
        tunnel = self.tunnel
        if tunnel.local_peer is None:
            tunnel.local_peer = addr
        elif addr != tunnel.local_peer:
            return
        tunnel.send(data)


class UdpTunnel:
    """One CONNECT-UDP tunnel to `target_host:target_port` through the proxy at `host:port`."""

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
        mode: Literal["capsule", "datagram"] = "capsule",
        local_port: int = 0,
        extra_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.target_host, self.target_port = target_host, target_port
        self.key = key
        self.mode = mode
        self._local_port = local_port
        self._extra_headers = extra_headers or []
        self._configuration = QuicConfiguration(
            is_client=True, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536
        )
        if verify is False:
            self._configuration.verify_mode = ssl.CERT_NONE
        elif verify is not True:
            self._configuration.load_verify_locations(str(verify))
        self._configuration.server_name = server_name or host
        self._context: Any = None
        self._protocol: _ProxyClientProtocol | None = None
        self._local: asyncio.DatagramTransport | None = None
        self._parser = CapsuleParser()
        self._response: asyncio.Future[tuple[int, dict[str, str]]] | None = None
        self._received: asyncio.Queue[bytes | None] = asyncio.Queue(_RECV_QUEUE)
        self.stream_id = -1
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
            raise RuntimeError("UdpTunnel is not open; use `async with`")
        address = self._local.get_extra_info("sockname")
        return address[0], address[1]

    async def __aenter__(self) -> UdpTunnel:
        try:
            await self.open()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        self._response = loop.create_future()
        self._context = connect(
            self.host, self.port, configuration=self._configuration,
            create_protocol=_ProxyClientProtocol, wait_connected=True,
        )  # fmt: skip
        protocol = await self._context.__aenter__()
        assert isinstance(protocol, _ProxyClientProtocol)
        self._protocol = protocol
        protocol.tunnel = self
        self.stream_id = protocol._quic.get_next_available_stream_id()
        headers = [
            (b":method", b"CONNECT"),
            (b":protocol", b"connect-udp"),
            (b":scheme", b"https"),
            (b":authority", f"{self.host}:{self.port}".encode()),
            (b":path", template_path(self.target_host, self.target_port).encode()),
            (b"capsule-protocol", b"?1"),
        ]
        if self.key is not None:
            headers.append((b"authorization", f"Bearer {self.key}".encode()))
        protocol.h3.send_headers(self.stream_id, headers + self._extra_headers, end_stream=False)
        protocol.transmit()
        status, fields = await self._response
        if not 200 <= status < 300:
            raise TunnelRefused(status, fields)
        self._local, _ = await loop.create_datagram_endpoint(
            lambda: _LocalProtocol(self), local_addr=("127.0.0.1", self._local_port)
        )

    def send(self, data: bytes) -> None:
        """Send one UDP payload to the target (dropped once the tunnel has closed)."""
        protocol = self._protocol
        if protocol is None or self.closed is not None:
            return
        payload = udp_payload(0, data)
        if self.mode == "datagram" and len(payload) <= MAX_H3_DATAGRAM_PAYLOAD:
            protocol.h3.send_datagram(self.stream_id, payload)
            self.sent_datagrams += 1
        else:
            protocol.h3.send_data(self.stream_id, udp_capsule(data), end_stream=False)
            self.sent_capsules += 1
        protocol.transmit()

    async def recv(self) -> bytes:
        """The next UDP payload from the target that no local peer took."""
        if self.closed is not None and self._received.empty():
            raise TunnelClosed(self.closed)
        data = await self._received.get()
        if data is None:
            raise TunnelClosed(self.closed or "closed")
        return data

    async def aclose(self) -> None:
        protocol = self._protocol
        if protocol is not None and self.closed is None and self.stream_id >= 0:
            try:
                protocol.h3.send_data(self.stream_id, b"", end_stream=True)
                protocol.transmit()
            except Exception:  # the stream may already be finished or reset
                pass
            await asyncio.sleep(0.01)  # let the FIN and its acknowledgement leave
        self._ended("closed by the client")
        if self._context is not None:
            context, self._context = self._context, None
            if protocol is not None:
                protocol.close(error_code=ErrorCode.H3_NO_ERROR)
            await context.__aexit__(None, None, None)

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
        if getattr(event, "stream_id", None) != self.stream_id:
            return
        if isinstance(event, HeadersReceived):
            if self._response is not None and not self._response.done():
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
                if self._protocol is not None:
                    self._protocol._quic.reset_stream(self.stream_id, ErrorCode.H3_MESSAGE_ERROR)
                    self._protocol.transmit()
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
        if self._response is not None and not self._response.done():
            self._response.set_exception(TunnelClosed(why))
        if self._local is not None:
            self._local.close()
        if self._received.full():
            self._received.get_nowait()
        self._received.put_nowait(None)
