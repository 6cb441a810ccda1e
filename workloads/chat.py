"""OpenAI chat completions as a client sees them: one streamed request, timed at the client.

The load generator (`workloads.replay`) sends every request through here, over HTTP/3 (an
`Http3Client` or `Http3Pool` of the transport), HTTP/1.1 (an aiohttp session, the client
`vllm bench serve` uses) or HTTP/2 (an httpx client), and every protocol is timed by the same
code with `vllm bench serve`'s definitions: TTFT at the first chunk with choices, an inter-token
gap between such chunks, E2EL at the last of them. Times are `time.perf_counter()`: the event
loop's clock may be coarse.

`python -m workloads.chat "Hello!"` streams one answer over HTTP/3 and prints how it went.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from transport.client import Http3Client, Http3Pool, StreamError, split_url
from transport.schedulers import StreamSpec

CHAT_PATH = "/v1/chat/completions"


@dataclass
class ChatResult:
    status: int = 0
    model: str | None = None
    replica: str | None = None
    request_id: str | None = None
    """The server's `x-request-id`: its name for the request in its logs."""
    response_id: str | None = None
    """The chunks' `id`. A peer gateway passes on vLLM's, which vLLM logs with
    `--enable-log-requests`."""
    text: str = ""
    ttft_s: float | None = None
    """From the request going out to the first chunk with choices."""
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    """From the request going out to the last chunk with choices (the last token); for an
    answer with an error status, to the end of that answer."""
    credit_wait_s: float = 0.0
    """How long the request waited in the client for a stream before it went out (HTTP/3's
    stream credit, or the load generator's HTTP/2 stream limit); not part of TTFT or E2EL."""
    usage: dict[str, Any] | None = None
    error: str | None = None
    connection: str | None = None
    """HTTP/3: the name of the client connection that carried it (`Http3Pool`'s)."""

    @property
    def mean_itl_s(self) -> float | None:
        return sum(self.itl_s) / len(self.itl_s) if self.itl_s else None

    def take_headers(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self.model = headers.get("x-model")
        self.replica = headers.get("x-replica")
        self.request_id = headers.get("x-request-id")


def chat_body(
    messages: list[dict[str, str]], model: str, max_tokens: int, **extra: Any
) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def chat_h3(
    client: Http3Client | Http3Pool,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
    on_token: Callable[[str], None] | None = None,
    eloquent: bool = False,
    spec: StreamSpec | None = None,
) -> ChatResult:
    """One streamed chat completion over HTTP/3. With `eloquent`, tokens are timed from
    whichever path (stream or datagram) delivered them first; `spec` tags the request's stream
    for the client connection's scheduler, which orders the uploads."""
    response = await client.request(
        "POST",
        CHAT_PATH,
        {"content-type": "application/json", **(headers or {})},
        json.dumps(body).encode(),
        spec=spec,
        eloquent=eloquent,
    )
    result = ChatResult(credit_wait_s=response.credit_wait_s, connection=response.connection)
    result.take_headers(response.status, response.headers)
    try:
        if response.status != 200:
            result.error = error_message((await response.read()).decode(errors="replace"))
            result.e2el_s = time.perf_counter() - response.sent_at
            return result
        await read_chat_stream(response.iter_lines(), result, response.sent_at, on_token)
    except StreamError as exc:
        result.error = str(exc)
    finally:
        response.close()
    return result


async def chat_h1(
    session: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
) -> ChatResult:
    """One streamed chat completion over HTTP/1.1. Connection failures raise aiohttp's errors."""
    start = time.perf_counter()
    async with session.post(
        url + CHAT_PATH, json=body, headers={"content-type": "application/json", **(headers or {})}
    ) as response:
        return await _answer(
            response.status, response.headers, response.read, _lines(response.content), start
        )


async def chat_h2(
    client: httpx.AsyncClient,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
) -> ChatResult:
    """One streamed chat completion over an httpx client, which speaks HTTP/2 over TLS when made
    with `http2=True` (aiohttp has no HTTP/2). Connection failures raise httpx's errors."""
    start = time.perf_counter()
    async with client.stream(
        "POST", url + CHAT_PATH, json=body,
        headers={"content-type": "application/json", **(headers or {})},
    ) as response:  # fmt: skip
        return await _answer(
            response.status_code, response.headers, response.aread, response.aiter_lines(), start
        )


async def _answer(
    status: int,
    headers: Mapping[str, str],
    read: Callable[[], Awaitable[bytes]],
    lines: AsyncIterator[str],
    start: float,
) -> ChatResult:
    """An HTTP/1.1 or HTTP/2 answer, read whole if it is an error, else as its SSE `lines`."""
    result = ChatResult()
    result.take_headers(status, headers)
    if status != 200:
        result.error = error_message((await read()).decode(errors="replace"))
        result.e2el_s = time.perf_counter() - start
        return result
    await read_chat_stream(lines, result, start)
    return result


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    async for line in content:
        yield line.decode().rstrip("\r\n")


async def read_chat_stream(
    lines: AsyncIterator[str],
    result: ChatResult,
    start: float,
    on_token: Callable[[str], None] | None = None,
) -> None:
    """Fold a chat-completions SSE stream into `result`, timing each chunk with choices against
    `start` (time.perf_counter() when the request went out)."""
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
        if result.response_id is None:
            result.response_id = event.get("id")
        choices = event.get("choices")
        if not choices:
            continue
        now = time.perf_counter()
        if last is None:
            result.ttft_s = now - start
        else:
            result.itl_s.append(now - last)
        last = now
        result.e2el_s = now - start
        token = choices[0].get("delta", {}).get("content") or ""
        result.text += token
        if on_token is not None and token:
            on_token(token)
    if not done and result.error is None:
        result.error = "the stream ended without [DONE]"


def error_message(payload: str) -> str:
    """The message of an OpenAI-shaped error body, or the body itself."""
    with suppress(ValueError, AttributeError, TypeError, KeyError):
        return json.loads(payload)["error"]["message"]
    return payload


async def _chat_cli(args: Any) -> int:
    host, port = split_url(args.url)
    headers = {}
    if args.api_key:
        headers["authorization"] = f"Bearer {args.api_key}"
    if args.qos_class:
        headers["x-qos-class"] = args.qos_class
    verify: bool | str = args.cacert or not args.insecure
    body = chat_body([{"role": "user", "content": args.prompt}], args.model, args.max_tokens)
    async with Http3Client(host, port, verify=verify) as client:
        result = await chat_h3(
            client,
            body,
            headers,
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
        f"{tokens} tokens | request {result.request_id}",
        file=sys.stderr,
    )
    return 0 if result.error is None else 1


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m workloads.chat", description="Stream one chat completion over HTTP/3."
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
