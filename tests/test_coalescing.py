"""A response's events written in one burst go onto its stream as one write at the next
transmit (`transport.http3`), with every byte in order, under every scheduler; a stream that
ends, fails or is abandoned between two events loses nothing it sent and repeats nothing.

Real QUIC connections on loopback: the in-process HTTP/3 server and client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aioquic.h3.connection import H3Connection
from aioquic.quic.connection import QuicConnection

from tests.support.servers import CERT
from transport.client import Http3Client, StreamError
from transport.http3 import Http3Server, Http3Settings, ResponseNotDelivered
from transport.schedulers import SCHEDULERS
from transport.tls import ensure_certificate

EVENTS = 40


def event(stream: str, i: int) -> bytes:
    return f"data: {stream} {i:03d} {'x' * 150}\n\n".encode()


def body(stream: str, events: int = EVENTS) -> bytes:
    return b"".join(event(stream, i) for i in range(events)) + b"data: [DONE]\n\n"


class BurstApp:
    """Answers /NAME with EVENTS events in bursts of ten (no await in between but the sends),
    yielding to the loop between bursts. /slow/NAME waits for `gate` after the first burst;
    /fail/NAME too, then raises after 15 events. Each records whether its client had it all."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.left: list[str] = []
        self.delivered: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        *kind, name = scope["path"].strip("/").split("/")
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(EVENTS):
            if kind == ["fail"] and i == 15:
                raise RuntimeError("fails between two events of one burst")
            await send({"type": "http.response.body", "body": event(name, i), "more_body": True})
            if i % 10 == 9:
                await asyncio.sleep(0)
                if kind in (["slow"], ["fail"]) and i == 9:
                    await self.gate.wait()
        try:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        except ResponseNotDelivered:
            self.left.append(name)
        else:
            self.delivered.append(name)


@asynccontextmanager
async def serving(app: BurstApp, scheduler: str) -> AsyncIterator[Http3Client]:
    cert, key = ensure_certificate()
    server = Http3Server(app, Http3Settings(str(cert), str(key), scheduler=scheduler))
    await server.start("127.0.0.1", 0)
    assert server.port is not None
    try:
        async with Http3Client("localhost", server.port, verify=str(CERT)) as client:
            yield client
    finally:
        server.close()


async def fetch(client: Http3Client, path: str) -> bytes:
    response = await client.request("GET", path)
    assert response.status == 200
    return await response.read()


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
async def test_bursts_arrive_whole_and_in_order_on_every_stream(
    scheduler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = 0
    send_data = H3Connection.send_data

    def counted(self: H3Connection, stream_id: int, data: bytes, end_stream: bool) -> None:
        nonlocal writes
        writes += 1
        send_data(self, stream_id, data, end_stream)

    monkeypatch.setattr(H3Connection, "send_data", counted)
    async with serving(BurstApp(), scheduler) as client:
        names = [f"s{k}" for k in range(12)]
        bodies = await asyncio.gather(*(fetch(client, f"/{name}") for name in names))
    assert bodies == [body(name) for name in names]
    # 41 body messages a response, written in 5 bursts: a write per burst (give or take a
    # transmit falling inside one), not one per event. The client's writes count too: none,
    # its requests have no body.
    assert writes <= 8 * len(names), writes


async def test_a_failure_between_two_events_resets_after_what_was_sent() -> None:
    app = BurstApp()
    async with serving(app, "rr") as client:
        response = await client.request("GET", "/fail/f")
        received = b""
        with pytest.raises(StreamError):
            async for chunk in response.iter_bytes():
                received += chunk
                if received == b"".join(event("f", i) for i in range(10)):
                    app.gate.set()  # the next burst fails half way
        healthy = await fetch(client, "/h")
    # The burst in which it failed never went out, and nothing was sent twice.
    assert received == b"".join(event("f", i) for i in range(10))
    assert healthy == body("h")


async def test_a_client_that_leaves_between_two_events_gets_nothing_twice() -> None:
    app = BurstApp()
    async with serving(app, "fcfs") as client:
        response = await client.request("GET", "/slow/a")
        other = asyncio.ensure_future(fetch(client, "/slow/b"))
        first = b""
        async for chunk in response.iter_bytes():
            first += chunk
            if len(first) >= len(body("a", 10)) - len(b"data: [DONE]\n\n"):
                break
        response.close()  # a reset and STOP_SENDING while the app is between two bursts
        await asyncio.sleep(0.05)
        app.gate.set()
        whole = await other
        for _ in range(200):  # the app's last sends learn who left and who has it all
            if app.left and app.delivered:
                break
            await asyncio.sleep(0.01)
    assert first == b"".join(event("a", i) for i in range(10))
    assert whole == body("b")
    assert (app.left, app.delivered) == (["a"], ["b"])


class StepApp:
    """Answers every request with a stream that `step` writes to: each joined response gets
    `per_step` events a step, as an engine step's tokens reach every running request at once."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.sends: dict[str, Any] = {}
        self.joined = asyncio.Event()
        self.done = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self.sends[scope["path"].strip("/")] = send
        if len(self.sends) == self.streams:
            self.joined.set()
        await self.done.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def step(self, number: int, per_step: int) -> None:
        for name, send in self.sends.items():
            for i in range(per_step):
                data = f"data: {name} {number} {i}\n\n".encode()
                await send({"type": "http.response.body", "body": data, "more_body": True})


async def test_a_steps_tokens_for_n_streams_leave_in_n_stream_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One pass over the connection's streams a step: each stream's tokens of the step in one
    # STREAM frame, not a frame (or a transmit) per token.
    streams, steps, per_step = 8, 5, 3
    frames: list[tuple[int, int]] = []  # (step, stream id) of each STREAM frame with new bytes
    current = -1
    write_stream_frame = QuicConnection._write_stream_frame

    def counted(
        self: QuicConnection, builder: Any, space: Any, stream: Any, max_offset: int
    ) -> int:
        wrote = write_stream_frame(self, builder, space, stream, max_offset=max_offset)
        if wrote and stream.stream_id % 4 == 0:  # a request's stream, not a control stream
            frames.append((current, stream.stream_id))
        return wrote

    monkeypatch.setattr(QuicConnection, "_write_stream_frame", counted)
    app = StepApp(streams)
    async with serving(app, "rr") as client:  # type: ignore[arg-type]
        fetches = [asyncio.ensure_future(fetch(client, f"/s{k}")) for k in range(streams)]
        await app.joined.wait()
        await asyncio.sleep(0.05)  # the responses' heads out and acknowledged
        for number in range(steps):
            current = number
            await app.step(number, per_step)
            await asyncio.sleep(0.02)
        current = steps
        app.done.set()
        bodies = await asyncio.gather(*fetches)
    for k, got in enumerate(bodies):
        name = f"s{k}"
        events = [f"data: {name} {n} {i}\n\n" for n in range(steps) for i in range(per_step)]
        assert got == ("".join(events) + "data: [DONE]\n\n").encode()
    for number in range(steps):
        ids = [stream for step, stream in frames if step == number]
        assert len(ids) == streams and len(set(ids)) == streams, (number, ids)
