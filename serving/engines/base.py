"""The Engine interface and the plain data that crosses it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from workloads import Request

MAX_LOGPROBS = 20
"""vLLM's default `max_logprobs`: the most alternatives a request may ask for at a position."""


@dataclass(frozen=True)
class Sampling:
    """How to sample; the OpenAI request fields an engine honours."""

    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    """Generate exactly max_tokens (a vLLM extension; benchmarks use it)."""
    min_tokens: int = 0
    """No end of sequence before this many tokens (a vLLM extension)."""
    priority: int = 0
    """Lower is served first, where the engine schedules by priority (a vLLM extension, as in
    its OpenAI server); the gateway sets the urgency of the request's class."""
    logprobs: int | None = None
    """Return each output token's log-probability and this many of the most likely tokens at
    its position beside it (0: the token's own only); None: no log-probabilities."""
    echo: bool = False
    """The first delta carries the prompt as text (`TokenDelta.prompt_text`), and with
    `logprobs`, each prompt token's log-probability too (`TokenDelta.prompt_logprobs`)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a prompt or an answer, and how likely the model found it there."""

    token: str
    """The token's text on its own (a piece of a multi-byte character may read as U+FFFD)."""
    logprob: float | None
    """Natural log; None for the prompt's first token, which nothing precedes."""
    top: tuple[tuple[str, float], ...] = ()
    """The most likely tokens at this position, most likely first, as many as asked for."""


@dataclass(frozen=True)
class TokenDelta:
    """New output since the previous delta of the same request."""

    text: str
    """Detokenised text of the new tokens (may be empty while a multi-byte character is split)."""
    tokens: int
    """How many tokens this delta adds."""
    prompt_tokens: int
    """Length of the prompt as the engine tokenised it."""
    finish_reason: str | None = None
    """Set on the last delta: 'stop' or 'length' for a finished answer; vLLM's 'abort' and
    'error' (`UNFINISHED`) end one that is not."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per new token, where `Sampling.logprobs` asked for them."""
    prompt_text: str | None = None
    """On the first delta, where `Sampling.echo` asked for it: the prompt as text."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """On the first delta, where `Sampling.echo` and `Sampling.logprobs` asked: one per prompt
    token."""
    cached_tokens: int | None = None
    """Prompt tokens the engine found in its prefix cache (OpenAI's
    `usage.prompt_tokens_details.cached_tokens`), where it says: on any delta, the last one at
    the latest."""


UNFINISHED = frozenset({"abort", "error"})
"""vLLM's finish reasons for a request it stopped without finishing (an abort or shutdown, an
engine fault). They are no answer's end: the gateway turns them into an engine error."""


class UpstreamLoad(NamedTuple):
    """What an engine's own server last reported of its load (a `vllm serve`'s /metrics), where
    other clients may share it: the gateway's exact count covers only its own requests."""

    running: int
    waiting: int
    kv_usage: float | None
    """The share of its KV cache in use (0 to 1), where it says."""
    others: int
    """Of running + waiting, the requests this gateway did not send, as of the report."""
    batch_cap: int
    """The most requests it was last seen to run while others waited: its `max_num_seqs`, or
    what its KV cache holds. 0 until requests were seen waiting."""
    at: float
    """When it came (`time.monotonic()`)."""
    stale: bool = False
    """No report came since for too long: the numbers are the last ones, not to be trusted."""


class InvalidRequest(Exception):
    """The request cannot be served as asked (a 4xx): too long for the context, bad parameters."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineError(Exception):
    """The engine failed while serving a request it had accepted."""


class EngineUnavailable(EngineError):
    """The engine is down: it died, or it cannot be reached."""


class UpstreamLost(EngineError):
    """The connection to the engine's server (a `vllm serve`, an engine host) was lost while it
    held the request."""


class Engine(Protocol):
    """One model instance that generates tokens. A replica owns one."""

    async def start(self) -> None:
        """Load the model or connect; raises if it cannot serve."""
        ...

    def generate(self, request: Request, sampling: Sampling) -> AsyncIterator[TokenDelta]:
        """Stream the request's output. Raises InvalidRequest before the first delta if the
        request does not fit the model; raises EngineError if the engine fails.
        Closing the iterator early aborts the request in the engine."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its slot; a no-op for an unknown id."""
        ...

    def healthy(self) -> bool:
        """Cheap and local: whether new requests may be sent here."""
        ...

    async def recover(self) -> None:
        """Bring a down engine back (the replica's supervisor calls it, with backoff); raises
        if it cannot yet."""
        ...

    def unfinished(self) -> int:
        """Requests the engine itself still holds, as it counts them."""
        ...

    def load(self) -> UpstreamLoad | None:
        """What the engine's server reports of its load; None where the gateway's own count is
        the whole of it (engines in this process), or before the first report."""
        ...

    async def close(self) -> None: ...
