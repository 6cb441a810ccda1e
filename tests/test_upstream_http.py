"""The upstream leg's HTTP/1.1 client (`serving.engines.upstream_http`) against a server on a
real socket that answers with exactly the bytes each test needs. What a remote engine makes of
its errors is tests/test_remote_client.py's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from serving.engines.upstream_http import UpstreamClosed, UpstreamPool

Answer = Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
"""How the server answers one request: given its connection's number (0 for the first)."""


def events(n: int) -> bytes:
    body = b"".join(b'data: {"i": %d}\n\n' % i for i in range(n)) + b"data: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
    return head % len(body) + body


def always(answer: bytes) -> Answer:
    async def send(number: int, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(answer)

    return send


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


@asynccontextmanager
async def upstream(answer: Answer) -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server on a free port: its URL, and the requests it has read."""
    requests: list[bytes] = []
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        number, connections = connections, connections + 1
        try:
            while not reader.at_eof():
                requests.append(await read_request(reader))
                await answer(number, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", requests


async def read_all(pool: UpstreamPool) -> list[bytes]:
    response = await pool.post("/v1/chat/completions", b"{}", {"x-request-id": "r"})
    try:
        return [data async for data in response.events()]
    finally:
        response.release()


async def test_a_pooled_connection_closed_as_the_request_went_out_is_replaced_once() -> None:
    # The first connection answers once and is then closed by the server with the second
    # request unanswered (as an upstream does at its keep-alive timeout): the client sends it
    # again on a new connection, which answers.
    async def answer(number: int, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if number == 0 and len(seen) == 2:
            w.transport.abort()
            return
        w.write(events(3))

    async with upstream(answer) as (url, seen):
        pool = UpstreamPool(url, keepalive_s=10)
        assert await read_all(pool) == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
        assert len(pool.idle) == 1
        assert await read_all(pool) == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
        assert len(seen) == 3  # the second request, twice
        pool.close()


async def test_a_new_connection_closed_before_its_answer_is_an_error() -> None:
    # Once only: a server that takes connections and closes them unanswered is not retried.
    async def answer(number: int, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.transport.abort()

    async with upstream(answer) as (url, seen):
        pool = UpstreamPool(url, keepalive_s=10)
        with pytest.raises(UpstreamClosed):
            await read_all(pool)
        assert len(seen) == 1
        pool.close()


async def test_an_answer_cut_after_it_began_is_an_error_and_not_sent_again() -> None:
    async def answer(number: int, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(events(3)[:-30])
        await w.drain()
        w.transport.abort()

    async with upstream(answer) as (url, seen):
        pool = UpstreamPool(url, keepalive_s=10)
        response = await pool.post("/v1/completions", b"{}", {})
        got = []
        with pytest.raises(UpstreamClosed):
            async for data in response.events():
                got.append(data)
        response.release()
        assert got == [b'{"i": 0}', b'{"i": 1}']
        assert len(seen) == 1 and not pool.idle
        pool.close()


async def test_a_connection_idle_past_its_keepalive_is_not_used_again() -> None:
    async with upstream(always(events(1))) as (url, _):
        pool = UpstreamPool(url, keepalive_s=0.05)
        await read_all(pool)
        first = pool.idle[0]
        await asyncio.sleep(0.1)
        await read_all(pool)
        assert pool.idle and pool.idle[0] is not first
        assert first.transport is None or first.transport.is_closing()
        pool.close()


async def test_a_reader_that_falls_behind_stops_the_reading_and_loses_nothing() -> None:
    async with upstream(always(events(2000))) as (url, _):
        pool = UpstreamPool(url, keepalive_s=10)
        response = await pool.post("/v1/completions", b"{}", {})
        stream = response.events()
        first = await anext(stream)
        await asyncio.sleep(0.2)  # the rest has come, or stopped coming at the limit
        transport = response._connection.transport
        assert transport is not None and not transport.is_reading()
        rest = [data async for data in stream]
        assert [first, *rest] == [b'{"i": %d}' % i for i in range(2000)]
        response.release()
        assert pool.idle  # read whole: back in the pool, reading again
        assert pool.idle[0].transport is not None and pool.idle[0].transport.is_reading()
        pool.close()


async def test_the_request_goes_out_as_http_1_1_with_its_headers_and_body() -> None:
    async with upstream(always(events(1))) as (url, seen):
        pool = UpstreamPool(url + "/v1", keepalive_s=10)
        response = await pool.post("/v1/completions", b'{"a": 1}', {"x-request-id": "abc"})
        response.release()
        head, _, body = seen[0].partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/completions HTTP/1.1"
        assert b"x-request-id: abc" in lines and b"content-length: 8" in lines
        assert any(line.startswith(b"host: 127.0.0.1:") for line in lines)
        assert body == b'{"a": 1}'
        pool.close()


async def test_closing_the_pool_ends_a_response_being_read() -> None:
    async def answer(number: int, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await reader.read()  # the rest never comes: until the client closes

    async with upstream(answer) as (url, _):
        pool = UpstreamPool(url, keepalive_s=10)
        response = await pool.post("/v1/completions", b"{}", {})
        reading = asyncio.ensure_future(anext(response.events()))
        await asyncio.sleep(0.05)
        pool.close()
        with pytest.raises(UpstreamClosed):
            await asyncio.wait_for(reading, 5)


async def test_closing_the_pool_ends_a_request_waiting_for_its_head_and_sends_it_nowhere() -> None:
    # The first request is answered, so the second goes out on the pooled connection; the
    # server takes that one and answers nothing. Closing the pool ends the wait, and the
    # request is not sent again on a new connection, as one the upstream dropped would be.
    async def answer(number: int, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if len(seen) == 1:
            w.write(events(1))
        else:
            await asyncio.sleep(30)

    async with upstream(answer) as (url, seen):
        pool = UpstreamPool(url, keepalive_s=10)
        await read_all(pool)
        waiting = asyncio.ensure_future(pool.post("/v1/completions", b"{}", {}))
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        pool.close()
        with pytest.raises(UpstreamClosed):
            await asyncio.wait_for(waiting, 5)
        await asyncio.sleep(0.1)
        assert len(seen) == 2


def test_the_client_reads_on_uvloop() -> None:
    # `--loop uvloop`: its transports are not asyncio.Transport's subclasses.
    import uvloop

    async def on_uvloop() -> list[bytes]:
        async with upstream(always(events(3))) as (url, _):
            pool = UpstreamPool(url, keepalive_s=10)
            try:
                return await read_all(pool)
            finally:
                pool.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(on_uvloop()) == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
