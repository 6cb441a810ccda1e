"""Request lengths: how long prompts are, how long answers run, and what max_tokens clients send.

A `Lengths` draws one request's (prompt tokens, answer tokens, max_tokens). The answer is where
the model would stop on its own (its end-of-sequence token); max_tokens is what the client asks
for, which a real client rarely sets to the answer's length:
- "exact": max_tokens is the answer's length, as a benchmark client that replays recorded
  answers sends it (vllm bench serve, the load generator of Chuppala (2024));
- "none": no max_tokens, as most chat clients send; the answer ends on its own;
- a number: a client's cap; the answer ends on its own, or at the cap.

The router is trained on `TRAINING` and evaluated on `HELD_OUT` too, which training never draws
from (docs/workloads.md#request-lengths names both, with their parameters). Every prompt's drawn
length is clipped to the context: it leaves room for max_tokens, or, with none, for the answer.
Built as text for a live server (`WorkloadSpec.text`), a prompt counts about its drawn length
through a real tokenizer and chat template, not exactly: one drawn at the limit may be refused
(a 400, context_length_exceeded).

`ChatShape`: the turns and message lengths of a published chat dataset, which
`workloads.conversations` fills with text and `Conversations` draws without.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from workloads.traces import TraceError, read_azure_trace, resolve_trace


class Sampler(Protocol):
    def draw(self, rng: np.random.Generator) -> int: ...


@dataclass(frozen=True)
class Uniform:
    lo: int
    hi: int

    def draw(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.lo, self.hi + 1))

    def __str__(self) -> str:
        return f"uniform {self.lo}-{self.hi}"


@dataclass(frozen=True)
class LogNormal:
    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: np.random.Generator) -> int:
        value = round(rng.lognormal(np.log(self.median), self.sigma))
        return int(min(self.hi, max(self.lo, value)))

    def __str__(self) -> str:
        return f"lognormal median {self.median:g} sigma {self.sigma:g}, {self.lo}-{self.hi}"


@dataclass(frozen=True)
class Pareto:
    alpha: float
    minimum: int
    hi: int

    def draw(self, rng: np.random.Generator) -> int:
        # numpy's pareto is Lomax: shifted by one, and scaled, it is the classic Pareto.
        value = round((rng.pareto(self.alpha) + 1.0) * self.minimum)
        return int(min(self.hi, value))

    def __str__(self) -> str:
        return f"Pareto alpha {self.alpha:g} from {self.minimum}, up to {self.hi}"


MaxTokens = Literal["exact", "none"] | int


@dataclass(frozen=True)
class Lengths:
    """One distribution of request lengths."""

    name: str
    about: str
    answer: Sampler | None
    """Answer tokens; None where `pairs` or `turns` give them."""
    prompt: Sampler | None = None
    """Prompt tokens; None: the task example's own length (as in Chuppala (2024)), set by its
    text."""
    max_tokens: MaxTokens = "exact"
    trace: str | None = None
    """An Azure trace ('code', 'conv'): its (prompt, answer) pairs, drawn with replacement."""

    def draw(self, rng: np.random.Generator, context: int) -> tuple[int | None, int, int | None]:
        """(prompt tokens or None, answer tokens, max_tokens or None) of one request, for a
        model of `context` tokens."""
        prompt, answer = self.pair(rng)
        answer = max(1, min(answer, context // 2))
        if self.max_tokens == "exact":
            max_tokens: int | None = answer
        elif self.max_tokens == "none":
            max_tokens = None
        else:
            max_tokens = min(self.max_tokens, context // 2)
            answer = min(answer, max_tokens)
        if prompt is not None:
            prompt = max(1, min(prompt, context - (max_tokens or answer)))
        return prompt, answer, max_tokens

    def pair(self, rng: np.random.Generator) -> tuple[int | None, int]:
        """(prompt tokens or None, answer tokens) as drawn, before they are fitted."""
        if self.trace is not None:
            pairs = _pairs(self.trace)
            return pairs[int(rng.integers(len(pairs)))]
        assert self.answer is not None
        answer = self.answer.draw(rng)
        return self.prompt.draw(rng) if self.prompt is not None else None, answer

    def describe(self) -> str:
        """Its parameters, as the docs and a policy's record give them."""
        asked = self._asked()
        if self.trace is not None:
            return f"Azure {self.trace} trace's (prompt, answer) pairs; {asked}"
        prompt = self.prompt or "the task examples' own"
        return f"prompts {prompt}; answers {self.answer}; {asked}"

    def _asked(self) -> str:
        return {"exact": "max_tokens = the answer", "none": "no max_tokens"}.get(
            str(self.max_tokens), f"max_tokens {self.max_tokens}"
        )


@functools.cache
def _pairs(trace: str) -> tuple[tuple[int, int], ...]:
    try:
        records = read_azure_trace(resolve_trace(trace))
    except TraceError as exc:
        raise ValueError(f"lengths from the {trace!r} trace: {exc}") from exc
    return tuple((r.prompt_tokens, r.output_tokens) for r in records)


@dataclass(frozen=True)
class ChatShape:
    """A chat dataset's conversations: how many user turns, and how long each message is."""

    name: str
    source: str
    """The published statistics it matches."""
    min_turns: int
    mean_turns: float
    """User turns per conversation: `min_turns` plus a geometric number with this mean."""
    user_tokens: float
    """Mean tokens of a user message."""
    assistant_tokens: float
    """Mean tokens of an answer."""
    sigma: float = 1.0
    """Lognormal spread of message lengths: chosen, not published."""
    max_message_tokens: int = 4096

    def __post_init__(self) -> None:
        if not (1 <= self.min_turns <= self.mean_turns):
            raise ValueError(f"{self.name}: need 1 <= min_turns <= mean_turns")

    def turns(self, rng: np.random.Generator) -> int:
        """One conversation's user turns."""
        extra = self.mean_turns - self.min_turns
        return self.min_turns + (int(rng.geometric(1 / (1 + extra))) - 1 if extra else 0)

    def message(self, mean: float, rng: np.random.Generator) -> int:
        """One message's tokens, of a lognormal whose mean is `mean`."""
        mu = np.log(mean) - self.sigma**2 / 2
        return int(min(self.max_message_tokens, max(1, round(rng.lognormal(mu, self.sigma)))))


LMSYS_CHAT = ChatShape(
    name="lmsys-chat",
    source="LMSYS-Chat-1M (Zheng et al., 2023, Table 1): 2.0 turns per conversation, 69.5 "
    "tokens per user message, 214.5 per answer",
    min_turns=1,
    mean_turns=2.0,
    user_tokens=69.5,
    assistant_tokens=214.5,
)

SHAREGPT_16 = ChatShape(
    name="sharegpt-16",
    source="ShareGPT conversations of 16 messages or more, as KubeAI's benchmark sent "
    "them: 8,000 prompts of 832 tokens and 76 output tokens on average (6,656,338 and 608,447 "
    "in all); 10 user turns on average is chosen, and user messages sized to give 832",
    min_turns=8,
    mean_turns=10.0,
    user_tokens=60.0,
    assistant_tokens=76.0,
)


@dataclass(frozen=True)
class Conversations(Lengths):
    """A random turn of a multi-turn chat of `shape`: the prompt is the whole history so far
    (every user message and answer before, and the new user message), the answer the next one.
    The lengths of `workloads.conversations`' chats of that shape, without their text."""

    shape: ChatShape = LMSYS_CHAT

    def pair(self, rng: np.random.Generator) -> tuple[int | None, int]:
        shape = self.shape
        turn = int(rng.integers(1, shape.turns(rng) + 1))
        prompt = sum(shape.message(shape.user_tokens, rng) for _ in range(turn))
        prompt += sum(shape.message(shape.assistant_tokens, rng) for _ in range(turn - 1))
        return prompt, shape.message(shape.assistant_tokens, rng)

    def describe(self) -> str:
        shape = self.shape
        return (
            f"a random turn of a {shape.name} chat (turns geometric, at least {shape.min_turns}, "
            f"mean {shape.mean_turns:g}): prompt = the history, user messages lognormal mean "
            f"{shape.user_tokens:g}, answers mean {shape.assistant_tokens:g} (sigma "
            f"{shape.sigma:g}, at most {shape.max_message_tokens}); {self._asked()}"
        )


TRAINING: tuple[Lengths, ...] = (
    Lengths(
        "seed",
        "as in Chuppala (2024): the task examples' own short prompts, 32-128 output tokens",
        Uniform(32, 128),
    ),
    Lengths(
        "short-chat",
        "short chat, as most chat clients send it: no max_tokens",
        LogNormal(96, 0.8, 16, 512),
        LogNormal(48, 0.8, 4, 512),
        max_tokens="none",
    ),
    Lengths(
        "long-context",
        "long documents with short answers",
        Uniform(16, 128),
        Uniform(1000, 2000),
    ),
    Lengths(
        "lognormal-prompts",
        "heavy-tailed prompts, capped answers",
        Uniform(16, 512),
        LogNormal(256, 1.2, 4, 100_000),
        max_tokens=512,
    ),
    Lengths(
        "pareto-prompts",
        "heavier-tailed prompts, no max_tokens",
        LogNormal(128, 1.0, 16, 512),
        Pareto(1.5, 32, 100_000),
        max_tokens="none",
    ),
    Lengths(
        "long-answers",
        "the task examples' short prompts, 16-512 output tokens",
        Uniform(16, 512),
    ),
)
"""What the router is trained on, one drawn per training episode."""

HELD_OUT: tuple[Lengths, ...] = (
    Conversations(
        "conversations",
        "LMSYS-Chat-1M-shaped histories (Table 1's means), as the issue measured them",
        None,
        shape=LMSYS_CHAT,
    ),
    Lengths(
        "azure-conv",
        "the Azure LLM inference conversation trace's lengths, sent as a chat client does",
        None,
        max_tokens="none",
        trace="conv",
    ),
    Lengths(
        "azure-code",
        "the Azure LLM inference code trace's lengths, replayed as a benchmark client does",
        None,
        trace="code",
    ),
)
"""Named before any result was looked at, and never drawn in training: for evaluation only."""

ALL: dict[str, Lengths] = {d.name: d for d in (*TRAINING, *HELD_OUT)}


def named(names: Sequence[str]) -> tuple[Lengths, ...]:
    """The distributions of those names; ValueError naming the unknown ones."""
    unknown = [n for n in names if n not in ALL]
    if unknown:
        raise ValueError(f"unknown length distribution(s) {', '.join(unknown)} "
                         f"(known: {', '.join(ALL)})")  # fmt: skip
    return tuple(ALL[n] for n in names)
