"""The engine link: a deployment's engines in a process of their own (`serving.engine_host`),
shared by every front-end worker (`--workers N`), each reaching them over one Unix socket.

Why not each engine behind a `vllm serve`-shaped HTTP server, as remote replicas are reached:
there every token is an SSE event of its own, one read and one parse per token per worker
(docs/results/upstream-gateways.md measures that leg at 40-55 µs a token). Engines step a whole
batch at once, so the link carries a step's tokens together: the host gathers every delta its
engines yield in one pass of its event loop into one frame per worker, as vLLM's engine core
sends each step's outputs to its API servers. The host also reports each replica's load, so
that a worker's router sees what the other workers put there.

Frames are msgpack arrays, each after its length (4 bytes, big-endian):

- worker to host: `["add", request, replica, sampling]` (the `asdict` forms) and
  `["abort", request_id]`;
- host to worker: `["out", [[request_id, text, tokens, prompt_tokens, finish_reason, extra],
  ...]]` (`extra`: None, or a delta's logprobs, echo and cached tokens as a map),
  `["end", request_id]` once the engine is done with a request, `["error", request_id, kind,
  message, param, code]` (`kind`: unavailable, invalid or engine), and `["load", {replica:
  [running, waiting, batch_cap, healthy]}]` every LOAD_REPORT_S while it changes.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any, cast

import msgspec

from config import ReplicaConfig
from serving.engines.base import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
    TokenLogprob,
    UpstreamLoad,
    UpstreamLost,
)
from workloads import Request

log = logging.getLogger(__name__)

LOAD_REPORT_S = 0.01
"""How often the host tells its workers each replica's load, while it changes: the staleness of
the other workers' share in a worker's view."""

CONNECT_TIMEOUT_S = 5.0

_LENGTH = struct.Struct(">I")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
_EXTRA = ("logprobs", "prompt_text", "prompt_logprobs", "cached_tokens")


class _Extra(msgspec.Struct):
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_text: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    cached_tokens: int | None = None


def delta_row(request_id: str, delta: TokenDelta) -> list[Any]:
    """A delta as the host sends it: a flat row, with the rare fields only where set."""
    extra = None
    if (
        delta.logprobs
        or delta.prompt_text is not None
        or delta.prompt_logprobs is not None
        or delta.cached_tokens is not None
    ):
        extra = msgspec.to_builtins(
            _Extra(delta.logprobs, delta.prompt_text, delta.prompt_logprobs, delta.cached_tokens)
        )
    return [request_id, delta.text, delta.tokens, delta.prompt_tokens, delta.finish_reason, extra]


def _delta(row: list[Any]) -> TokenDelta:
    _, text, tokens, prompt_tokens, finish_reason, extra = row
    if extra is None:
        return TokenDelta(text, tokens, prompt_tokens, finish_reason)
    rare = msgspec.convert(extra, _Extra)
    return TokenDelta(
        text, tokens, prompt_tokens, finish_reason, *(getattr(rare, f) for f in _EXTRA)
    )


class FrameReader:
    """Frames out of a byte stream, however it is split."""

    def __init__(self, on_frame: Callable[[list[Any]], None]) -> None:
        self._buffer = bytearray()
        self._on_frame = on_frame

    def feed(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= 4:
            (size,) = _LENGTH.unpack_from(buffer, start)
            end = start + 4 + size
            if len(buffer) < end:
                break
            self._on_frame(_decode(memoryview(buffer)[start + 4 : end]))
            start = end
        del buffer[:start]


def frame(message: list[Any]) -> bytes:
    body = _encode(message)
    return _LENGTH.pack(len(body)) + body


class _Open:
    """A request in flight over the link: what the host has sent of it, not yet read."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: asyncio.Queue[TokenDelta | BaseException | None] = asyncio.Queue()


class EngineLink(asyncio.Protocol):
    """A worker's one connection to the engine host, shared by its `LinkedEngine`s."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader(self._on_frame)
        self._open: dict[str, _Open] = {}
        self._loads: dict[str, list[Any]] = {}
        self._load_at = 0.0
        self._connecting: asyncio.Lock | None = None
        self._reported: asyncio.Event | None = None

    @property
    def connected(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    async def connect(self) -> None:
        """Connect, unless connected; EngineUnavailable if the host does not answer."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self.connected:
                return
            loop = asyncio.get_running_loop()
            self._reported = asyncio.Event()
            try:
                await loop.create_unix_connection(lambda: self, self.path)
                # The host reports its replicas at once: until then none looks healthy.
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await self._reported.wait()
            except (OSError, TimeoutError) as exc:
                self.close()
                raise EngineUnavailable(f"no engine host at {self.path}: {exc!r}") from exc
            log.info("engine link to %s open", self.path)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports have asyncio.Transport's methods but not
        # its class (`--loop uvloop`).
        self._transport = cast(asyncio.Transport, transport)
        self._reader = FrameReader(self._on_frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._loads.clear()
        log.warning(
            "engine link to %s lost: %d requests in flight fail", self.path, len(self._open)
        )
        for held in self._open.values():
            held.queue.put_nowait(UpstreamLost(f"lost the engine host at {self.path}"))
        self._open.clear()

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)

    def _on_frame(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "out":
            for row in message[1]:
                held = self._open.get(row[0])
                if held is not None:
                    held.queue.put_nowait(_delta(row))
        elif kind == "end":
            held = self._open.pop(message[1], None)
            if held is not None:
                held.queue.put_nowait(None)
        elif kind == "error":
            _, request_id, what, text, param, code = message
            held = self._open.pop(request_id, None)
            if held is not None:
                held.queue.put_nowait(_error(what, text, param, code))
        elif kind == "load":
            self._loads.update(message[1])
            self._load_at = time.monotonic()
            if self._reported is not None:
                self._reported.set()

    def send(self, message: list[Any]) -> None:
        if self._transport is None:
            raise EngineUnavailable(f"no engine host at {self.path}")
        self._transport.write(frame(message))

    def open(self, request: Request, replica: str, sampling: Sampling) -> _Open:
        if request.request_id in self._open:
            raise EngineError(f"{replica}: request id {request.request_id} is in use")
        self.send(["add", asdict(request), replica, asdict(sampling)])
        held = self._open[request.request_id] = _Open()
        return held

    def forget(self, request_id: str) -> bool:
        """Stop waiting for a request; whether it was still open."""
        return self._open.pop(request_id, None) is not None

    def report(self, replica: str) -> list[Any] | None:
        """The host's last word on `replica`: running, waiting, batch cap, healthy."""
        return self._loads.get(replica)

    @property
    def load_at(self) -> float:
        """When the last load report came (`time.monotonic()`)."""
        return self._load_at

    def cancel(self, request_id: str, error: BaseException) -> None:
        """End an open request here with `error`, and have the host abort it."""
        held = self._open.pop(request_id, None)
        if held is not None:
            held.queue.put_nowait(error)
            if self.connected:
                self.send(["abort", request_id])

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _error(kind: str, text: str, param: str | None, code: str | None) -> Exception:
    if kind == "unavailable":
        return EngineUnavailable(text)
    if kind == "invalid":
        return InvalidRequest(text, param, code)
    return EngineError(text)


class LinkedEngine:
    """A replica whose engine runs in the engine host: the `Engine` interface over the link."""

    def __init__(self, config: ReplicaConfig, link: EngineLink) -> None:
        self.config = config
        self._link = link
        self._mine: set[str] = set()

    async def start(self) -> None:
        await self._link.connect()

    def healthy(self) -> bool:
        report = self._link.report(self.config.name)
        return self._link.connected and report is not None and bool(report[3])

    async def recover(self) -> None:
        await self._link.connect()
        if not self.healthy():
            raise EngineUnavailable(f"{self.config.name}: down in the engine host")

    def unfinished(self) -> int:
        return len(self._mine)

    def load(self) -> UpstreamLoad | None:
        report = self._link.report(self.config.name)
        if report is None:
            return None
        running, waiting, batch_cap, _ = report
        others = max(0, running + waiting - len(self._mine))
        return UpstreamLoad(running, waiting, None, others, batch_cap, self._link.load_at)

    async def generate(self, request: Request, sampling: Sampling) -> AsyncIterator[TokenDelta]:
        if not self.healthy():
            raise EngineUnavailable(f"{self.config.name}: not running in the engine host")
        request_id = request.request_id
        held = self._link.open(request, self.config.name, sampling)
        self._mine.add(request_id)
        try:
            while (item := await held.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._mine.discard(request_id)
            if self._link.forget(request_id) and self._link.connected:
                self._link.send(["abort", request_id])  # closed early: the host frees its slot

    async def abort(self, request_id: str) -> None:
        self._link.cancel(request_id, EngineError(f"{self.config.name}: aborted"))

    async def close(self) -> None:
        self._link.close()
