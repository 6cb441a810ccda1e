"""OpenAI's response shapes: a generation rendered as chat or text completion chunks (server-sent
events) or as a whole answer, and errors in OpenAI's error body. Used by the API's routes, by the
server's stop (`serving.middleware`) and by the Eloquent simulation, which streams the same
chunks."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

from fastapi.responses import JSONResponse

from serving.engines.base import TokenDelta, TokenLogprob
from serving.gateway import GatewayError, Generation
from serving.logprobs import chat_logprobs, completion_logprobs

log = logging.getLogger(__name__)


def served_by(generations: list[Generation]) -> tuple[str, str]:
    """The models and the replicas that served, each once, in order, comma-separated."""
    models = ",".join(dict.fromkeys(g.model for g in generations))
    return models, ",".join(dict.fromkeys(g.replica.name for g in generations))


@dataclasses.dataclass
class Answer:
    """A generation's whole output, as its deltas brought it."""

    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)

    def add(self, delta: TokenDelta) -> None:
        # An echoed prompt comes with the first delta, before its tokens.
        self.text += (delta.prompt_text or "") + delta.text
        self.logprobs += [*(delta.prompt_logprobs or ()), *delta.logprobs]


class Shape:
    """OpenAI's response shapes for one generation: chat or text completion, chunk or whole.
    `logprobs`: how many alternatives each token shows (None: no logprobs); `echo`: the
    prompt goes first."""

    def __init__(
        self, generation: Generation, chat: bool, logprobs: int | None = None, echo: bool = False
    ) -> None:
        self.generation = generation
        self.chat = chat
        self.logprobs = logprobs
        self.echo = echo
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        g = self.generation
        return {
            "id": g.request.request_id,
            "object": obj,
            "created": self.created,
            "model": g.model,
            "replica": g.replica.name,
            "choices": choices,
        }

    def _logprobs(self, entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries, offset)

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        first: bool,
        logprobs: Sequence[TokenLogprob] = (),
        offset: int = 0,
    ) -> dict[str, Any]:
        lp = self._logprobs(logprobs, offset)
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def choice(self, answer: Answer, index: int = 0) -> dict[str, Any]:
        g = self.generation
        lp = self._logprobs(answer.logprobs, 0)
        if self.chat:
            message = {"role": "assistant", "content": answer.text}
            return {
                "index": index,
                "message": message,
                "logprobs": lp,
                "finish_reason": g.finish_reason,
            }
        return {
            "index": index,
            "text": answer.text,
            "logprobs": lp,
            "finish_reason": g.finish_reason,
        }

    def whole(self, answer: Answer) -> dict[str, Any]:
        body = self._envelope(
            "chat.completion" if self.chat else "text_completion", [self.choice(answer)]
        )
        body["usage"] = self.usage()
        return body

    def batch(
        self, request_id: str, generations: list[Generation], choices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """One completion for a batch of prompts: its id is the HTTP request's."""
        body = self._envelope("text_completion", choices)
        body["id"] = request_id
        body["model"], body["replica"] = served_by(generations)
        prompt = sum(g.prompt_tokens for g in generations)
        completion = sum(g.completion_tokens for g in generations)
        body["usage"] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        cached = [g.cached_tokens for g in generations if g.cached_tokens is not None]
        if len(cached) == len(generations):
            body["usage"]["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
        return body

    def usage(self) -> dict[str, Any]:
        g = self.generation
        usage: dict[str, Any] = {
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.completion_tokens,
            "total_tokens": g.prompt_tokens + g.completion_tokens,
        }
        if g.cached_tokens is not None:  # as vLLM with --enable-prompt-tokens-details
            usage["prompt_tokens_details"] = {"cached_tokens": g.cached_tokens}
        return usage

    @overload
    def sse(self, include_usage: bool, relay: Literal[False] = False) -> AsyncIterator[str]: ...
    @overload
    def sse(self, include_usage: bool, relay: Literal[True]) -> AsyncIterator[str | Relay]: ...

    async def sse(self, include_usage: bool, relay: bool = False) -> AsyncIterator[str | Relay]:
        """The answer's events; with `relay`, a `Relay` where its plain chunks begin."""
        # The chunks between the first (which names the role) and the last (its finish reason)
        # differ only in their text: the chunk is rendered once around a placeholder and only
        # the text is encoded per event, to the same bytes. Rendering the whole chunk was the
        # largest share of the HTTP/1.1 server's CPU per event (12%, profiled by
        # benchmarks.frontend_capacity --profile). The text is the last string in the chunk,
        # after the request id, which a client may choose. Chunks with logprobs differ in more.
        head, _, tail = event(self.chunk(_SLOT, None, False)).rpartition(_SLOT_JSON)
        plain = Relay(lambda text: head + json.dumps(text) + tail)
        first = True
        offset = 0  # where the chunk's text starts in the whole answer's
        try:
            async for delta in self.generation:
                if first or delta.finish_reason is not None or self.logprobs is not None:
                    answer = Answer()
                    answer.add(delta)
                    yield event(
                        self.chunk(answer.text, delta.finish_reason, first, answer.logprobs, offset)
                    )
                    offset += len(answer.text)
                else:
                    yield plain.render(delta.text)
                first = False
                if relay and self.logprobs is None and delta.finish_reason is None:
                    yield plain  # the plain chunks to come may be written as they come
            if include_usage:
                usage_chunk = self._envelope(
                    "chat.completion.chunk" if self.chat else "text_completion", []
                )
                usage_chunk["usage"] = self.usage()
                yield event(usage_chunk)
        except GatewayError as exc:
            # Headers are gone; the error travels as an event the OpenAI client raises on.
            yield event(error_body(exc.status, exc.message, exc.code, exc.param))
        except Exception:
            log.exception("unexpected error while streaming %s", self.generation.request.request_id)
            yield event(
                error_body(500, "Internal server error; see the server log.", "internal_error")
            )
        yield "data: [DONE]\n\n"


_SLOT = "\x00"
_SLOT_JSON = json.dumps(_SLOT)


@dataclass(frozen=True)
class Relay:
    """Yielded by `Shape.sse` where the plain chunks of an answer begin: the event of one with
    a given text. Its reader may write them from the engine's task (`Generation.relay`) and
    then go on reading events, or skip it and read every event."""

    render: Callable[[str], str]


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(status: int, message: str, code: str | None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def error_response(exc: GatewayError) -> JSONResponse:
    response = error(exc.status, exc.message, exc.code, exc.param)
    response.headers.update(exc.headers)
    return response
