"""`python -m benchmarks.upstream_leg`: what the upstream leg costs per token, as shipped and as a
hand-written client could at best make it: could it bring the server's CPU per request to the
target of at most twice sglang-router's?

One null upstream (`workloads.null_server`, first token at 20 ms, then one every 10 ms) on CPU 1;
this process on CPU 0 keeps `--streams` chat streams of 64 tokens open against it and reads
them, for `--seconds` a run, in interleaved rounds. CPU per token is this process's CPU time over
the tokens read. The ways to read them:

- `shipped`: `RemoteEngine.generate` (aiohttp's pooled client, msgspec per chunk), pumped by a
  task into a queue that the reader drains, as `serving.gateway.Generation` does;
- `raw`: an `asyncio.Protocol` with httptools parsing the response on the connection, the SSE
  split and msgspec decode in `data_received`, into a queue read by an async generator that
  the same pump drains: aiohttp's client replaced, the engine interface kept;
- `raw-push`: the same protocol pushing straight into the reader's queue, no pump task: the
  engine interface changed as well.

The raw client here has none of what a shipped one needs (errors, timeouts, aborts, a pool
that closes idle connections), so its numbers are a floor for that design, not its price.
`--loops asyncio,uvloop` repeats each on uvloop's event loop.

    python -m benchmarks.upstream_leg                        # about 2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httptools
import msgspec

from benchmarks.common import MODEL, start_upstreams
from config import ReplicaConfig
from serving.engines.base import Sampling, TokenDelta
from serving.engines.remote import RemoteEngine, decode_chunk
from workloads import Message, Request

TOKENS = 64
PROMPT = (Message("user", "hi " * 128),)
WAYS = ("shipped", "raw", "raw-push")
_END = object()

Sink = Callable[[Any], None]


class _Connection(asyncio.Protocol):
    """One keep-alive connection: the response parsed as it arrives, each SSE event's data
    handed to `sink`, then `_END`, and the connection back into `pool`."""

    def __init__(self, pool: list[_Connection]) -> None:
        self.pool = pool
        self.transport: Any = None  # asyncio's or uvloop's TCP transport
        self.parser = httptools.HttpResponseParser(self)
        self.sink: Sink | None = None
        self.rest = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        events = (self.rest + body).split(b"\n\n")
        self.rest = events.pop()
        assert self.sink is not None
        for event in events:
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                self.sink(event[6:])

    def on_message_complete(self) -> None:
        sink, self.sink = self.sink, None
        assert sink is not None
        sink(_END)
        self.parser = httptools.HttpResponseParser(self)
        self.pool.append(self)


class _RawClient:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.pool: list[_Connection] = []

    async def send(self, sink: Sink) -> None:
        while self.pool and (held := self.pool.pop()).transport is not None:
            if not held.transport.is_closing():
                break
        else:
            loop = asyncio.get_running_loop()
            _, held = await loop.create_connection(
                lambda: _Connection(self.pool), self.host, self.port
            )
        body = msgspec.json.encode(
            {"model": MODEL, "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
             "messages": [{"role": m.role, "content": m.content} for m in PROMPT],
             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        )  # fmt: skip
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        held.sink = sink
        assert held.transport is not None
        held.transport.write(head + body)


def _decoding(put: Sink) -> Sink:
    """A sink that decodes each chunk as `RemoteEngine` does and puts its delta."""
    generated = 0

    def sink(data: Any) -> None:
        nonlocal generated
        if data is _END:
            put(_END)
            return
        chunk = decode_chunk(data)
        if not chunk.choices or chunk.usage is None:
            return
        choice, usage = chunk.choices[0], chunk.usage
        delta = choice.delta
        put(
            TokenDelta(
                text=(delta.content if delta is not None else choice.text) or "",
                tokens=usage.completion_tokens - generated,
                prompt_tokens=usage.prompt_tokens,
                finish_reason=choice.finish_reason,
            )
        )
        generated = usage.completion_tokens

    return sink


async def _pumped(deltas: AsyncIterator[TokenDelta]) -> int:
    """Read `deltas` as `Generation` does: a task pumps them into a queue that this drains."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        async for delta in deltas:
            queue.put_nowait(delta)
        queue.put_nowait(_END)

    task = asyncio.create_task(pump())
    tokens = 0
    while (item := await queue.get()) is not _END:
        tokens += item.tokens
    await task
    return tokens


async def _run(way: str, url: str, seconds: float, streams: int) -> tuple[int, float, float]:
    engine = RemoteEngine(_replica(url))
    await engine.start()
    raw = _RawClient(url)
    ids = itertools.count()

    async def one() -> int:
        if way == "shipped":
            request = Request(f"r{next(ids)}", 0.0, PROMPT, TOKENS, "free-tier")
            return await _pumped(engine.generate(request, Sampling(ignore_eos=True)))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        await raw.send(_decoding(queue.put_nowait))
        if way == "raw":

            async def deltas() -> AsyncIterator[TokenDelta]:
                while (item := await queue.get()) is not _END:
                    yield item

            return await _pumped(deltas())
        tokens = 0
        while (item := await queue.get()) is not _END:
            tokens += item.tokens
        return tokens

    async def keep_one_open(until: float) -> int:
        tokens = 0
        while time.monotonic() < until:
            tokens += await one()
        return tokens

    try:
        await asyncio.gather(*(one() for _ in range(streams)))  # connections made, code warm
        cpu, wall = time.process_time(), time.monotonic()
        counts = await asyncio.gather(*(keep_one_open(wall + seconds) for _ in range(streams)))
        return sum(counts), time.process_time() - cpu, time.monotonic() - wall
    finally:
        await engine.close()
        for held in raw.pool:
            if held.transport is not None:
                held.transport.close()


def _replica(url: str) -> ReplicaConfig:
    return ReplicaConfig(
        name="remote/null", model=MODEL, source=MODEL, device=None, url=url + "/v1",
        served_name=MODEL, memory_fraction=None, kv_cache_gib=None, cpu_cores=None,
        engine_args={}, chat_template=None, fallback_chat_template=None, build=None, scrape_s=0,
    )  # fmt: skip


def _on(loop: str, main: Any) -> Any:
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.upstream_leg",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--loops", default="asyncio", help="asyncio, uvloop or both")
    parser.add_argument("--streams", type=int, default=50, help="streams kept open")
    parser.add_argument("--seconds", type=float, default=10.0, help="per run")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    ways, loops = args.ways.split(","), args.loops.split(",")
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})
    cost: dict[tuple[str, str], list[float]] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as folder:
        (url,) = start_upstreams(stack, Path(folder), [(20.0, 10.0)])
        for round_, loop, way in itertools.product(range(args.rounds), loops, ways):
            tokens, cpu, wall = _on(loop, _run(way, url, args.seconds, args.streams))
            cost.setdefault((loop, way), []).append(cpu / tokens * 1e6)
            print(f"round {round_} {loop:7s} {way:8s}: {tokens / wall:6.0f} tokens/s, "
                  f"{cpu / tokens * 1e6:5.1f} µs CPU per token", file=sys.stderr)  # fmt: skip
    base = statistics.median(cost[(loops[0], ways[0])])
    print(f"\n{args.streams} streams, median of {args.rounds} rounds ({sys.platform}, "
          f"{os.cpu_count()} CPUs)\n")  # fmt: skip
    print(f"| loop | way | µs CPU per token | vs {loops[0]} {ways[0]} |\n|---|---|---|---|")
    for (loop, way), values in cost.items():
        median = statistics.median(values)
        print(f"| {loop} | {way} | {median:.1f} | {median / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
