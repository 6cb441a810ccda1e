"""`python -m workloads.null_server`: a `vllm serve`-shaped OpenAI server with no model behind it.

Every answer is `max_tokens` (or `max_completion_tokens`) tokens, the first after
`--first-token-ms` and the others `--token-gap-ms` apart, over HTTP/1.1 and HTTP/3 at once. Its
timings are known, so it measures whatever sits in front of it: the load generator's own accuracy
(a controlled delay must come out as that delay), its headroom, and the gateways put in front of
it as upstreams (ours with a `remote` deployment, sglang-router, vllm-router).

What it shares with `vllm serve`, so that those gateways meet what they would meet there:
- `/v1/chat/completions` and `/v1/completions`, streamed in vLLM's chunk layout (the usage chunk
  with `stream_options.include_usage`, usage on every chunk with `continuous_usage_stats`), or
  as one JSON body without `stream`;
- `/v1/models`, `/health`, and `/metrics` with vLLM's names for its load
  (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`);
- `--max-num-seqs`: at most that many requests generate at once, the rest wait in arrival order,
  as vLLM's scheduler holds them;
- a client that disconnects aborts its request, waiting or running.

Prompt tokens are counted as whitespace-separated words (a list of token ids: its length), a
stand-in for a tokenizer that no upstream shape here depends on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


class NullModel:
    """The ASGI app."""

    def __init__(
        self,
        first_token_s: float,
        token_gap_s: float,
        model: str = "null",
        max_num_seqs: int = 0,
        request_log: TextIO | None = None,
    ) -> None:
        """`request_log`: a line of JSON per completion request received (`logged`)."""
        self.request_log = request_log
        self.first_token_s = first_token_s
        self.token_gap_s = token_gap_s
        self.model = model
        self.max_num_seqs = max_num_seqs
        """0: no limit."""
        self._slots = asyncio.Semaphore(max_num_seqs) if max_num_seqs else None
        self.running = 0
        self.waiting = 0
        self.finished: Counter[str] = Counter()
        """Requests ended, by finish reason ('length', or 'abort' for a client that left)."""
        self.prompt_tokens = 0
        self.generation_tokens = 0

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
        path = scope["path"]
        if path == "/v1/models":
            model = {"id": self.model, "object": "model", "owned_by": "null"}
            await _json(send, {"object": "list", "data": [model]})
        elif path == "/health":
            await _json(send, None)
        elif path == "/metrics":
            await send({"type": "http.response.start", "status": 200, "headers": _TEXT})
            await send({"type": "http.response.body", "body": self.metrics().encode()})
        elif path in ("/v1/chat/completions", "/v1/completions"):
            try:
                request = json.loads(body or b"{}")
                if not isinstance(request, dict):
                    raise ValueError("the body is not a JSON object")
            except ValueError as exc:
                await _json(send, _error(f"invalid JSON body: {exc}"), 400)
                return
            disconnected = asyncio.ensure_future(_disconnect(receive))
            try:
                await self._complete(request, path == "/v1/chat/completions", send, disconnected)
            finally:
                disconnected.cancel()
        else:
            await _json(send, _error(f"{path} not found", 404), 404)

    async def _complete(
        self, request: dict[str, Any], chat: bool, send: Send, disconnected: asyncio.Future[None]
    ) -> None:
        if self.request_log is not None:
            self.request_log.write(json.dumps(logged(request)) + "\n")
            self.request_log.flush()
        tokens = int(request.get("max_completion_tokens") or request.get("max_tokens") or 16)
        prompt_tokens = _count_prompt(request, chat)
        options = request.get("stream_options") or {}
        streaming = bool(request.get("stream"))
        if not await self._admit(disconnected):
            return
        try:
            chunk = _Chunks(self.model, chat, prompt_tokens, options if streaming else {})
            self.prompt_tokens += prompt_tokens
            if streaming:
                # x-model, x-replica and x-request-id as our server sends them: the load
                # generator records them.
                named = [
                    (b"x-model", self.model.encode()),
                    (b"x-replica", b"null/" + self.model.encode()),
                    (b"x-request-id", str(chunk.envelope["id"]).encode()),
                ]
                await send({"type": "http.response.start", "status": 200, "headers": SSE + named})
            due = time.monotonic() + self.first_token_s
            text: list[str] = []
            for i in range(tokens):
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if disconnected.done():
                    self.finished["abort"] += 1
                    return
                due += self.token_gap_s
                self.generation_tokens += 1
                text.append(f" t{i}")
                if streaming and chat and i == 0:
                    # vLLM's first chat chunk carries the role and no text, sent with the first
                    # token's: clients that time the first chunk (vllm bench) see the token's time.
                    await _event(send, chunk.first())
                if streaming:
                    await _event(send, chunk.token(text[-1], i + 1, i == tokens - 1))
            self.finished["length"] += 1
            if not streaming:
                await _json(send, chunk.whole("".join(text), tokens))
                return
            if options.get("include_usage"):
                await _event(send, chunk.usage_only(tokens))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            self.running -= 1
            if self._slots is not None:
                self._slots.release()

    async def _admit(self, disconnected: asyncio.Future[None]) -> bool:
        """Wait for a slot, in arrival order (asyncio's Semaphore wakes its waiters FIFO)."""
        if self._slots is not None:
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
            if disconnected.done():  # left while it waited
                self._slots.release()
                self.finished["abort"] += 1
                return False
        self.running += 1
        return True

    def metrics(self) -> str:
        """vLLM's names for what a gateway reads of its load (a subset of vLLM's /metrics)."""
        label = f'{{model_name="{self.model}"}}'
        usage = self.running / self.max_num_seqs if self.max_num_seqs else 0.0
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {self.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {usage}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{label} {self.prompt_tokens}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {self.generation_tokens}",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason, count in sorted(self.finished.items()):
            lines.append(
                f'vllm:request_success_total{{finished_reason="{reason}",'
                f'model_name="{self.model}"}} {count}'
            )
        return "\n".join(lines) + "\n"


class _Chunks:
    """One request's chunks, in vLLM's layout."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int, options: dict[str, Any]):
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.continuous = bool(options.get("continuous_usage_stats"))
        self.envelope = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def _usage(self, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def _with(self, choice: dict[str, Any], completion: int) -> dict[str, Any]:
        chunk: dict[str, Any] = {**self.envelope, "choices": [choice]}
        if self.continuous:
            chunk["usage"] = self._usage(completion)
        return chunk

    def first(self) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return self._with({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}, 0)

    def token(self, text: str, completion: int, last: bool) -> dict[str, Any]:
        finish = "length" if last else None
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice |= {"text": text, "stop_reason": None}
        return self._with(choice, completion)

    def usage_only(self, completion: int) -> dict[str, Any]:
        return {**self.envelope, "choices": [], "usage": self._usage(completion)}

    def whole(self, text: str, completion: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        obj = "chat.completion" if self.chat else "text_completion"
        return {
            **self.envelope,
            "object": obj,
            "choices": [choice],
            "usage": self._usage(completion),
        }


_TEXT = [(b"content-type", b"text/plain; version=0.0.4")]


def logged(request: dict[str, Any]) -> dict[str, Any]:
    """What the request log keeps of a request: when it came, and the SHA-1 of its prompt's
    text (`prompt_digest`), by which whoever sent it finds which upstream a gateway chose."""
    return {"received": time.time(), "prompt_sha1": prompt_digest(request)}


def prompt_digest(request: dict[str, Any]) -> str:
    """SHA-1 of the JSON list of the messages' contents (or of the completion prompt): what a
    gateway passes on unchanged, however it re-serializes the rest of the body."""
    if "messages" in request:
        said = [m.get("content") for m in request["messages"]]
    else:
        said = [request.get("prompt")]
    return hashlib.sha1(json.dumps(said).encode()).hexdigest()


def _count_prompt(request: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = request.get("messages") or []
        return sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))
    prompt = request.get("prompt", "")
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).split())


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _error(message: str, code: int = 400) -> dict[str, Any]:
    kind = "BadRequestError" if code == 400 else "NotFoundError"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


async def _event(send: Send, payload: dict[str, Any]) -> None:
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _json(send: Send, payload: Any, status: int = 200) -> None:
    await send({"type": "http.response.start", "status": status, "headers": JSON})
    body = b"" if payload is None else json.dumps(payload).encode()
    await send({"type": "http.response.body", "body": body})


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
    parser.add_argument("--model", default="null", help="the name /v1/models lists")
    parser.add_argument(
        "--max-num-seqs", type=int, default=0,
        help="requests generating at once; the rest wait in arrival order (0: no limit)",
    )  # fmt: skip
    parser.add_argument(
        "--request-log", type=Path,
        help="append a line per completion request: when it came and its prompt's SHA-1",
    )  # fmt: skip
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args()
    if args.max_num_seqs < 0:
        parser.error("--max-num-seqs must be 0 or more")
    cert, key = ensure_certificate()
    listen = Listen(args.host, args.port or None, args.h3_port or None)

    async def serve() -> None:
        # The app's semaphore belongs to the running loop.
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(args.request_log.open("a")) if args.request_log else None
            app = NullModel(
                args.first_token_ms / 1000, args.token_gap_ms / 1000, args.model,
                args.max_num_seqs, log,
            )  # fmt: skip
            server = DualServer(
                app, listen, Http3Settings(str(cert), str(key)), args.log_level, access_log=False
            )
            await serve_forever(server)

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
