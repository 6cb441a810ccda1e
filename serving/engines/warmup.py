"""Warm-up: every path an engine serves runs once before its replica counts as ready.

Some paths cost seconds the first time they run in an engine's processes, and a first request
that pays that cost misses its class's deadline. vLLM compiles (torch.compile, inductor) the
function that ranks log-probabilities on first use: lm-eval's first loglikelihood request (echo
and logprobs, 1 token) took 2.6 to 4.6 s on each model of the embedded deployment on this 2-core
machine with inductor's disk cache warm, longer with it cold, and the free tier gives 2 s; it
got a 504 on every model of a fresh server. (An eager CPU engine now runs without dynamo, so
there it costs nothing: `VllmEngine._spawn_env`.) vLLM's own warm-up does not cover such paths,
and its CPU worker skips it altogether where the KV cache is sized explicitly (every CPU
placement here is). So, as vLLM's server does its profiling run before it listens, an engine
serves these before it is ready, and again after a restart:

- decoding at the engine's full batch, then at half of it, a quarter, ... down to one request,
  with each kind of sampling mixed in (random, greedy, seeded, nucleus);
- log-probabilities of the prompt (echo) and of the output, with as many top tokens as the API
  allows;
- the longest prompt the context takes, for one token.

Warm-up stops at the first path that fails: an engine that cannot serve it is not ready.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from serving.engines.base import MAX_LOGPROBS, UNFINISHED, EngineError, Sampling, TokenDelta
from workloads import Request, TokenIds

_PROMPT = "Warm-up: the quick brown fox jumps over the lazy dog."


@dataclass(frozen=True)
class Path:
    """Requests that go to the engine together, to warm one path."""

    name: str
    requests: tuple[tuple[Request, Sampling], ...]


@dataclass(frozen=True)
class WarmedPath:
    name: str
    seconds: float


def paths(max_model_len: int, max_batch: int, filler_token: int, seeded: bool = True) -> list[Path]:
    """What an engine with this context and batch cap warms, in order. `filler_token`: a token
    id of its vocabulary, repeated to make the longest prompt; `seeded`: whether the engine
    serves seeded sampling."""

    def request(name: str, prompt: str | TokenIds, max_tokens: int) -> Request:
        return Request(f"warm-up-{name}", 0.0, prompt, max_tokens, "warm-up")

    samplings = (
        Sampling(ignore_eos=True),
        Sampling(temperature=0.0, ignore_eos=True),
        Sampling(top_p=0.9, ignore_eos=True),
    ) + ((Sampling(seed=0, ignore_eos=True),) if seeded else ())
    # All sent at once, each for as many tokens as the batch sizes it is to run in: the batch
    # then halves at every step, from the full batch (its prefill) down to one.
    batch = max(2, max_batch)
    sizes = [batch] + [2**p for p in reversed(range(batch.bit_length())) if 2**p < batch]
    tokens = [sum(i < size for size in sizes) for i in range(batch)]
    decode = tuple(
        (request(f"decode-{i}", _PROMPT, n), samplings[i % len(samplings)])
        for i, n in enumerate(tokens)
    )
    logprobs = tuple(
        (request(f"logprobs-{k}", _PROMPT, 2), Sampling(logprobs=k, echo=True))
        for k in (1, MAX_LOGPROBS)
    )
    longest = TokenIds((filler_token,) * (max_model_len - 1))
    return [
        Path(f"decode, batches of {', '.join(map(str, sizes))}", decode),
        Path("log-probabilities of prompt and output", logprobs),
        Path(
            f"longest prompt ({max_model_len - 1} tokens)",
            ((request("longest", longest, 1), Sampling()),),
        ),
    ]


Generate = Callable[[Request, Sampling], AsyncIterator[TokenDelta]]


async def warm_up(
    generate: Generate, to_warm: Sequence[Path], clock: Callable[[], float] = time.monotonic
) -> list[WarmedPath]:
    """Run each path's requests to their end, one path after the other; how long each took.
    Raises EngineError where a request fails or ends unfinished."""
    warmed = []
    for path in to_warm:
        started = clock()
        await asyncio.gather(*(_finish(generate(r, s), path.name) for r, s in path.requests))
        warmed.append(WarmedPath(path.name, clock() - started))
    return warmed


async def _finish(deltas: AsyncIterator[TokenDelta], path: str) -> None:
    finish = None
    async for delta in deltas:
        finish = delta.finish_reason or finish
    if finish is None or finish in UNFINISHED:
        raise EngineError(f"warm-up ({path}) ended unfinished (finish_reason {finish!r})")


def describe(warmed: Sequence[WarmedPath]) -> str:
    """One line for the log: the whole and each path."""
    total = sum(w.seconds for w in warmed)
    return f"{total:.1f} s (" + "; ".join(f"{w.name}: {w.seconds:.2f} s" for w in warmed) + ")"
