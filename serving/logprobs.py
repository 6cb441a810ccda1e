"""Log-probabilities in OpenAI's two shapes: the completions API's (legacy, parallel lists) and
the chat API's (one object per token). The shapes, and the top list's membership (the token's
own entry beside its top k), follow vLLM's OpenAI server, which lm-eval reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serving.engines.base import TokenLogprob

FLOOR = -9999.0
"""What -inf becomes: JSON has no infinity (OpenAI's and vLLM's choice)."""


def _clamped(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`choices[i].logprobs` of a completion; `offset`: where the first token's text starts in
    the choice's text (a streamed chunk's tokens start after the text already sent)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for entry in entries:
        tokens.append(entry.token)
        text_offset.append(offset)
        offset += len(entry.token)
        if entry.logprob is None:  # the prompt's first token
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_clamped(entry.logprob))
        top = {entry.token: _clamped(entry.logprob)}
        top.update((token, _clamped(logprob)) for token, logprob in entry.top)
        top_logprobs.append(top)
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """`choices[0].logprobs` of a chat completion (or of one chunk of it)."""
    return {
        "content": [
            {
                **_token(entry.token, entry.logprob if entry.logprob is not None else FLOOR),
                "top_logprobs": [_token(token, logprob) for token, logprob in entry.top],
            }
            for entry in entries
        ]
    }


def _token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _clamped(logprob), "bytes": list(token.encode())}
