"""MASQUE CONNECT-UDP end to end on loopback: `transport.masque.proxy.MasqueProxy` and
`transport.masque.tunnel.UdpTunnel` over real aioquic connections.

(a) a UDP flow through a tunnel reaches a UDP echo server and comes back, in capsule mode and in
HTTP/3 datagram mode, and the proxy's socket closes with the tunnel; (b) access control: 401
without a valid key, 403 for a key whose AllowList does not allow the target (or allows nothing),
400/405 for requests that are not a well-formed CONNECT-UDP, and no UDP socket opened for any of
them; (c) an inner HTTP/3 request (the repo's `Http3Client`) through the tunnel to the repo's
`Http3Server` with a trivial ASGI app. Certificates come from `transport.tls`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent

from tests.support.servers import ROOT, free_udp_port
from transport.client import Http3Client
from transport.http3 import Http3Server, Http3Settings
from transport.masque import AllowList
from transport.masque.proxy import MasqueProxy
from transport.masque.tunnel import MasqueClient, TunnelClosed, TunnelRefused, UdpTunnel
from transport.tls import ensure_certificate

KEY = "tunnel-key"
OTHER_KEY = "other-target-key"
NO_RIGHTS_KEY = "no-tunnel-key"


class _Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.seen = 0

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.seen += 1
        self.transport.sendto(b"echo:" + data, addr)


@asynccontextmanager
async def _echo_server() -> AsyncIterator[tuple[int, _Echo]]:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(_Echo, local_addr=("127.0.0.1", 0))
    try:
        yield transport.get_extra_info("sockname")[1], protocol
    finally:
        transport.close()


@asynccontextmanager
async def _proxy(allowed: list[str], scheduler: str = "rr") -> AsyncIterator[MasqueProxy]:
    cert, key = ensure_certificate()
    keys = {
        KEY: AllowList.parse(allowed),
        OTHER_KEY: AllowList.parse(["127.0.0.1:9"]),
        NO_RIGHTS_KEY: AllowList.parse([]),
    }
    async with MasqueProxy(keys, certfile=cert, keyfile=key, scheduler=scheduler) as proxy:
        yield proxy


def _tunnel(proxy: MasqueProxy, target_port: int, **kwargs: Any) -> UdpTunnel:
    cert, _ = ensure_certificate()
    return UdpTunnel("127.0.0.1", proxy.port, "127.0.0.1", target_port, verify=str(cert), **kwargs)


class _Local(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received.put_nowait(data)


async def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


# --- (a) a UDP flow through the tunnel ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["capsule", "datagram"])
async def test_a_udp_flow_reaches_the_echo_server_and_comes_back(mode: str) -> None:
    async def run() -> None:
        async with _echo_server() as (echo_port, echo), _proxy([f"127.0.0.1:{echo_port}"]) as proxy:
            async with _tunnel(proxy, echo_port, key=KEY, mode=mode) as tunnel:
                # A plain UDP client of the tunnel's local socket.
                loop = asyncio.get_running_loop()
                local, client = await loop.create_datagram_endpoint(
                    _Local, remote_addr=tunnel.local_address
                )
                try:
                    for i in range(20):
                        local.sendto(f"ping {i}".encode())
                        reply = await asyncio.wait_for(client.received.get(), 5)
                        assert reply == f"echo:ping {i}".encode()
                    big = bytes(range(256)) * 8  # 2 KiB: too big for a QUIC datagram
                    local.sendto(big)
                    assert await asyncio.wait_for(client.received.get(), 5) == b"echo:" + big
                finally:
                    local.close()
                assert echo.seen == 21
                assert proxy.sockets_opened == 1 and proxy.open_tunnels == 1
                if mode == "datagram":
                    # Small payloads went as HTTP/3 datagrams both ways, the big one as capsules.
                    assert tunnel.sent_datagrams == 20 and tunnel.sent_capsules == 1
                    assert tunnel.received_datagrams == 20 and tunnel.received_capsules == 1
                else:
                    assert tunnel.sent_datagrams == 0 and tunnel.received_datagrams == 0
                    assert tunnel.received_capsules == 21
            # The client ended its stream: the proxy closes the UDP socket.
            await _until(lambda: proxy.sockets_closed == 1 and proxy.open_tunnels == 0)

    await asyncio.wait_for(run(), 10)


async def test_send_and_recv_without_a_local_socket_client() -> None:
    async def run() -> None:
        async with (
            _echo_server() as (echo_port, _),
            _proxy([f"127.0.0.1:{echo_port}"]) as proxy,
            _tunnel(proxy, echo_port, key=KEY) as tunnel,
        ):
            tunnel.send(b"hello")
            assert await asyncio.wait_for(tunnel.recv(), 5) == b"echo:hello"

    await asyncio.wait_for(run(), 10)


async def test_closing_the_proxy_connection_closes_the_udp_socket() -> None:
    async def run() -> None:
        async with _echo_server() as (echo_port, _), _proxy([f"127.0.0.1:{echo_port}"]) as proxy:
            one = _tunnel(proxy, echo_port, key=KEY)
            tunnel = await one.open()
            try:
                assert proxy.open_tunnels == 1
                # Close the QUIC connection without ending the stream first.
                assert one.client.protocol is not None
                one.client.protocol.close()
                await _until(lambda: proxy.sockets_closed == 1 and proxy.open_tunnels == 0)
                with pytest.raises(TunnelClosed):
                    await asyncio.wait_for(tunnel.recv(), 5)
                assert tunnel.closed is not None
            finally:
                await one.aclose()

    await asyncio.wait_for(run(), 10)


async def test_a_malformed_capsule_stream_resets_the_tunnel_and_closes_its_socket() -> None:
    async def run() -> None:
        async with (
            _echo_server() as (echo_port, _),
            _proxy([f"127.0.0.1:{echo_port}"]) as proxy,
            _tunnel(proxy, echo_port, key=KEY) as tunnel,
        ):
            protocol = tunnel.client.protocol
            assert protocol is not None
            # A DATAGRAM capsule announcing 1 MiB: over the parser's limit, refused at once.
            protocol.h3.send_data(tunnel.stream_id, b"\x00\x80\x10\x00\x00", end_stream=False)
            protocol.transmit()
            await _until(lambda: tunnel.closed is not None)
            assert "reset" in (tunnel.closed or "")
            await _until(lambda: proxy.sockets_closed == 1 and proxy.open_tunnels == 0)

    await asyncio.wait_for(run(), 10)


class _Flood(asyncio.DatagramProtocol):
    """Once a `go` has come from each of two addresses, sends `count` payloads to each,
    alternating, in one burst: the proxy finds both tunnels' sockets full."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.peers: list[Any] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if data == b"go" and addr not in self.peers:
            self.peers.append(addr)
            if len(self.peers) == 2:
                asyncio.get_running_loop().create_task(self._flood())

    async def _flood(self) -> None:
        for i in range(self.count):
            for peer in self.peers:
                self.transport.sendto(i.to_bytes(4, "big") + bytes(996), peer)


@pytest.mark.parametrize("scheduler", ["abs", "rr"])
async def test_the_proxy_orders_tunnels_by_their_priority_header(scheduler: str) -> None:
    """Two tunnels on one connection, `priority: u=7` opened first, then `u=0`; the target
    floods both alike, in one burst. Under abs the proxy's scheduler drains the urgent tunnel's
    stream first, so fewer than half of the lax tunnel's packets reach the client before the
    urgent tunnel's last one (none did in 8 runs, 3 of them with two CPU hogs beside; a burst
    the proxy reads whole is what makes a queue to order: it sends faster than a flood that
    yields between payloads). Under rr, which ignores priorities, more than half do (300)."""
    cert, _ = ensure_certificate()
    count = 300

    async def run() -> None:
        loop = asyncio.get_running_loop()
        target, flood = await loop.create_datagram_endpoint(
            lambda: _Flood(count), local_addr=("127.0.0.1", 0)
        )
        port = target.get_extra_info("sockname")[1]
        arrivals: list[str] = []
        try:
            async with (
                _proxy([f"127.0.0.1:{port}"], scheduler=scheduler) as proxy,
                MasqueClient("127.0.0.1", proxy.port, key=KEY, verify=str(cert)) as client,
            ):
                lax = await client.open_tunnel("127.0.0.1", port, urgency=7)
                urgent = await client.open_tunnel("127.0.0.1", port, urgency=0)

                def record(name: str, tunnel: Any) -> None:
                    # The order the client's stack delivers in, which is the wire's: the two
                    # collecting tasks take one payload per event-loop pass each, so once a read
                    # takes many datagrams at once they would record their own alternation.
                    deliver = tunnel._deliver

                    def recorded(payload: bytes) -> None:
                        arrivals.append(name)
                        deliver(payload)

                    tunnel._deliver = recorded

                async def collect(tunnel: Any) -> None:
                    for _ in range(count):
                        await tunnel.recv()

                record("lax", lax)
                record("urgent", urgent)

                lax.send(b"go")
                await asyncio.sleep(0.05)
                urgent.send(b"go")
                await asyncio.gather(collect(lax), collect(urgent))
        finally:
            target.close()
        last_urgent = max(i for i, name in enumerate(arrivals) if name == "urgent")
        lax_before = arrivals[:last_urgent].count("lax")
        if scheduler == "abs":
            assert lax_before < count // 2, (lax_before, arrivals[:60])
        else:
            assert lax_before > count // 2, (lax_before, arrivals[:60])

    await asyncio.wait_for(run(), 30)


async def test_past_the_proxys_tunnel_limit_a_tunnel_waits_then_says_why() -> None:
    """A connection holds `max_tunnels` tunnels at once (QUIC's MAX_STREAMS); the next waits
    for stream credit, and gives up after its timeout naming the limit, not silently."""
    cert, key = ensure_certificate()

    async def run() -> None:
        async with (
            _echo_server() as (echo_port, _),
            MasqueProxy(
                {KEY: AllowList.parse([f"127.0.0.1:{echo_port}"])}, certfile=cert,
                keyfile=key, max_tunnels=2,
            ) as proxy,
            MasqueClient("127.0.0.1", proxy.port, key=KEY, verify=str(cert)) as client,
        ):  # fmt: skip
            first = await client.open_tunnel("127.0.0.1", echo_port)
            await client.open_tunnel("127.0.0.1", echo_port)
            with pytest.raises(TimeoutError, match="limit of 2 tunnels"):
                await client.open_tunnel("127.0.0.1", echo_port, timeout_s=0.5)
            await first.aclose()  # its stream ends: the proxy grants another
            await _until(lambda: proxy.open_tunnels == 1)
            third = await client.open_tunnel("127.0.0.1", echo_port, timeout_s=5)
            third.send(b"ping")
            assert await asyncio.wait_for(third.recv(), 5) == b"echo:ping"

    await asyncio.wait_for(run(), 20)


async def test_a_quiet_tunnel_stays_open_past_the_idle_timeout() -> None:
    """The client's PINGs keep a live proxy's connection from timing out while nothing flows."""
    cert, _ = ensure_certificate()

    async def run() -> None:
        async with (
            _echo_server() as (echo_port, _),
            _proxy([f"127.0.0.1:{echo_port}"]) as proxy,
            MasqueClient(
                "127.0.0.1", proxy.port, key=KEY, verify=str(cert), idle_timeout_s=1.0
            ) as client,
        ):
            tunnel = await client.open_tunnel("127.0.0.1", echo_port)
            await asyncio.sleep(3.0)
            assert tunnel.closed is None
            tunnel.send(b"still here")
            assert await asyncio.wait_for(tunnel.recv(), 5) == b"echo:still here"

    await asyncio.wait_for(run(), 20)


async def test_a_proxy_that_dies_ends_its_tunnels_within_the_idle_timeout() -> None:
    """SIGKILL sends no CONNECTION_CLOSE: the tunnel learns of it from the idle timeout, here
    2 s, not aioquic's default 60 s, and `recv()` says so instead of waiting for ever."""
    cert, _ = ensure_certificate()
    port = free_udp_port()

    async def run() -> None:
        async with _echo_server() as (echo_port, _):
            proxy = subprocess.Popen(
                [sys.executable, "-m", "transport.masque.proxy", "--port", str(port),
                 "--allow", f"127.0.0.1:{echo_port}", "--key", KEY],
                cwd=ROOT, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                client = MasqueClient(
                    "127.0.0.1", port, key=KEY, verify=str(cert), idle_timeout_s=2.0
                )
                deadline = time.monotonic() + 20
                while True:  # the proxy process is starting
                    try:
                        await asyncio.wait_for(client.connect(), 2)
                        break
                    except (OSError, TimeoutError, ConnectionError):
                        await client.aclose()
                        assert time.monotonic() < deadline, "the proxy did not start"
                        client = MasqueClient(
                            "127.0.0.1", port, key=KEY, verify=str(cert), idle_timeout_s=2.0
                        )
                try:
                    tunnel = await client.open_tunnel("127.0.0.1", echo_port)
                    tunnel.send(b"a")
                    assert await asyncio.wait_for(tunnel.recv(), 5) == b"echo:a"
                    proxy.kill()
                    proxy.wait()
                    killed = time.monotonic()
                    tunnel.send(b"b")
                    with pytest.raises(TunnelClosed, match="Idle timeout"):
                        await asyncio.wait_for(tunnel.recv(), 15)
                    assert time.monotonic() - killed < 8
                finally:
                    await client.aclose()
            finally:
                proxy.kill()
                proxy.wait()

    await asyncio.wait_for(run(), 60)


# --- (b) access control and malformed requests --------------------------------------------------


@pytest.mark.parametrize(
    ("key", "status"),
    [(None, 401), ("wrong-key", 401), (OTHER_KEY, 403), (NO_RIGHTS_KEY, 403)],
)
async def test_keys_are_enforced_and_no_socket_is_opened(key: str | None, status: int) -> None:
    async def run() -> None:
        async with _echo_server() as (echo_port, echo), _proxy([f"127.0.0.1:{echo_port}"]) as proxy:
            with pytest.raises(TunnelRefused) as refused:
                async with _tunnel(proxy, echo_port, key=key):
                    pass
            assert refused.value.status == status
            if status == 401:
                assert refused.value.headers.get("www-authenticate") == "Bearer"
            assert proxy.refused == {status: 1}
            assert proxy.sockets_opened == 0 and echo.seen == 0

    await asyncio.wait_for(run(), 10)


async def test_a_target_outside_the_keys_allow_list_is_refused() -> None:
    async def run() -> None:
        async with _echo_server() as (echo_port, echo), _proxy([f"127.0.0.1:{echo_port}"]) as proxy:
            with pytest.raises(TunnelRefused) as refused:
                async with _tunnel(proxy, echo_port + 1 if echo_port < 65535 else 1, key=KEY):
                    pass
            assert refused.value.status == 403
            assert proxy.sockets_opened == 0 and echo.seen == 0

    await asyncio.wait_for(run(), 10)


class _RawProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic, enable_webtransport=True)
        self.responses: dict[int, asyncio.Future[int]] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived):
                future = self.responses.get(h3_event.stream_id)
                if future is not None and not future.done():
                    future.set_result(int(dict(h3_event.headers)[b":status"]))


def _connect_udp(path: bytes, method: bytes = b"CONNECT") -> list[tuple[bytes, bytes]]:
    return [
        (b":method", method),
        (b":protocol", b"connect-udp"),
        (b":scheme", b"https"),
        (b":authority", b"localhost"),
        (b":path", path),
        (b"capsule-protocol", b"?1"),
        (b"authorization", f"Bearer {KEY}".encode()),
    ]


async def test_malformed_requests_get_400_or_405_and_open_no_socket() -> None:
    cert, _ = ensure_certificate()

    async def run() -> None:
        async with _echo_server() as (echo_port, echo), _proxy([f"127.0.0.1:{echo_port}"]) as proxy:
            good = f"/.well-known/masque/udp/127.0.0.1/{echo_port}/".encode()
            cases: list[tuple[list[tuple[bytes, bytes]], int]] = [
                # not the template
                (_connect_udp(b"/masque/127.0.0.1/53/"), 400),
                (_connect_udp(f"/.well-known/masque/udp/127.0.0.1/{echo_port}".encode()), 400),
                (_connect_udp(b"/.well-known/masque/udp/127.1/53/"), 400),
                (_connect_udp(b"/.well-known/masque/udp/127.0.0.1/0/"), 400),
                # no capsule-protocol
                ([h for h in _connect_udp(good) if h[0] != b"capsule-protocol"], 400),
                # another :protocol
                (
                    [
                        (n, b"connect-tcp" if n == b":protocol" else v)
                        for n, v in _connect_udp(good)
                    ],
                    400,
                ),
            ]
            get = [(n, v) for n, v in _connect_udp(good) if n != b":protocol"]
            cases.append(([(n, b"GET" if n == b":method" else v) for n, v in get], 405))
            configuration = QuicConfiguration(
                is_client=True, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536
            )
            configuration.load_verify_locations(str(cert))
            configuration.server_name = "localhost"
            async with connect(
                "127.0.0.1", proxy.port, configuration=configuration,
                create_protocol=_RawProtocol,
            ) as client:  # fmt: skip
                assert isinstance(client, _RawProtocol)
                for headers, status in cases:
                    stream_id = client._quic.get_next_available_stream_id()
                    future = asyncio.get_running_loop().create_future()
                    client.responses[stream_id] = future
                    client.h3.send_headers(stream_id, headers, end_stream=False)
                    client.transmit()
                    assert await asyncio.wait_for(future, 5) == status, headers
            assert proxy.refused == {400: len(cases) - 1, 405: 1}
            assert proxy.sockets_opened == 0 and echo.seen == 0

    await asyncio.wait_for(run(), 10)


# --- (c) an inner HTTP/3 request through the proxy ----------------------------------------------


async def _hello_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    body = f"hello over masque: {scope['method']} {scope['path']}".encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("mode", ["capsule", "datagram"])
async def test_an_inner_http3_request_goes_through_the_proxy(mode: str) -> None:
    cert, key = ensure_certificate()

    async def run() -> None:
        server = Http3Server(_hello_app, Http3Settings(str(cert), str(key)))
        await server.start("127.0.0.1", 0)
        try:
            assert server.port is not None
            async with _proxy([f"127.0.0.1:{server.port}"]) as proxy:
                async with _tunnel(proxy, server.port, key=KEY, mode=mode) as tunnel:
                    host, port = tunnel.local_address
                    async with Http3Client(host, port, verify=str(cert)) as inner:
                        response = await inner.request("GET", "/inner")
                        assert response.status == 200
                        assert await response.read() == b"hello over masque: GET /inner"
                    # The inner QUIC packets crossed the tunnel, not a direct path.
                    assert tunnel.sent_capsules + tunnel.sent_datagrams > 0
                    assert tunnel.received_capsules + tunnel.received_datagrams > 0
                assert proxy.sockets_opened == 1
        finally:
            server.close()

    await asyncio.wait_for(run(), 10)
