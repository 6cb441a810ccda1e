"""`python -m workloads.null_server`: OpenAI chat completions with no model behind them.

Every answer streams `max_tokens` (or `max_completion_tokens`) chunks, the first after
`--first-token-ms` and the others `--token-gap-ms` apart, over HTTP/1.1 and HTTP/3 at once. Its
timings are known, so it measures whatever sits in front of it: the load generator's own accuracy
(a controlled delay must come out as that delay) and its headroom (how fast it can send before it
falls behind), with no engine to share the cores with. `/v1/models` lists `--model`, so it can
also stand in for a `vllm serve` upstream that comes and goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class NullModel:
    """The ASGI app. Each token is one SSE event shaped as our server's (and vLLM's) chunks."""

    def __init__(self, first_token_s: float, token_gap_s: float, model: str = "null") -> None:
        self.first_token_s = first_token_s
        self.token_gap_s = token_gap_s
        self.model = model

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if scope["path"] == "/v1/models":
            await _json(send, {"object": "list", "data": [{"id": self.model, "object": "model"}]})
        elif scope["path"] == "/v1/chat/completions":
            await self._chat(json.loads(body or b"{}"), send)
        else:
            await _json(send, {"error": {"message": "not found", "code": 404}}, 404)

    async def _chat(self, request: dict[str, Any], send: Send) -> None:
        tokens = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"x-model", self.model.encode()),
                    (b"x-replica", b"null/" + self.model.encode()),
                    (b"x-request-id", uuid.uuid4().hex.encode()),
                ],
            }
        )
        envelope = {"id": "chatcmpl-null", "object": "chat.completion.chunk", "model": self.model}
        due = time.monotonic() + self.first_token_s
        for i in range(tokens):
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due += self.token_gap_s
            finish = "length" if i == tokens - 1 else None
            delta = {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": finish}
            await _event(send, {**envelope, "choices": [delta]})
        usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
        await _event(send, {**envelope, "choices": [], "usage": usage})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def _event(send: Send, payload: dict[str, Any]) -> None:
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _json(send: Send, payload: dict[str, Any], status: int = 200) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


def main() -> int:
    from transport.http3 import Http3Settings
    from transport.server import DualServer, Listen, serve_forever
    from transport.tls import ensure_certificate

    parser = argparse.ArgumentParser(prog="python -m workloads.null_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="HTTP/1.1 (TCP); 0: off")
    parser.add_argument("--h3-port", type=int, default=8543, help="HTTP/3 (UDP); 0: off")
    parser.add_argument("--first-token-ms", type=float, default=0.0)
    parser.add_argument("--token-gap-ms", type=float, default=0.0)
    parser.add_argument("--model", default="null")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    cert, key = ensure_certificate()
    app = NullModel(args.first_token_ms / 1000, args.token_gap_ms / 1000, args.model)
    listen = Listen(args.host, args.port or None, args.h3_port or None)
    server = DualServer(
        app, listen, Http3Settings(str(cert), str(key)), args.log_level, access_log=False
    )
    asyncio.run(serve_forever(server))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
