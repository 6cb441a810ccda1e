"""The edge front-end (Chuppala (2024), Figure 2): `python -m transport.frontend --backend URL`.

It accepts client HTTP/3 and HTTP/1.1 and forwards every request as a stream over a long-lived
QUIC connection to the back-end: one, or as many as the load needs (`BackendPool`). Each forwarded
stream is tagged with its QoS class's priority and deadline, so on a shared connection the stream
scheduler decides whose bytes go first, in both directions: this side orders the requests, the
back-end orders the responses.

The edge tags each request as it arrives here (`transport.qos`), and forwards the tag: the
request's age, class, tier and id, and what the edge measured of the client's network path, in
`x-edge-*` headers with the edge's key. The back-end keeps them only if that key's tier is
`trusted_edge`, so its deadline, TTFT and SLO run from the client's arrival here and it routes on
the client's path, not the edge's; otherwise it classifies, times and measures the request
itself. The headers a client
sends under those names are dropped, whoever the client is.

A client that goes away resets its forwarded stream, which the back-end sees as a disconnect and
turns into an engine abort. A back-end that is unreachable gets the client a 502, and a response
stream that the back-end resets part-way ends the client's response as an error too (HTTP/1.1:
the connection closes before the last chunk; HTTP/3: the stream is reset), never as a clean end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from transport.client import Http3Client, Response, StreamError
from transport.eloquent import HEADER as ELOQUENT_HEADER
from transport.http3 import DATAGRAMS, DatagramTap
from transport.masque.access import TunnelAccess
from transport.masque.proxy import MasqueProxy
from transport.qos import EDGE_HEADERS, path_of, tag_of
from transport.schedulers import StreamSpec

if TYPE_CHECKING:
    import argparse

    from transport.cli import ServerSetup

logger = logging.getLogger(__name__)

# RFC 9110 7.6.1: meaningful for one hop only; HTTP/3 forbids most of them outright.
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "host",
}

# As starlette's, which `BodyLimit` wraps the proxy in.
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


DEFAULT_BACKEND_CONNECTIONS = 8


class BackendPool:
    """QUIC connections to the back-end, opened as the load needs them.

    A connection carries at most as many requests at once as the back-end's MAX_STREAMS allows
    (128 for `python -m serving`); aioquic holds a request past that until the back-end grants
    more, a wait that neither the client nor the back-end sees. So a request goes on the oldest
    connection with stream credit left, and when none has any, a new connection opens, up to
    `limit`; only past that do requests wait for credit. A connection the back-end closes (its
    idle timeout) leaves the pool, which so shrinks again with the load.
    """

    def __init__(
        self,
        host: str,
        port: int,
        verify: bool | str,
        scheduler: str,
        limit: int = DEFAULT_BACKEND_CONNECTIONS,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.host, self.port = host, port
        self.limit = limit
        self.clients: list[Http3Client] = []
        self.opened = 0
        """Connections opened since start."""
        self._verify = verify
        self._scheduler = scheduler
        self._lock = asyncio.Lock()

    async def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes = b"",
        spec: StreamSpec | None = None,
        datagrams: Callable[[bytes], None] | None = None,
    ) -> Response:
        # Nothing awaits between the pick and `request` taking its stream id, so no other
        # request can take the credit the pick counted on.
        client = await self._pick()
        return await client.request(method, path, headers, body, spec, datagrams=datagrams)

    async def _pick(self) -> Http3Client:
        async with self._lock:
            for client in [c for c in self.clients if not c.is_open]:
                self.clients.remove(client)
                logger.info(
                    "back-end connection closed (%s): %d open", client.closed, len(self.clients)
                )
                await client.__aexit__(None, None, None)
            for client in self.clients:
                if client.stream_credit > 0:
                    return client
            if len(self.clients) < self.limit:
                try:
                    return await self._open()
                except (OSError, TimeoutError) as exc:
                    if not self.clients:
                        raise
                    logger.warning("could not open another back-end connection: %s", exc)
            # All at the limit: wait for credit on the connection that needs the least.
            return max(self.clients, key=lambda c: c.stream_credit)

    async def _open(self) -> Http3Client:
        client = Http3Client(self.host, self.port, verify=self._verify, scheduler=self._scheduler)
        try:
            await asyncio.wait_for(client.__aenter__(), timeout=10)
        except BaseException:
            await client.__aexit__(None, None, None)
            raise
        self.clients.append(client)
        self.opened += 1
        logger.info(
            "back-end connection opened: %d open (at most %d), %d since start",
            len(self.clients), self.limit, self.opened,
        )  # fmt: skip
        return client

    async def close(self) -> None:
        logger.info(
            "closing %d back-end connections (%d opened since start)",
            len(self.clients), self.opened,
        )  # fmt: skip
        clients, self.clients = self.clients, []
        for client in clients:
            await client.__aexit__(None, None, None)


class EdgeProxy:
    """The ASGI app of the edge: forwards everything to the back-end. Every request must reach
    it tagged (`transport.qos.TagRequests`); `edge_key` signs the tags it forwards."""

    def __init__(self, pool: BackendPool, edge_key: str | None) -> None:
        self.pool = pool
        self.edge_key = edge_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._forward(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        tag = tag_of(scope)
        assert tag is not None, "TagRequests tags every HTTP request"
        headers = {
            name: value.decode("latin-1")
            for raw, value in scope["headers"]
            if (name := raw.decode("latin-1").lower()) not in HOP_BY_HOP
            and name not in EDGE_HEADERS
        }
        if scope.get("client"):
            headers["x-forwarded-for"] = str(scope["client"][0])
        # Eloquent end to end: the back-end's datagrams go on to the client as they are, and
        # the client's ACKs back, so a client of the edge is protected as one of the back-end.
        tap: DatagramTap | None = scope["extensions"].get(DATAGRAMS)
        if tap is None:
            headers.pop(ELOQUENT_HEADER.decode(), None)  # no datagrams to the client: none here
        path = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        if self.edge_key is not None:
            headers.update(tag.forwarded(time.monotonic(), self.edge_key, path_of(scope)))
        try:
            response = await self.pool.request(
                scope["method"],
                path.decode("latin-1"),
                headers,
                body,
                tag.spec,
                datagrams=tap.send if tap is not None else None,
            )
        except (OSError, TimeoutError, StreamError, ConnectionError) as exc:
            logger.warning("back-end %s:%d unreachable: %s", self.pool.host, self.pool.port, exc)
            await _bad_gateway(send, f"The back-end is unreachable: {exc or type(exc).__name__}")
            return
        if tap is not None:
            tap.receive = response.send_datagram
        await self._relay(response, receive, send)

    async def _relay(self, response: Response, receive: Receive, send: Send) -> None:
        headers = [
            (name.encode(), value.encode())
            for name, value in response.headers.items()
            if name not in HOP_BY_HOP and name != "content-length"
        ]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})

        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        chunks = response.iter_bytes()
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            chunks = _whole_events(chunks)
        watcher = asyncio.ensure_future(client_gone())
        try:
            async for chunk in chunks:
                if watcher.done():
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except StreamError as exc:
            # The response had begun: all we can do is end it visibly. HTTP/1.1 chunked and
            # HTTP/3 both carry the truncation to the client as an error, not a clean end.
            logger.warning("back-end stream %d failed: %s", response.stream_id, exc)
            raise
        finally:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await watcher
            response.close()


_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")


async def _whole_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An event stream's bytes in runs of whole events, as the back-end wrote them.

    QUIC cuts a stream into frames wherever a packet fills up, so the events arrive in arbitrary
    pieces, and each piece relayed as it came would become one HTTP/1.1 chunk. Clients take
    chunks for whole events: vLLM's benchmark client strips each chunk before it looks for
    events, so an event cut right after its `data:` reaches it as `data:{...}`, a
    JSONDecodeError, and it hangs up. The back-end wrote whole events: they leave here whole."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        if cut := _after_last_event(pending):
            yield pending[:cut]
            pending = pending[cut:]
    if pending:  # a body that does not end on an event boundary: passed on as it is
        yield pending


def _after_last_event(data: bytes) -> int:
    """The offset just past the last whole event in `data`; 0 if there is none."""
    ends = [i + len(end) for end in _EVENT_ENDS if (i := data.rfind(end)) >= 0]
    return max(ends, default=0)


async def _bad_gateway(send: Send, message: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": "bad_gateway", "param": None, "code": 502}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 502,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main() -> int:
    import argparse

    from transport.cli import add_server_arguments, prepare
    from transport.client import split_url
    from transport.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
    from transport.qos import QosClassifier, TagRequests
    from transport.server import DualServer, serve_forever
    from transport.workers import supervise

    parser = argparse.ArgumentParser(prog="python -m transport.frontend", description=__doc__)
    add_server_arguments(parser, tcp_port=8001, udp_port=8444)
    parser.add_argument("--backend", default="https://localhost:8443", help="its HTTP/3 URL")
    parser.add_argument("--backend-cacert", help="trust this certificate for the back-end")
    parser.add_argument(
        "--backend-insecure", action="store_true", help="accept any back-end certificate"
    )
    parser.add_argument(
        "--backend-connections",
        type=int,
        default=DEFAULT_BACKEND_CONNECTIONS,
        help="at most this many QUIC connections to the back-end: another opens when every one "
        "is at the back-end's stream limit (default: %(default)s)",
    )
    parser.add_argument(
        "--masque",
        type=int,
        metavar="UDP_PORT",
        help="also be a MASQUE proxy (RFC 9298 CONNECT-UDP) on this UDP port, with HTTP/3's "
        "certificate, scheduler and --max-streams (tunnels a connection may hold at once): keys "
        "of models.yaml tiers with `tunnels:` may open tunnels to those targets only",
    )
    args = parser.parse_args()
    setup = prepare(parser, args)
    if args.workers > 1:
        if args.masque:
            parser.error("--masque: the MASQUE proxy runs in one process, not with --workers")
        return supervise(
            "transport.frontend", sys.argv[1:], setup.listen, args.workers,
            reset_key=setup.reset_key,
        )  # fmt: skip
    masque = _masque_proxy(parser, args, setup) if args.masque else None
    classifier = QosClassifier.from_deployment(setup.deployment)
    edge_key = classifier.edge_key()
    if edge_key is None:
        logger.warning(
            "no key of a trusted_edge tier (models.yaml; QOS_EDGE_KEY): the back-end will time "
            "and classify requests from when they reach it, not from their arrival here"
        )
    host, port = split_url(args.backend)
    if args.backend_connections < 1:
        parser.error("--backend-connections must be at least 1")
    verify: bool | str = args.backend_cacert or not args.backend_insecure
    pool = BackendPool(host, port, verify, setup.scheduler, args.backend_connections)
    proxy = EdgeProxy(pool, edge_key)
    app = TagRequests(BodyLimit(proxy, max_bytes=DEFAULT_MAX_BODY_BYTES), classifier.tag)
    server = DualServer(app, setup.listen, setup.http3(classifier.tag), log_level=args.log_level)

    async def run() -> None:
        if masque is not None:
            await masque.start()
            logger.info("MASQUE CONNECT-UDP proxy on udp %s:%d", masque.host, masque.port)
        try:
            await serve_forever(server)
        finally:
            if masque is not None:
                masque.close()

    asyncio.run(run())
    return 0


def _masque_proxy(
    parser: argparse.ArgumentParser, args: argparse.Namespace, setup: ServerSetup
) -> MasqueProxy:
    """The proxy `--masque` asks for, or exit 2 with one line on what is wrong."""
    from transport.cli import cannot_listen

    if problem := cannot_listen(args.host, args.masque, "udp"):
        parser.exit(2, f"error: cannot listen on udp {args.host}:{args.masque}: {problem}\n")
    try:
        access = TunnelAccess.from_deployment(setup.deployment)
    except ValueError as error:
        parser.exit(2, f"error: {error}\n")
    if not any(allow.entries for allow in access.keys.values()):
        logger.warning(
            "--masque: no key of a tier with `tunnels:` is set (models.yaml; QOS_TUNNEL_KEY): "
            "every tunnel will be refused"
        )
    return MasqueProxy(
        access, certfile=setup.certfile, keyfile=setup.keyfile, host=args.host,
        port=args.masque, scheduler=setup.scheduler, max_tunnels=setup.max_streams,
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
