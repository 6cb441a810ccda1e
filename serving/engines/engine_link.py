"""The engine link: a deployment's engines in a process of their own (`serving.engine_host`),
shared by every front-end worker (`--workers N`), each reaching them over one Unix socket; or
on another host, over TCP (`--listen HOST:PORT`), where every front-end host's workers connect.

Why not each engine behind a `vllm serve`-shaped HTTP server, as remote replicas are reached:
there every token is an SSE event of its own, one read and one parse per token per worker
(docs/results/upstream-gateways.md measures that leg at 40-55 µs a token). Engines step a whole
batch at once, so the link carries a step's tokens together: the host gathers every delta its
engines yield in one pass of its event loop into one frame per worker, as vLLM's engine core
sends each step's outputs to its API servers. The host also reports each replica's load, so
that a worker's router sees what the other workers put there.

Frames are msgpack arrays, each after its length (4 bytes, big-endian):

- worker to host: first `["hello", token]` (its link token, or None), which a host with a
  token checks; then `["add", request, replica, sampling]` (the `asdict` forms),
  `["abort", request_id]`, and `["rate", sender, level]` (its arrival rate's level, which the
  host passes on to every other front-end, as `["rate", sender, level]`: `serving.fleet_rate`);
- host to worker: `["out", [[request_id, text, tokens, prompt_tokens, finish_reason, extra],
  ...]]` (`extra`: None, or a delta's logprobs, echo and cached tokens as a map),
  `["end", request_id]` once the engine is done with a request, `["error", request_id, kind,
  message, param, code]` (`kind`: unavailable, invalid or engine), and `["load", {replica:
  [running, waiting, batch_cap, healthy]}]` first, then every LOAD_REPORT_S while it
  changes and every HEARTBEAT_S while it does not; or, to a worker whose hello it refuses,
  `["refused", why]`, and the connection closes.

The token is a shared secret (`--link-token-file`: a Kubernetes Secret mounted on every host),
compared in constant time. It keeps whatever else runs on the cluster's network from using or
disturbing the engines. That is enough where the network between the hosts is the cluster's
own, as it is for vLLM's and sglang's workers, whose ports take no credential at all: the link
carries prompts in the clear, so a network others can read needs encryption under it (a
service mesh's mTLS, or a CNI that encrypts, such as WireGuard in Cilium or Calico).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
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
from transport.stateless_reset import PLACEHOLDER
from workloads import Request

log = logging.getLogger(__name__)

LOAD_REPORT_S = 0.01
"""How often the host tells its workers each replica's load, while it changes: the staleness of
the other workers' share in a worker's view."""

HEARTBEAT_S = 1.0
"""How often a host reports loads that did not change: it says the host is still there."""
SILENT_S = 3.0
"""A host on another host (TCP) not heard from for this long is taken for lost, as a crashed
node sends no FIN: its requests fail and its replicas leave the view until it answers again."""

CONNECT_TIMEOUT_S = 5.0
"""How long a front-end waits for an engine host's first report, and a host with a token for a
front-end's hello."""
MIN_TOKEN_CHARS = 16
MAX_HELLO_BYTES = 4096
"""The largest first frame a host with a token takes for a hello: a stranger's bytes (a port
scanner's, an HTTP request's) claim more, and are refused rather than buffered."""


def read_link_token(path: str) -> str:
    """The link token in file `path` (a mounted Secret), surrounding whitespace dropped;
    ValueError where it is too short to guess at no cost."""
    token = Path(path).read_text(encoding="utf-8").strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{path}: a link token needs {MIN_TOKEN_CHARS} characters or more")
    if token.startswith(PLACEHOLDER.decode()):
        raise ValueError(f"{path}: the link token is still the manifests' placeholder")
    return token


def link_address(address: str) -> tuple[str, int] | str:
    """Where a link is: (host, port) for HOST:PORT ([v6]:PORT), else a Unix socket's path."""
    host, colon, port = address.rpartition(":")
    if "/" in address or not colon or not port.isdigit():
        return address
    return host.removeprefix("[").removesuffix("]"), int(port)


def rate_frame(message: list[Any]) -> tuple[str, float] | None:
    """A `["rate", sender, level]` frame's sender and level; None where it is not one (a
    front-end of another version): passed on and heard only where well formed."""
    if len(message) != 3 or not isinstance(message[1], str):
        return None
    level = message[2]
    if isinstance(level, bool) or not isinstance(level, int | float):
        return None
    if not math.isfinite(level) or level < 0:
        return None
    return message[1], float(level)


def keep_alive(transport: asyncio.BaseTransport) -> None:
    """TCP keepalive on a link's socket, probing after KEEPALIVE_S of quiet, and a user timeout
    for data left unacknowledged as long: a peer whose node vanished (no FIN) is let go by the
    kernel in about twice that, on either side, whatever the link carries (a host that goes on
    writing heartbeats to a dead front-end too)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_S), ("TCP_KEEPINTVL", 1),
                          ("TCP_KEEPCNT", KEEPALIVE_S),
                          ("TCP_USER_TIMEOUT", 2 * KEEPALIVE_S * 1000)):  # fmt: skip
        if hasattr(socket, option):  # Linux's names
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


KEEPALIVE_S = 5

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

    def next_size(self, data: bytes) -> int | None:
        """The size the next frame claims, with `data` added; None until 4 bytes are in."""
        head = bytes(self._buffer[:4]) + data[: max(0, 4 - len(self._buffer))]
        return _LENGTH.unpack(head)[0] if len(head) == 4 else None

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
    """A worker's one connection to an engine host, shared by its `LinkedEngine`s there.
    `address`: a Unix socket's path, or HOST:PORT; `token`: the host's link token; `on_lost`:
    called when the connection is lost."""

    def __init__(
        self, address: str, token: str | None = None, on_lost: Callable[[], None] | None = None
    ) -> None:
        self.path = address
        self.remote = not isinstance(link_address(address), str)
        """On another host (TCP), not this server's own engine host."""
        self._token = token
        self._on_lost = on_lost
        self._heard_at = 0.0
        self._closed = False
        """Closed here, on purpose: its end is no loss."""
        self._retired = False
        """Closed for good (a host that left DNS): never connected again."""
        self.on_rate: Callable[[str, float], None] | None = None
        """Hears another front-end's arrival-rate level, which the host passed on."""
        self._refused: str | None = None
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader(self._on_frame)
        self._open: dict[str, _Open] = {}
        self._loads: dict[str, list[Any]] = {}
        self._load_at = 0.0
        self._connecting: asyncio.Lock | None = None
        self._reported: asyncio.Event | None = None

    @property
    def refused(self) -> str | None:
        """Why the host last refused this front-end (its token); None if it did not."""
        return self._refused

    @property
    def connected(self) -> bool:
        """Connected, and not silent past SILENT_S (on TCP: a lost host's connection is
        closed here, failing its requests)."""
        if self._transport is None or self._transport.is_closing():
            return False
        if self.remote and time.monotonic() - self._heard_at > SILENT_S:
            log.warning("engine host at %s silent for %g s: taken for lost", self.path, SILENT_S)
            self._transport.abort()  # connection_lost comes in the next pass of the loop
            return False
        return True

    @property
    def in_flight(self) -> int:
        """Requests sent over the link that have not ended."""
        return len(self._open)

    async def connect(self) -> None:
        """Connect, unless connected; EngineUnavailable if the host does not answer."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self.connected:
                return
            if self._retired:
                raise EngineUnavailable(f"the link to {self.path} is closed for good")
            loop = asyncio.get_running_loop()
            self._reported = asyncio.Event()
            self._refused = None
            self._closed = False
            where = link_address(self.path)
            try:
                # One bound for the connect and the first report: an address that drops packets
                # (a dead node's, still in DNS) would hold a bare connect for the kernel's two
                # minutes of SYN retries.
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    if isinstance(where, str):
                        await loop.create_unix_connection(lambda: self, where)
                    else:
                        await loop.create_connection(lambda: self, *where)
                    # The host reports its replicas at once: until then none looks healthy.
                    await self._reported.wait()
            except (OSError, TimeoutError) as exc:
                self.close()
                raise EngineUnavailable(f"no engine host at {self.path}: {exc!r}") from exc
            if self._refused is not None:
                self.close()
                log.error("the engine host at %s refused this front-end: %s", self.path,
                          self._refused)  # fmt: skip
                raise EngineUnavailable(
                    f"the engine host at {self.path} refused this front-end: {self._refused}"
                )
            log.info("engine link to %s open", self.path)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not an isinstance check: uvloop's transports have asyncio.Transport's methods but not
        # its class (`--loop uvloop`).
        self._transport = cast(asyncio.Transport, transport)
        self._reader = FrameReader(self._on_frame)
        self._heard_at = time.monotonic()
        if self._retired:  # retired while it connected: not wanted any more
            self._transport.close()
            return
        if self.remote:
            keep_alive(self._transport)
        self._transport.write(frame(["hello", self._token]))  # None where it has none

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._loads.clear()
        if self._closed and not self._open:
            log.info("engine link to %s closed", self.path)
            return
        log.warning(
            "engine link to %s lost: %d requests in flight fail", self.path, len(self._open)
        )
        for held in self._open.values():
            held.queue.put_nowait(UpstreamLost(f"lost the engine host at {self.path}"))
        self._open.clear()
        if self._on_lost is not None:
            self._on_lost()

    def data_received(self, data: bytes) -> None:
        self._heard_at = time.monotonic()
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
        elif kind == "rate":
            if self.on_rate is not None and (rate := rate_frame(message)) is not None:
                self.on_rate(*rate)
        elif kind == "refused":
            self._refused = str(message[1])
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
        self._closed = True
        if self._transport is not None:
            self._transport.close()

    def retire(self) -> None:
        """Close, and never connect again (a connect under way fails)."""
        self._retired = True
        self.close()


def _error(kind: str, text: str, param: str | None, code: str | None) -> Exception:
    if kind == "unavailable":
        return EngineUnavailable(text)
    if kind == "invalid":
        return InvalidRequest(text, param, code)
    return EngineError(text)


class HostSlot:
    """Where a replica's engine host is: the link to it, or None while none holds the place (a
    slot of hosts found through DNS, `serving.discovery`, that no host fills)."""

    __slots__ = ("link",)

    def __init__(self, link: EngineLink | None = None) -> None:
        self.link = link


class LinkedEngine:
    """A replica whose engine runs in an engine host: the `Engine` interface over the link of
    its slot. The host knows it as `config.host_name`."""

    def __init__(self, config: ReplicaConfig, slot: HostSlot) -> None:
        self.config = config
        self._name = config.host_name
        self._slot = slot
        self._mine: dict[str, EngineLink] = {}
        """Its requests in flight, each with the link it went over: a slot's host can change
        under a request, which goes on with the host it started on."""

    @property
    def link(self) -> EngineLink | None:
        return self._slot.link

    async def start(self) -> None:
        link = self._slot.link
        if link is None:
            log.warning("%s: no engine host found for it yet", self.config.name)
            return
        try:
            await link.connect()
        except EngineUnavailable:
            # An engine host on another host that is not up yet is an outage for the supervisor
            # to ride out, as a remote server's is; a refusal is a configuration error.
            if not link.remote or link.refused is not None:
                raise
            log.warning("%s: no engine host at %s yet", self.config.name, link.path)

    def healthy(self) -> bool:
        link = self._slot.link
        if link is None:
            return False
        report = link.report(self._name)
        return report is not None and bool(report[3]) and link.connected

    async def recover(self) -> None:
        link = self._slot.link
        if link is None:
            raise EngineUnavailable(f"{self.config.name}: no engine host found for it")
        await link.connect()
        if not self.healthy():
            raise EngineUnavailable(f"{self.config.name}: down in the engine host")

    def unfinished(self) -> int:
        return len(self._mine)

    def load(self) -> UpstreamLoad | None:
        link = self._slot.link
        report = None if link is None else link.report(self._name)
        if link is None or report is None:
            return None
        running, waiting, batch_cap, _ = report
        others = max(0, running + waiting - len(self._mine))
        return UpstreamLoad(running, waiting, None, others, batch_cap, link.load_at)

    async def generate(self, request: Request, sampling: Sampling) -> AsyncIterator[TokenDelta]:
        link = self._slot.link
        if link is None or not self.healthy():
            raise EngineUnavailable(f"{self.config.name}: not running in an engine host")
        request_id = request.request_id
        held = link.open(request, self._name, sampling)
        self._mine[request_id] = link
        try:
            while (item := await held.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._mine.pop(request_id, None)
            if link.forget(request_id) and link.connected:
                link.send(["abort", request_id])  # closed early: the host frees its slot

    async def abort(self, request_id: str) -> None:
        link = self._mine.get(request_id)
        if link is not None:
            link.cancel(request_id, EngineError(f"{self.config.name}: aborted"))

    async def close(self) -> None:
        if self._slot.link is not None:
            self._slot.link.close()
