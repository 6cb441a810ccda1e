"""A graceful stop, on a server of its own: SIGTERM refuses new requests (HTTP/1.1: 503; HTTP/3:
GOAWAY, then H3_REQUEST_REJECTED), lets the stream in flight finish whole, exits 0, and leaves
no engine process behind.

The signal goes to the server process alone, as Kubernetes and `docker stop` send it. A signal to
the whole process group (Ctrl-C in a terminal, conftest's `Server.stop`) reaches vLLM's
EngineCores too, which then abort what they run at once (their own shutdown_timeout is 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.launch import free_port
from tests.support.processes import ENGINE_CORE, processes_under
from tests.support.servers import (
    CERT,
    Server,
    free_udp_port,
    launch,
    one_vllm_engine,
    serving_command,
    wait_until,
    write_test_config,
)
from tests.support.tiers import starts
from transport import body_send
from transport.client import Http3Client, StreamError
from transport.drain import Drain, Draining
from transport.http3 import Http3Settings
from transport.server import DualServer, Listen
from transport.tls import ensure_certificate

H3_REQUEST_REJECTED = 0x10B
EXIT_TIMEOUT_S = 300
STREAM_TOKENS = 1_000
"""A guard against a hang, not a measurement: the stream in flight has to finish first."""


@pytest.fixture(scope="module")
@starts("vllm")
def stopping_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("graceful")
    port, h3_port = free_port(), free_udp_port()
    request_log = tmp / "requests.jsonl"
    # A drain far longer than the stream needs: the test must not depend on how fast it is.
    extra = ["--h3-port", str(h3_port), "--request-log", str(request_log), "--drain-s", "600"]
    # One vLLM engine: what must not outlive the server is its processes, and one has them all.
    config = write_test_config(tmp, graceful=one_vllm_engine("graceful", "tiny-l"))
    server = launch(
        "graceful",
        serving_command(config, "graceful", port, *extra),
        port,
        "/readyz",
        tmp,
        h3_port=h3_port,
    )
    server.request_log = request_log
    try:
        yield server.wait_ready()
    finally:
        descendants = _identities(processes_under(server.process.pid))
        server.stop()
        for leftover in _alive(descendants):  # whatever a failed test left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(leftover.split()[0]), signal.SIGKILL)


def _chat(max_tokens: int, stream: bool) -> dict:
    return {
        "model": "tiny-l",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }


def _identity(pid: int) -> tuple[str, str] | None:
    """A process's start time (which tells it from a later one with its pid) and state."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rpartition(")")[2].split()  # after the name, which may hold spaces
    return fields[19], fields[0]  # starttime (field 22), state (field 3)


def _identities(pids: Iterable[int]) -> dict[int, tuple[str, str]]:
    return {pid: identity for pid in pids if (identity := _identity(pid)) is not None}


def _alive(processes: dict[int, tuple[str, str]]) -> list[str]:
    """Those of `processes` (pid: identity) still running: not gone, not a zombie."""
    alive = []
    for pid, (started, _) in processes.items():
        now = _identity(pid)
        if now is not None and now[0] == started and now[1] != "Z":
            alive.append(f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}")
    return alive


async def _h3_request(port: int, client: Http3Client | None = None) -> int | str:
    """POST a chat request over HTTP/3 (on `client`, or a new connection): its status, or the
    error code of the stream reset that answered it."""
    body = json.dumps(_chat(4, stream=False)).encode()
    headers = {"content-type": "application/json"}
    try:
        if client is None:
            async with Http3Client("localhost", port, verify=str(CERT)) as fresh:
                response = await fresh.request("POST", "/v1/chat/completions", headers, body)
        else:
            response = await client.request("POST", "/v1/chat/completions", headers, body)
        await response.read()
        return response.status
    except StreamError as exc:
        return exc.error_code if exc.error_code is not None else str(exc)


def test_sigterm_drains_refuses_and_leaves_no_engine(stopping_server: Server) -> None:
    server = stopping_server
    pid = server.process.pid
    children = processes_under(pid)
    assert ENGINE_CORE in children.values(), children
    descendants = _identities(children)

    # A long stream, in flight when the signal comes. It must outlast every check below that
    # needs the server up: at 300 tokens, on a CI machine loaded by other work, it once ended
    # (and the server exited) before /metrics was read.
    lines: list[str] = []
    first_token = threading.Event()
    failure: list[BaseException] = []

    def stream() -> None:
        try:
            with httpx.stream(
                "POST", server.url + "/v1/chat/completions", json=_chat(STREAM_TOKENS, stream=True),
                timeout=EXIT_TIMEOUT_S,
            ) as response:  # fmt: skip
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line.removeprefix("data: "))
                        first_token.set()
        except BaseException as exc:  # reported by the test thread
            failure.append(exc)
            first_token.set()

    streamer = threading.Thread(target=stream)
    streamer.start()

    async def connect_h3_then_stop() -> tuple[int | str, int | str]:
        # An HTTP/3 connection with a request done before the stop: the GOAWAY must reach it.
        async with Http3Client("localhost", server.h3_port, verify=str(CERT)) as client:
            before = await client.request("GET", "/readyz")
            await before.read()
            assert before.status == 200
            assert await asyncio.to_thread(first_token.wait, EXIT_TIMEOUT_S)
            assert not failure, failure
            os.kill(pid, signal.SIGTERM)
            await asyncio.to_thread(
                wait_until,
                lambda: httpx.get(server.url + "/readyz", timeout=5).status_code == 503,
                60,
                "/readyz to say the server is draining",
            )
            on_old = await _h3_request(server.h3_port, client)
        on_new = await _h3_request(server.h3_port)
        return on_old, on_new

    on_old_connection, on_new_connection = asyncio.run(connect_h3_then_stop())

    # Draining: readiness says so, and a new request over HTTP/1.1 is refused.
    ready = httpx.get(server.url + "/readyz", timeout=5)
    assert (ready.status_code, ready.json()["status"]) == (503, "draining")
    refused = httpx.post(server.url + "/v1/chat/completions", json=_chat(4, False), timeout=30)
    assert refused.status_code == 503, refused.text
    assert refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    # Over HTTP/3, requests opened after GOAWAY are rejected unprocessed.
    assert on_old_connection == H3_REQUEST_REJECTED
    assert on_new_connection == H3_REQUEST_REJECTED
    # Every refusal is counted (/metrics is served while draining).
    assert (
        server.metric(
            "serving_requests_total", qos_class="free-tier", model="none", outcome="draining"
        )
        == 3
    )

    # The stream in flight finishes whole, then the server exits 0.
    streamer.join(EXIT_TIMEOUT_S)
    assert not streamer.is_alive() and not failure, failure
    assert lines[-1] == "[DONE]", lines[-3:]
    events = [json.loads(line) for line in lines[:-1]]
    assert not [e for e in events if "error" in e], events[-2:]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == STREAM_TOKENS
    try:
        code = server.process.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after SIGTERM:\n{server.tail()}")
    assert code == 0, server.tail()

    # No engine, worker or helper process outlives it for long. multiprocessing's resource
    # tracker ends only after the server has: it waits for its pipe to close, then unlinks the
    # shared memory its users left behind (vLLM's engines leave some), so it is given a moment.
    settled = time.monotonic() + 10
    while _alive(descendants) and time.monotonic() < settled:
        time.sleep(0.1)
    assert _alive(descendants) == [], server.tail()

    outcomes = [(line["protocol"], line["outcome"]) for line in server.requests_logged()]
    assert sorted(outcomes) == sorted([("1.1", "ok"), ("1.1", "draining"), ("3", "draining"),
                                       ("3", "draining")]), outcomes  # fmt: skip


async def _endless_stream(scope: dict, receive: Any, send: Any) -> None:
    """An event stream that never ends by itself: one event, then it waits for its client, and
    sends one more once it is told its client left."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
    body = body_send.body_send(scope, send)  # `send` itself unless offered
    await body({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    while (await receive())["type"] != "http.disconnect":
        pass
    # Too late: the gate refuses it (StreamCut), and the stream ends with the drain's tail.
    await body({"type": "http.response.body", "body": b"data: late\n\n", "more_body": False})


def _offering(app: Any) -> Any:
    """`app`, offered its server's send for bodies past the middleware, as the API is."""

    async def offered(scope: dict, receive: Any, send: Any) -> None:
        body_send.offer(scope, send)
        await app(scope, receive, send)

    return offered


@pytest.mark.parametrize("past", [False, True], ids=["through", "past-the-middleware"])
def test_drain_cuts_what_outlives_it_and_refuses_what_comes_after(past: bool) -> None:
    """In process, without engines: a stream that outlives the drain time is cut at its end,
    visibly (the app's tail ends it, over both protocols) and counted; requests after the stop
    began are refused, and counted. Alike whether the stream's body goes through the gate's
    `send` or past the middleware (`transport.body_send`): the gate sees it either way, or it
    would end a cut stream twice."""
    cut: list[str] = []
    refused: list[str] = []
    drain = Drain(
        cut_tail=lambda scope, content_type: b"data: cut\n\n",
        on_cut=lambda scope: cut.append(scope["http_version"]),
        on_refuse=lambda scope: refused.append(scope["http_version"]),
    )
    cert, key = ensure_certificate()
    server = DualServer(
        _offering(Draining(_endless_stream, drain)) if past else Draining(_endless_stream, drain),
        Listen("127.0.0.1", 0, 0, drain_s=0.1),
        Http3Settings(str(cert), str(key)),
        "warning",
        drain=drain,
    )

    async def run() -> tuple[bytes, bytes, int, int | str]:
        async with server, httpx.AsyncClient() as h1, Http3Client(
            "localhost", server.udp_port, verify=str(CERT)
        ) as h3:  # fmt: skip
            url = f"http://127.0.0.1:{server.tcp_port}/"
            async with h1.stream("GET", url) as response:
                chunks = response.aiter_raw()
                h1_body = await anext(chunks)
                h3_response = await h3.request("GET", "/")
                h3_chunks = h3_response.iter_bytes()
                h3_body = await anext(h3_chunks)
                await server.stop_gracefully(server.listen.drain_s)  # neither ends by itself
                h1_body += b"".join([chunk async for chunk in chunks])
                h3_body += b"".join([chunk async for chunk in h3_chunks])
            after = await h1.get(url)
            try:
                h3_after: int | str = (await h3.request("GET", "/")).status
            except StreamError as exc:
                h3_after = exc.error_code if exc.error_code is not None else str(exc)
            return h1_body, h3_body, after.status_code, h3_after

    h1_body, h3_body, h1_after, h3_after = asyncio.run(run())
    assert h1_body == h3_body == b"data: 1\n\ndata: cut\n\n"
    assert sorted(cut) == ["1.1", "3"]
    assert (h1_after, h3_after) == (503, H3_REQUEST_REJECTED)
    assert sorted(refused) == ["1.1", "3"]


def test_the_gate_hands_a_disconnect_to_the_app_after_a_cancelled_receive() -> None:
    """An app that stops watching for a disconnect (cancels its receive(), as the API does once
    the first token comes) still hears of its client leaving later, through the gate."""
    left = asyncio.Event()

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _endless_stream(scope, receive, send)
            return
        assert (await receive())["type"] == "http.request"  # the body, read first as the API does
        watcher = asyncio.ensure_future(receive())
        await asyncio.sleep(0.01)
        watcher.cancel()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"1", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        left.set()

    cert, key = ensure_certificate()
    server = DualServer(
        app, Listen("127.0.0.1", None, 0), Http3Settings(str(cert), str(key)), "warning"
    )

    async def run() -> None:
        async with server, Http3Client("localhost", server.udp_port, verify=str(CERT)) as h3:
            response = await h3.request("GET", "/")
            await anext(response.iter_bytes())
            response.close()  # a reset: the app sees http.disconnect
            async with asyncio.timeout(30):  # a guard against a hang, not a measurement
                await left.wait()

    asyncio.run(run())


def test_an_app_without_lifespan_serves() -> None:
    """ASGI lets an app that has no startup or shutdown just return from the lifespan scope: the
    servers start and stop all the same, instead of waiting for a reply that never comes."""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    cert, key = ensure_certificate()
    server = DualServer(
        app, Listen("127.0.0.1", 0, 0), Http3Settings(str(cert), str(key)), "warning"
    )

    async def run() -> tuple[bytes, bytes]:
        async with asyncio.timeout(30):  # a guard against a hang, not a measurement
            async with server, httpx.AsyncClient() as h1, Http3Client(
                "localhost", server.udp_port, verify=str(CERT)
            ) as h3:  # fmt: skip
                h1_body = (await h1.get(f"http://127.0.0.1:{server.tcp_port}/")).content
                h3_body = await (await h3.request("GET", "/")).read()
                return h1_body, h3_body

    assert asyncio.run(run()) == (b"ok", b"ok")


def test_requests_waiting_for_stream_credit_fail_cleanly_when_the_connection_closes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past the stream limit a request waits for credit; if the connection closes first, it fails
    with the connection's error, and nothing is left for asyncio to log as never retrieved."""
    cert, key = ensure_certificate()
    server = DualServer(
        _endless_stream,
        Listen("127.0.0.1", None, 0),
        Http3Settings(str(cert), str(key), max_streams=1),
        "warning",
    )

    async def run() -> list[BaseException | None]:
        async with server, Http3Client("localhost", server.udp_port, verify=str(CERT)) as h3:
            await anext((await h3.request("GET", "/")).iter_bytes())  # holds the one stream
            waiting = [asyncio.ensure_future(h3.request("GET", "/")) for _ in range(3)]
            await asyncio.sleep(0.05)
            assert h3.stream_credit < 0
            server._h3.close()  # type: ignore[union-attr]  # the connection goes
            async with asyncio.timeout(30):  # a guard against a hang, not a measurement
                done = await asyncio.gather(*waiting, return_exceptions=True)
            return [r if isinstance(r, BaseException) else None for r in done]

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        errors = asyncio.run(run())
        gc.collect()
    assert all(isinstance(e, StreamError) and "connection closed" in str(e) for e in errors), errors
    assert "never retrieved" not in caplog.text
