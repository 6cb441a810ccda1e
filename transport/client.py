"""An HTTP/3 client on one long-lived QUIC connection, with a stream scheduler for its requests.

`Http3Client` multiplexes requests as streams on one connection: the edge front-end forwards
through it and the load generator drives the server with it. `stream_chat` adds the OpenAI
chat-completions call on top and times it. `python -m transport.client "prompt"` is the CLI.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from aioquic.asyncio import connect
from aioquic.h3.connection import H3_ALPN, ErrorCode, H3Connection
from aioquic.h3.events import DatagramReceived, DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset

from transport.connection import (
    CoalescingProtocol,
    ScheduledQuicConnection,
    StreamExpired,
    adopt,
)
from transport.eloquent import EloquentFormatError, EloquentReceiver, SseEvents
from transport.schedulers import StreamSpec


class StreamError(Exception):
    """The response stream ended abnormally: reset by the peer or the connection closed."""

    def __init__(self, message: str, error_code: int | None = None) -> None:
        super().__init__(message)
        self.error_code = error_code


@dataclass
class Response:
    stream_id: int
    status: int
    headers: dict[str, str]
    _client: Http3Client
    _chunks: asyncio.Queue[bytes | StreamError | None]
    lane: EloquentLane | None = None
    """Set when the response carries Eloquent datagrams: its receiver has the render times."""
    _done: bool = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        while not self._done:
            chunk = await self._chunks.get()
            if chunk is None:
                self._done = True
                return
            if isinstance(chunk, StreamError):
                self._done = True
                raise chunk
            if chunk:
                yield chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_bytes()])

    async def iter_lines(self) -> AsyncIterator[str]:
        buffer = b""
        async for chunk in self.iter_bytes():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode().rstrip("\r")
        if buffer:
            yield buffer.decode()

    def close(self) -> None:
        """Abandon the response: the server sees the stream reset (a client disconnect)."""
        if not self._done:
            self._done = True
            self._client._cancel(self.stream_id)


@dataclass
class _Pending:
    headers: asyncio.Future[list[tuple[bytes, bytes]]]
    chunks: asyncio.Queue[bytes | StreamError | None] = field(default_factory=asyncio.Queue)
    lane: EloquentLane | None = None


class EloquentLane:
    """The receiving end of Eloquent for one response (`transport.eloquent`, Algorithm 2).

    Events of the event stream arrive by the stream and by datagrams; the response's body is
    the longest contiguous run of events from whichever came first, so a reader sees the same
    bytes as without Eloquent, only sooner. Every datagram is acknowledged by a datagram."""

    def __init__(self, protocol: _ClientProtocol, stream_id: int, chunks: asyncio.Queue) -> None:
        self.protocol = protocol
        self.stream_id = stream_id
        self.receiver = EloquentReceiver()
        self.active = False
        """The response said it carries Eloquent; until then, rendered events wait."""
        self._events = SseEvents()
        self._chunks = chunks
        self.streamed = 0
        """Events the stream has delivered so far."""
        self._emitted = 0
        self._loop = asyncio.get_running_loop()

    def stream(self, data: bytes) -> None:
        now = self._loop.time()
        for event in self._events.feed(data):
            ack = self.receiver.on_stream_delta(self.streamed, event, now)
            self.streamed += 1
            if ack is not None:
                self._ack(ack)
        self._emit()

    def datagram(self, payload: bytes) -> None:
        try:
            ack = self.receiver.on_datagram(payload, self._loop.time())
        except EloquentFormatError:
            return  # the stream will deliver it
        self._ack(ack)
        self._emit()

    def end(self) -> None:
        if rest := self._events.rest():  # a body that did not end on an event boundary
            self._chunks.put_nowait(rest)

    def _ack(self, payload: bytes) -> None:
        self.protocol.h3.send_datagram(self.stream_id, payload)
        self.protocol.transmit_soon()

    def _emit(self) -> None:
        if not self.active:
            return
        while self._emitted < self.receiver.next_position:
            self._chunks.put_nowait(self.receiver.text_of(self._emitted).encode())
            self._emitted += 1


class _ClientProtocol(CoalescingProtocol):
    def __init__(self, quic: Any, scheduler: str = "rr", **kwargs: Any) -> None:
        super().__init__(adopt(quic, scheduler), **kwargs)
        self.h3 = H3Connection(self._quic, enable_webtransport=True)
        self.pending: dict[int, _Pending] = {}
        self.closed: StreamError | None = None

    @property
    def quic(self) -> ScheduledQuicConnection:
        return self._quic  # type: ignore[return-value]

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamReset | StreamExpired):
            code = getattr(event, "error_code", ErrorCode.H3_REQUEST_CANCELLED)
            self._fail(event.stream_id, StreamError(f"stream reset (error {code:#x})", code))
        elif isinstance(event, ConnectionTerminated):
            self.closed = StreamError(
                f"connection closed: {event.reason_phrase or 'no reason'} "
                f"(error {event.error_code:#x})",
                event.error_code,
            )
            for stream_id in list(self.pending):
                self._fail(stream_id, self.closed)
        for h3_event in self.h3.handle_event(event):
            self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        pending = self.pending.get(event.stream_id) if hasattr(event, "stream_id") else None
        if pending is None:
            return
        lane = pending.lane
        if isinstance(event, HeadersReceived):
            if lane is not None and (b"x-eloquent", b"1") in event.headers:
                lane.active = True
                lane.stream(b"")  # events that datagrams delivered before the headers
            else:
                pending.lane = lane = None
            if not pending.headers.done():
                pending.headers.set_result(event.headers)
        elif isinstance(event, DataReceived):
            if lane is not None:
                lane.stream(event.data)
            else:
                pending.chunks.put_nowait(event.data)
        elif isinstance(event, DatagramReceived) and lane is not None:
            lane.datagram(event.data)
        if getattr(event, "stream_ended", False):
            if lane is not None:
                lane.end()
            pending.chunks.put_nowait(None)
            self.pending.pop(event.stream_id, None)

    def _fail(self, stream_id: int, error: StreamError) -> None:
        pending = self.pending.pop(stream_id, None)
        if pending is None:
            return
        if not pending.headers.done():
            pending.headers.set_exception(error)
        pending.chunks.put_nowait(error)


def client_configuration(
    verify: bool | str = True, server_name: str | None = None
) -> QuicConfiguration:
    """`verify`: True (system CAs), False (accept any certificate) or a CA/cert file path."""
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536
    )
    if verify is False:
        configuration.verify_mode = ssl.CERT_NONE
    elif isinstance(verify, str):
        configuration.load_verify_locations(verify)
    configuration.server_name = server_name
    return configuration


class Http3Client:
    """`async with Http3Client(host, port) as client: response = await client.request(...)`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        verify: bool | str = True,
        scheduler: str = "rr",
        server_name: str | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.authority = f"{host}:{port}"
        self._configuration = client_configuration(verify, server_name or host)
        self._scheduler = scheduler
        self._context: Any = None
        self._protocol: _ClientProtocol | None = None

    async def __aenter__(self) -> Http3Client:
        def create_protocol(connection: Any, **kwargs: Any) -> _ClientProtocol:
            return _ClientProtocol(connection, scheduler=self._scheduler, **kwargs)

        self._context = connect(
            self.host,
            self.port,
            configuration=self._configuration,
            create_protocol=create_protocol,
            wait_connected=True,
        )
        self._protocol = await self._context.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._context is not None:
            await self._context.__aexit__(None, None, None)
            self._context = None

    @property
    def closed(self) -> StreamError | None:
        """Why the connection closed, once it has."""
        return self._protocol.closed if self._protocol is not None else None

    @property
    def is_open(self) -> bool:
        return self._protocol is not None and self._protocol.closed is None

    @property
    def protocol(self) -> _ClientProtocol:
        if self._protocol is None:
            raise RuntimeError("Http3Client is not connected; use `async with`")
        if self._protocol.closed is not None:
            raise self._protocol.closed
        return self._protocol

    async def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        spec: StreamSpec | None = None,
        eloquent: bool = False,
    ) -> Response:
        """Send a request on a new stream and wait for the response headers.
        `spec` tags the stream for this connection's scheduler. `eloquent` asks for the body's
        events in datagrams too (`x-eloquent: 1`); `Response.lane` then has the receiver."""
        protocol = self.protocol
        quic = protocol.quic
        stream_id = quic.get_next_available_stream_id()
        if spec is not None:
            quic.set_stream_spec(stream_id, spec)
        pending = _Pending(asyncio.get_running_loop().create_future())
        if eloquent:
            pending.lane = EloquentLane(protocol, stream_id, pending.chunks)
            headers = {**(headers or {}), "x-eloquent": "1"}
        protocol.pending[stream_id] = pending
        fields = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self.authority.encode()),
            (b":path", path.encode()),
        ] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        protocol.h3.send_headers(stream_id, fields, end_stream=not body)
        if body:
            protocol.h3.send_data(stream_id, body, end_stream=True)
        protocol.transmit_soon()
        try:
            raw = await pending.headers
        except asyncio.CancelledError:
            self._cancel(stream_id)
            raise
        named = {k.decode(): v.decode() for k, v in raw}
        status = int(named.pop(":status", "0"))
        return Response(stream_id, status, named, self, pending.chunks, pending.lane)

    def _cancel(self, stream_id: int) -> None:
        protocol = self._protocol
        if protocol is None or protocol.closed is not None:
            return
        protocol.pending.pop(stream_id, None)
        with suppress(ValueError):  # the stream already finished
            protocol.quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            protocol.quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        protocol.transmit_soon()


@dataclass
class ChatResult:
    text: str
    model: str | None
    replica: str | None
    status: int
    ttft_s: float | None
    itl_s: list[float]
    usage: dict[str, int] | None = None
    error: str | None = None
    e2el_s: float | None = None
    """From sending the request to the end of its stream."""

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None


async def stream_chat(
    client: Http3Client,
    messages: list[dict[str, str]],
    *,
    model: str = "auto",
    max_tokens: int = 64,
    headers: Mapping[str, str] | None = None,
    on_token: Callable[[str], None] | None = None,
    spec: StreamSpec | None = None,
    extra: Mapping[str, Any] | None = None,
    eloquent: bool = False,
) -> ChatResult:
    """One streamed chat completion; TTFT and inter-token gaps are taken at the client, when
    the text can be shown (with `eloquent`, from whichever path delivered it first)."""
    loop = asyncio.get_running_loop()
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    start = loop.time()
    response = await client.request(
        "POST",
        "/v1/chat/completions",
        {"content-type": "application/json", **(headers or {})},
        json.dumps(body).encode(),
        spec,
        eloquent,
    )
    result = ChatResult("", response.headers.get("x-model"), response.headers.get("x-replica"),
                        response.status, None, [])  # fmt: skip
    if response.status != 200:
        payload = (await response.read()).decode(errors="replace")
        result.error = error_message(payload)
        return result
    try:
        await read_chat_stream(response.iter_lines(), result, start, on_token)
    except StreamError as exc:
        result.error = str(exc)
    finally:
        response.close()
    return result


async def read_chat_stream(
    lines: AsyncIterator[str],
    result: ChatResult,
    start: float,
    on_token: Callable[[str], None] | None = None,
) -> None:
    """Fold a chat-completions SSE stream into `result`, timing each content chunk against
    `start` (the event loop's clock when the request went out). Any HTTP client's line iterator
    will do, so every protocol is timed by the same code."""
    loop = asyncio.get_running_loop()
    last: float | None = None
    done = False
    async for line in lines:
        if line == "data: [DONE]":
            done = True
        if done or not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            result.error = event["error"].get("message", str(event["error"]))
            continue
        if event.get("usage"):
            result.usage = event["usage"]
        for choice in event.get("choices", []):
            token = choice.get("delta", {}).get("content") or ""
            if not token:
                continue
            now = loop.time()
            if last is None:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            result.text += token
            if on_token is not None:
                on_token(token)
    result.e2el_s = loop.time() - start
    if not done and result.error is None:
        result.error = "the stream ended without [DONE]"


def error_message(payload: str) -> str:
    """The message of an OpenAI-shaped error body, or the body itself."""
    with suppress(ValueError, AttributeError, TypeError):
        return json.loads(payload)["error"]["message"]
    return payload


def split_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"https://{url}")
    return parts.hostname or "localhost", parts.port or 443


async def _chat_cli(args: Any) -> int:
    import sys

    host, port = split_url(args.url)
    headers = {}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    if args.qos_class:
        headers["x-qos-class"] = args.qos_class
    verify: bool | str = args.cacert or not args.insecure
    async with Http3Client(host, port, verify=verify) as client:
        result = await stream_chat(
            client,
            [{"role": "user", "content": args.prompt}],
            model=args.model,
            max_tokens=args.max_tokens,
            headers=headers,
            on_token=lambda token: print(token, end="", flush=True),
            eloquent=args.eloquent,
        )
    print()
    if result.error:
        print(f"error ({result.status}): {result.error}", file=sys.stderr)
    ttft = f"{result.ttft_s * 1000:.1f} ms" if result.ttft_s is not None else "-"
    itl = f"{result.mean_itl_s * 1000:.1f} ms" if result.mean_itl_s is not None else "-"
    tokens = result.usage.get("completion_tokens") if result.usage else len(result.itl_s) + 1
    print(
        f"model {result.model} on {result.replica} | TTFT {ttft} | mean ITL {itl} | "
        f"{tokens} tokens",
        file=sys.stderr,
    )
    return 0 if result.error is None else 1


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m transport.client", description="Stream one chat completion over HTTP/3."
    )
    parser.add_argument("prompt")
    parser.add_argument("--url", default="https://localhost:8443")
    parser.add_argument("--model", default="auto")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--qos-class", help="ask for a class (x-qos-class)")
    parser.add_argument("--api-key", help="a key whose tier grants the class")
    parser.add_argument("--cacert", help="trust this certificate (the server's .certs/cert.pem)")
    parser.add_argument(
        "--insecure", action="store_true", help="accept any certificate (self-signed servers)"
    )
    parser.add_argument(
        "--eloquent",
        action="store_true",
        help="ask for tokens in datagrams too, rendered from whichever path is first",
    )
    return asyncio.run(_chat_cli(parser.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
