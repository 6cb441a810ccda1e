"""An RFC 9298 CONNECT-UDP proxy on plain aioquic 1.7.2 (no fork): `MasqueProxy`.

Each QUIC connection gets an `H3Connection(quic, enable_webtransport=True)`. aioquic always
announces SETTINGS_ENABLE_CONNECT_PROTOCOL (RFC 9220's Extended CONNECT, so `:protocol` is
accepted); `enable_webtransport` adds SETTINGS_H3_DATAGRAM (RFC 9297), which in turn needs the
`max_datagram_frame_size` transport parameter, set here on both ends. (It also announces
ENABLE_WEBTRANSPORT; we never act on WebTransport streams.)

A request is handled in this order, so that nothing about targets leaks to a caller without a key:

1. `TunnelAccess.grant` (`access.py`): `authorization: Bearer <key>` missing, not Bearer, or an
   unknown key -> 401 (with `www-authenticate: Bearer`); an `x-qos-class` the key's tier does
   not grant -> 403.
2. `parse_connect_udp`: the request must be an Extended CONNECT for `connect-udp` on the default
   template with `capsule-protocol: ?1`; otherwise its status (400, or 405 with `allow: CONNECT`).
3. The key's `AllowList` must allow the target -> else 403. A key mapped to an empty list (a tier
   without `tunnels:` in models.yaml) has no tunnel rights at all. There is no wildcard host, so
   this is never an open relay.
4. A connected UDP socket (asyncio datagram endpoint) to the target; if that fails (say the name
   does not resolve) -> 502. Only then 200 with `capsule-protocol: ?1`.

No UDP socket is opened before step 4 (`MasqueProxy.sockets_opened` counts them).

Scheduling: every client connection is a `ScheduledQuicConnection` (`scheduler=`, as the HTTP/3
servers here), and each tunnel's stream is tagged with its grant's `StreamSpec` (its `priority`
header, or its owner's class) when its request arrives. In capsule mode a tunnel's packets to the
client are that stream's bytes, so the scheduler orders tunnels against each other exactly as it
orders requests; HTTP/3 datagrams are outside any stream and go first (aioquic sends DATAGRAM
frames before stream data). The client orders its own uploads the same way (`tunnel.py`).

Relaying:

- client -> target: DATAGRAM capsules (context 0) in the request stream's DATA, cut by
  `CapsuleParser`; and HTTP/3 datagrams (`DatagramReceived` with the stream's id). Other capsule
  types and other context ids are dropped silently (RFC 9297 §3.2, RFC 9298 §4). A malformed
  capsule stream resets the stream with H3_MESSAGE_ERROR.
- target -> client: in the mode the client last used. A tunnel starts in capsule mode and
  switches to HTTP/3 datagrams once the client sent one; a payload too large for one QUIC
  DATAGRAM frame (`datagram_limit`: 1,100 bytes at aioquic's default 1,200-byte packets) still
  goes as a capsule, because aioquic never sends an over-large datagram and it blocks every
  datagram queued behind it (aioquic 1.7.2, checked on the development VM). An inner QUIC
  connection's packets are 1,200 bytes, so they ride as datagrams only where the outer
  connection's packets are larger (`max_datagram_size`, say 1,452 on a path with a 1,500-byte
  MTU).

The UDP socket closes when the client ends or resets the stream, when the connection closes, or
when the proxy closes. Packets that arrive before the socket is open (a client may send capsules
right after its request) wait in a short queue (`_EARLY_PACKETS`).

Not done: priority updates (RFC 9218's PRIORITY_UPDATE frame; aioquic has no RFC 9218), per-key
rate or byte limits,
send-side backpressure (a flood from the target grows the stream's send buffer; UDP would drop),
other URI templates, and context ids other than 0 (compression, RFC 9298 §4 extensions).

CLI: `python -m transport.masque.proxy --port 4433 --allow 127.0.0.1:5353 --key KEY`, or with
models.yaml's tiers and keys, `python -m transport.frontend --masque 4434`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

from transport.connection import (
    CoalescingProtocol,
    ScheduledQuicConnection,
    adopt,
    serve_quic,
    udp_transport,
)
from transport.masque.access import TunnelAccess
from transport.masque.capsule import (
    CapsuleError,
    CapsuleParser,
    DatagramPayloadError,
    parse_udp_payload,
    udp_capsule,
    udp_payload,
)
from transport.masque.connect_udp import (
    AllowList,
    ConnectUdpError,
    UdpTarget,
    parse_connect_udp,
)
from transport.qos import QosRejected
from transport.udp import open_udp

log = logging.getLogger(__name__)

_DATAGRAM_HEADROOM = 100
"""Bytes of a QUIC packet that an HTTP/3 datagram cannot use: the short header, the AEAD tag,
the DATAGRAM frame's type and length, and the quarter stream id. aioquic drops nothing over
`max_datagram_size - 30` but never sends it either, and it blocks the queue behind it (aioquic
1.7.2, checked on the development VM), so stay clearly under."""

MAX_H3_DATAGRAM_PAYLOAD = 1200 - _DATAGRAM_HEADROOM
"""`datagram_limit` at aioquic's default packet size."""


def datagram_limit(configuration: QuicConfiguration) -> int:
    """The largest HTTP Datagram Payload sent as a QUIC DATAGRAM frame on a connection with this
    configuration; larger ones go as capsules."""
    return configuration.max_datagram_size - _DATAGRAM_HEADROOM


_EARLY_PACKETS = 64
"""UDP payloads held per tunnel while its socket is still opening; more are dropped."""


def server_configuration(
    certfile: Path | str,
    keyfile: Path | str,
    max_datagram_size: int | None = None,
    congestion_control: str = "reno",
) -> QuicConfiguration:
    configuration = QuicConfiguration(
        is_client=False, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536,
        congestion_control_algorithm=congestion_control,
    )  # fmt: skip
    if max_datagram_size is not None:
        configuration.max_datagram_size = max_datagram_size
    configuration.load_cert_chain(str(certfile), str(keyfile))
    return configuration


class _TargetProtocol(asyncio.DatagramProtocol):
    def __init__(self, tunnel: _Tunnel) -> None:
        self.tunnel = tunnel

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.tunnel.to_client(data)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable and the like: UDP carries on, and so does the tunnel.
        log.debug("tunnel to %s: %s", self.tunnel.target, exc)


class _Tunnel:
    """One CONNECT-UDP stream and its UDP socket."""

    def __init__(self, protocol: _ProxyProtocol, stream_id: int, target: UdpTarget) -> None:
        self.protocol = protocol
        self.stream_id = stream_id
        self.target = target
        self.parser = CapsuleParser()
        self.transport: asyncio.DatagramTransport | None = None
        self.early: list[bytes] = []
        self.datagram_mode = False
        self.closed = False
        self.to_target_count = 0
        self.to_client_count = 0

    def from_client(self, payload: bytes) -> None:
        if self.closed:
            return
        if self.transport is None:
            if len(self.early) < _EARLY_PACKETS:
                self.early.append(payload)
            return
        self.to_target_count += 1
        self.transport.sendto(payload)

    def opened(self, transport: asyncio.DatagramTransport) -> None:
        self.transport = transport
        early, self.early = self.early, []
        for payload in early:
            self.from_client(payload)

    def to_client(self, data: bytes) -> None:
        if self.closed:
            return
        self.to_client_count += 1
        h3 = self.protocol.h3
        payload = udp_payload(0, data)
        if self.datagram_mode and len(payload) <= self.protocol.proxy.datagram_limit:
            h3.send_datagram(self.stream_id, payload)
        else:
            h3.send_data(self.stream_id, udp_capsule(data), end_stream=False)
        self.protocol.transmit_soon()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            self.transport.close()
            self.protocol.proxy.sockets_closed += 1


class _ProxyProtocol(CoalescingProtocol):
    def __init__(self, quic: Any, *args: Any, proxy: MasqueProxy, **kwargs: Any) -> None:
        super().__init__(adopt(quic, proxy.scheduler), *args, **kwargs)
        # aioquic has no setting for it (as in transport.http3): a tunnel is a stream, so this
        # is how many tunnels one client connection may hold open at once.
        limit = self._quic._local_max_streams_bidi
        limit.value = limit.sent = proxy.max_tunnels
        self.proxy = proxy
        self.h3 = H3Connection(self._quic, enable_webtransport=True)
        self.tunnels: dict[int, _Tunnel] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            for tunnel in self.tunnels.values():
                tunnel.close()
            self.tunnels.clear()
            self.proxy._protocols.discard(self)
            return
        if isinstance(event, StreamReset):
            reset = self.tunnels.pop(event.stream_id, None)
            if reset is not None:
                reset.close()
        for h3_event in self.h3.handle_event(event):
            self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            self._request(event)
        elif isinstance(event, DataReceived):
            tunnel = self.tunnels.get(event.stream_id)
            if tunnel is None:
                return
            try:
                capsules = tunnel.parser.feed(event.data)
                if event.stream_ended:
                    tunnel.parser.close()
            except CapsuleError as error:
                log.info("tunnel to %s: %s", tunnel.target, error)
                self._end(tunnel, reset=ErrorCode.H3_MESSAGE_ERROR)
                return
            for capsule in capsules:
                if capsule.is_datagram:
                    self._from_client(tunnel, capsule.value)
            if event.stream_ended:
                self._end(tunnel)
        elif isinstance(event, DatagramReceived):
            tunnel = self.tunnels.get(event.stream_id)
            if tunnel is not None:
                tunnel.datagram_mode = True
                self._from_client(tunnel, event.data)

    def _from_client(self, tunnel: _Tunnel, http_datagram_payload: bytes) -> None:
        try:
            data = parse_udp_payload(http_datagram_payload)
        except DatagramPayloadError:
            return
        if data is not None:
            tunnel.from_client(data)

    def _end(self, tunnel: _Tunnel, reset: int | None = None) -> None:
        self.tunnels.pop(tunnel.stream_id, None)
        tunnel.close()
        if reset is not None or tunnel.transport is None:
            # Before its 200 the stream has no response headers, so it cannot just end.
            code = reset if reset is not None else ErrorCode.H3_REQUEST_CANCELLED
            self._quic.reset_stream(tunnel.stream_id, code)
            if reset is not None:
                self._quic.stop_stream(tunnel.stream_id, code)
        else:
            self.h3.send_data(tunnel.stream_id, b"", end_stream=True)
        self.transmit()

    def _respond(
        self, stream_id: int, status: int, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        headers = [(b":status", str(status).encode())] + (extra or [])
        self.h3.send_headers(stream_id, headers, end_stream=status >= 300)
        if status >= 300:
            # The response is complete, so stop reading the request (RFC 9114 §4.1): a refused
            # client cannot keep pushing capsules at us.
            self._quic.stop_stream(stream_id, ErrorCode.H3_NO_ERROR)
        self.transmit()

    def _request(self, event: HeadersReceived) -> None:
        stream_id = event.stream_id
        if stream_id in self.tunnels:
            return  # trailers on a tunnel: nothing to do
        headers = event.headers
        named = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        if sum(1 for name, _ in headers if name == b"authorization") > 1:
            named["authorization"] = ""  # which one would count? Neither: 401
        try:
            grant = self.proxy.access.grant(named, self._loop.time())
        except QosRejected as denied:
            self.proxy.refused[denied.status] = self.proxy.refused.get(denied.status, 0) + 1
            extra = [(b"www-authenticate", b"Bearer")] if denied.status == 401 else []
            self._respond(stream_id, denied.status, extra)
            return
        try:
            target = parse_connect_udp(headers)
            if event.stream_ended:
                raise ConnectUdpError(400, "a CONNECT-UDP request must leave its stream open")
        except ConnectUdpError as error:
            self.proxy.refused[error.status] = self.proxy.refused.get(error.status, 0) + 1
            extra = [(b"allow", b"CONNECT")] if error.status == 405 else []
            self._respond(stream_id, error.status, extra)
            return
        if not grant.allow.allows(target):
            self.proxy.refused[403] = self.proxy.refused.get(403, 0) + 1
            self._respond(stream_id, 403)
            return
        # Tagged now, so that the 200 and every capsule after it are scheduled as the tunnel's.
        cast(ScheduledQuicConnection, self._quic).set_stream_spec(stream_id, grant.spec)
        tunnel = _Tunnel(self, stream_id, target)
        self.tunnels[stream_id] = tunnel
        task = asyncio.get_running_loop().create_task(self._open(tunnel))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open(self, tunnel: _Tunnel) -> None:
        try:
            transport = await open_udp(
                _TargetProtocol(tunnel), tunnel.target.host, tunnel.target.port, connect=True
            )
        except OSError as error:
            log.info("tunnel to %s: cannot open a socket: %s", tunnel.target, error)
            self.tunnels.pop(tunnel.stream_id, None)
            tunnel.closed = True
            self.proxy.refused[502] = self.proxy.refused.get(502, 0) + 1
            self._respond(tunnel.stream_id, 502)
            return
        self.proxy.sockets_opened += 1
        if tunnel.closed:  # the stream ended while the socket was opening
            transport.close()
            self.proxy.sockets_closed += 1
            return
        self._respond(tunnel.stream_id, 200, [(b"capsule-protocol", b"?1")])
        tunnel.opened(transport)


class MasqueProxy:
    """`async with MasqueProxy(access, certfile=..., keyfile=...) as proxy:` serves on
    `proxy.port`.

    `access`: a `TunnelAccess` (`TunnelAccess.from_deployment` for models.yaml's tiers), or a
    mapping of each API key to the targets it may reach (an empty `AllowList` for a key that may
    open no tunnel). `scheduler` orders the tunnels' streams on every client connection;
    `max_datagram_size` is the QUIC packet size towards clients (aioquic's 1,200 by default);
    `congestion_control` is aioquic's name for it ("reno", its default, or "cubic");
    `max_tunnels` is how many tunnels one client connection may have open at once (QUIC's
    MAX_STREAMS: a client past it waits for one to close)."""

    def __init__(
        self,
        access: TunnelAccess | Mapping[str, AllowList],
        *,
        certfile: Path | str,
        keyfile: Path | str,
        host: str = "127.0.0.1",
        port: int = 0,
        scheduler: str = "rr",
        max_datagram_size: int | None = None,
        congestion_control: str = "reno",
        max_tunnels: int = 128,
    ) -> None:
        self.access = access if isinstance(access, TunnelAccess) else TunnelAccess(access)
        self.scheduler = scheduler
        self.max_tunnels = max_tunnels
        self.host, self.port = host, port
        self._configuration = server_configuration(
            certfile, keyfile, max_datagram_size, congestion_control
        )
        self.datagram_limit = datagram_limit(self._configuration)
        self._server: QuicServer | None = None
        self._protocols: set[_ProxyProtocol] = set()
        self.sockets_opened = 0
        """UDP sockets opened towards targets, ever."""
        self.sockets_closed = 0
        self.refused: dict[int, int] = {}
        """Requests answered with each refusal status."""

    @property
    def open_tunnels(self) -> int:
        return sum(len(p.tunnels) for p in self._protocols)

    async def start(self) -> None:
        def create_protocol(*args: Any, **kwargs: Any) -> _ProxyProtocol:
            protocol = _ProxyProtocol(*args, proxy=self, **kwargs)
            self._protocols.add(protocol)
            return protocol

        self._server = await serve_quic(
            self.host, self.port, configuration=self._configuration,
            create_protocol=create_protocol,
        )  # fmt: skip
        self.port = udp_transport(self._server).get_extra_info("sockname")[1]

    def close(self) -> None:
        for protocol in list(self._protocols):
            for tunnel in protocol.tunnels.values():
                tunnel.close()
            protocol.tunnels.clear()
            protocol.close(error_code=ErrorCode.H3_NO_ERROR)
        self._protocols.clear()
        if self._server is not None:
            self._server.close()
            self._server = None

    async def __aenter__(self) -> MasqueProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


async def _serve(args: argparse.Namespace) -> None:
    from transport.tls import ensure_certificate

    if args.cert and args.key_file:
        certfile, keyfile = Path(args.cert), Path(args.key_file)
    else:
        certfile, keyfile = ensure_certificate()
    allow = AllowList.parse(args.allow)
    proxy = MasqueProxy(
        {key: allow for key in args.key},
        certfile=certfile, keyfile=keyfile, host=args.host, port=args.port,
    )  # fmt: skip
    await proxy.start()
    log.warning("CONNECT-UDP proxy on %s:%d (UDP), %d key(s)", args.host, proxy.port, len(args.key))
    try:
        await asyncio.Event().wait()
    finally:
        proxy.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4433)
    parser.add_argument(
        "--allow", action="append", default=[], help="host:port or host:* (repeatable)"
    )
    parser.add_argument(
        "--key", action="append", required=True, help="an API key allowed the --allow targets"
    )
    parser.add_argument("--cert", help="certificate PEM (default: transport.tls's .certs/)")
    parser.add_argument("--key-file", help="private key PEM for --cert")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
