"""The edge front-end under more concurrent requests than one back-end connection carries.

In-process tests put `transport.frontend`'s pool and proxy in front of a small HTTP/3 back-end of
known behaviour; the live ones run `python -m transport.frontend` in front of `python -m serving`,
whose one replica is the null server, so that they start in seconds and count every outcome.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from config import load_deployment
from serving.launch import free_port
from tests.support.servers import (
    CERT,
    PYTHON,
    ROOT,
    Server,
    free_udp_port,
    launch,
    remote_placement,
    serving_command,
    wait_until,
    write_test_config,
)
from tests.support.tiers import starts
from transport.client import Http3Client
from transport.frontend import BackendPool, EdgeProxy
from transport.http3 import Http3Server, Http3Settings
from transport.qos import QosClassifier, TagRequests
from transport.server import DualServer, Listen
from transport.tls import ensure_certificate

CHAT = "/v1/chat/completions"
TOKENS = 64


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class _EventsApp:
    """A back-end that answers every request with `events` server-sent events: the first at once,
    the rest in one burst (which QUIC must split across packets) once `release` is set. With
    `fail`, it raises after the first half, and the server resets the stream."""

    def __init__(self, events: int, fail: bool = False) -> None:
        self.events = events
        self.fail = fail
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(self.events):
            if i == 1:
                await self.release.wait()
            if self.fail and i == self.events // 2:
                raise RuntimeError("the back-end fails mid-answer")
            body = _event({"i": i, "pad": "x" * 200})
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@asynccontextmanager
async def _backend(app: _EventsApp, max_streams: int = 128) -> AsyncIterator[int]:
    cert, key = ensure_certificate()
    server = Http3Server(app, Http3Settings(str(cert), str(key), max_streams=max_streams))
    await server.start("127.0.0.1", 0)
    try:
        assert server.port is not None
        yield server.port
    finally:
        server.close()


@asynccontextmanager
async def _edge(backend_port: int, limit: int = 8) -> AsyncIterator[int]:
    """The edge's proxy over HTTP/1.1, as `python -m transport.frontend` serves it."""
    pool = BackendPool("localhost", backend_port, str(CERT), "rr", limit)
    classifier = QosClassifier.from_deployment(load_deployment(ROOT / "models.yaml"))
    app = TagRequests(EdgeProxy(pool, None), classifier.tag)
    cert, key = ensure_certificate()
    server = DualServer(
        app, Listen("127.0.0.1", 0, None), Http3Settings(str(cert), str(key)), "warning", False
    )
    async with server:
        assert server.tcp_port is not None
        yield server.tcp_port
    await pool.close()


async def _post(
    port: int, path: str, body: dict[str, Any], on_chunk: Callable[[], object] = lambda: None
) -> tuple[int, list[bytes], bool]:
    """POST over a plain HTTP/1.1 connection. Returns the status, the body in the chunks the
    server framed it in, and whether it ended with the last chunk (False: the connection
    closed first, which is how HTTP/1.1 says a response was cut short)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    try:
        status = int((await reader.readline()).split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        chunks: list[bytes] = []
        try:
            while size := int((await reader.readline()).split(b";")[0], 16):
                chunks.append(await reader.readexactly(size))
                on_chunk()
                await reader.readexactly(2)
        except (ValueError, asyncio.IncompleteReadError, ConnectionError):
            return status, chunks, False
        return status, chunks, True
    finally:
        writer.close()


def _events(chunks: list[bytes]) -> list[bytes]:
    """The body's events; each chunk must hold whole ones, as the back-end wrote them."""
    assert all(chunk.endswith(b"\n\n") for chunk in chunks), [c[-30:] for c in chunks]
    return [event for event in b"".join(chunks).split(b"\n\n") if event]


async def test_the_pool_opens_connections_past_the_stream_limit_up_to_its_cap() -> None:
    app = _EventsApp(events=50)
    async with _backend(app, max_streams=2) as port:
        pool = BackendPool("localhost", port, str(CERT), "rr", limit=2)
        try:
            requests = [asyncio.ensure_future(pool.request("GET", "/", {}, b"")) for _ in range(5)]
            pending = set(requests)
            while len(pending) > 1:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # Two connections of two streams each; the fifth request waits for credit on one.
            assert len(pool.clients) == 2
            assert pool.opened == 2
            app.release.set()
            for request in requests:
                response = await request
                events = [e for e in (await response.read()).split(b"\n\n") if e]
                assert len(events) == app.events + 1
                assert events[-1] == b"data: [DONE]"
            assert pool.opened == 2
        finally:
            await pool.close()


async def test_the_edge_relays_an_event_stream_in_whole_events() -> None:
    app = _EventsApp(events=200)
    app.release.set()
    async with _backend(app) as backend_port, _edge(backend_port) as port:
        status, chunks, ended = await _post(port, CHAT, {})
    assert (status, ended) == (200, True)
    events = _events(chunks)
    assert len(events) == app.events + 1
    assert [json.loads(e.removeprefix(b"data: "))["i"] for e in events[:-1]] == list(range(200))


async def test_a_back_end_reset_ends_the_clients_response_as_an_error() -> None:
    app = _EventsApp(events=40, fail=True)
    async with _backend(app) as backend_port, _edge(backend_port) as port:
        status, chunks, ended = await _post(port, CHAT, {}, on_chunk=app.release.set)
    assert status == 200
    assert not ended, "a response the back-end cut short must not end cleanly"
    assert len(_events(chunks)) < app.events


# -- live: python -m transport.frontend in front of python -m serving ----------------------------

MAX_STREAMS = 4
"""The back-end's stream limit per connection, low so that a few requests go past it."""


@pytest.fixture(scope="module")
@starts("twin")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """The null server (first token after 1 s, then every token at once), `python -m serving`
    with it as its one replica, and the edge in front of that."""
    work = tmp_path_factory.mktemp("edge")
    null_port = free_port()
    config = write_test_config(
        work,
        edge_null=(
            remote_placement(null_port),
            {"placement": "edge_null", "policy": {"name": "quality-threshold"}},
        ),
    )
    found: dict[str, Server] = {}
    try:
        found["null"] = launch(
            "edge-null",
            [PYTHON, "-m", "workloads.null_server", "--port", str(null_port), "--h3-port", "0",
             "--model", "tiny-s", "--first-token-ms", "1000"],
            null_port, "/v1/models", work,
        )  # fmt: skip
        port, h3_port, log = free_port(), free_udp_port(), work / "backend-requests.jsonl"
        found["backend"] = launch(
            "edge-backend",
            serving_command(config, "edge_null", port, "--h3-port", str(h3_port),
                            "--max-streams", str(MAX_STREAMS), "--request-log", str(log)),
            port, "/readyz", work, h3_port=h3_port,
        )  # fmt: skip
        found["backend"].request_log = log
        edge_port = free_port()
        found["edge"] = launch(
            "edge",
            [PYTHON, "-m", "transport.frontend", "--config", str(config),
             "--deployment", "edge_null", "--backend", f"https://localhost:{h3_port}",
             "--backend-cacert", str(CERT), "--port", str(edge_port), "--h3-port", "0"],
            edge_port, "/healthz", work,
        )  # fmt: skip
        for name in ("null", "backend", "edge"):
            found[name].wait_ready()
        yield found
    finally:
        for server in found.values():
            server.stop()


def _chat(**extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hello!"}]
    return {"model": "tiny-s", "messages": messages, "max_tokens": TOKENS, "stream": True, **extra}


def _outcomes(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    counts: dict[str, float] = {}
    for outcome, value in re.findall(
        r'^serving_requests_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$', text, re.M
    ):
        counts[outcome] = counts.get(outcome, 0.0) + float(value)
    return counts


async def test_past_the_stream_limit_every_response_is_whole_and_counted(
    stack: dict[str, Server],
) -> None:
    backend, edge = stack["backend"], stack["edge"]
    before = _outcomes(backend)
    body = _chat(stream_options={"include_usage": True})
    n = 6 * MAX_STREAMS
    results = await asyncio.gather(*(_post(edge.port, CHAT, body) for _ in range(n)))
    for status, chunks, ended in results:
        assert (status, ended) == (200, True)
        events = _events(chunks)
        assert events[-1] == b"data: [DONE]"
        usage = json.loads(events[-2].removeprefix(b"data: "))["usage"]
        assert usage["completion_tokens"] == TOKENS
        assert len(events) == TOKENS + 2
    # The back-end counts a response once the edge has acknowledged all of it.
    await asyncio.to_thread(
        wait_until,
        lambda: sum(_outcomes(backend).values()) - sum(before.values()) >= n,
        30,
        "the back-end to count every request",
    )
    after = _outcomes(backend)
    grown = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert grown == {"ok": n}
    opened = [int(m) for m in re.findall(r"back-end connection opened: (\d+) open", edge.tail(400))]
    assert max(opened) > 1, "every request went over one connection"


async def test_a_response_reset_after_it_was_written_is_not_ok(stack: dict[str, Server]) -> None:
    """The client takes nothing in, so the back-end writes the whole answer and is left waiting
    for its acknowledgement; then the client resets the stream. That answer never reached it."""
    backend, null = stack["backend"], stack["null"]
    replica = {"replica": f"127.0.0.1:{null.port}/tiny-s", "model": "tiny-s"}
    request_id = f"edge-test-{uuid.uuid4().hex}"
    body = _chat()
    assert backend.h3_port is not None
    async with Http3Client("localhost", backend.h3_port, verify=str(CERT)) as client:
        protocol = client.protocol
        protocol.datagram_received = lambda data, addr: None  # type: ignore[method-assign]
        headers = {"content-type": "application/json", "x-request-id": request_id}
        request = asyncio.ensure_future(
            client.request("POST", CHAT, headers, json.dumps(body).encode())
        )
        await asyncio.to_thread(
            wait_until,
            lambda: backend.metric("serving_replica_in_flight", **replica) == 1,
            30,
            "the request to reach the replica",
        )
        await asyncio.to_thread(
            wait_until,
            lambda: backend.metric("serving_engine_unfinished", **replica) == 0,
            30,
            "the replica to finish the answer",
        )
        await asyncio.sleep(0.5)  # for the server to write the last events; not a condition
        request.cancel()  # resets the stream
        with pytest.raises(asyncio.CancelledError):
            await request
        del protocol.datagram_received
        await asyncio.to_thread(
            wait_until,
            lambda: any(line["request_id"] == request_id for line in backend.requests_logged()),
            30,
            "the back-end to log the request",
        )
    assert backend.logged(request_id)["outcome"] == "cancelled"
