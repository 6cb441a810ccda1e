"""Multi-turn chat conversations whose every prompt carries the whole history so far, and seed
003's benchmark workload cut from them.

Conversations are generated here, from corpus sentences, with the turn counts and message
lengths of published chat datasets (`ChatShape`; docs/workloads.md says which statistics each
matches). Message lengths are lognormal: the datasets publish means, not shapes, so the spread
(`sigma`) is chosen, not matched.

Two ways to send them:
- `turns`: every conversation's turns, in order, for a closed-loop client that sends a
  conversation's next turn only when the previous answer has ended (`router.closed_loop`,
  `python -m workloads.replay --max-concurrency N --conversations`).
- `seed003_prompts`: what seed 003's benchmark script sent (KubeAI's chat-py
  `benchmark_serving.py`, `sample_sharegpt_requests`): each conversation cut into prompts of
  1, 3, 5, ... messages, the next message's length as max_tokens; the first `max_prompts` of
  them (its `--max-conversations` counts prompts, not conversations), shuffled, then walked
  again and again until `requests` are drawn, with no order kept within a conversation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from workloads.generate import DEFAULT_TASKS, filler
from workloads.request import Message, Request


class Tokens(Protocol):
    """Counts tokens as the model does."""

    def prompt(self, messages: tuple[Message, ...]) -> int:
        """A conversation's tokens as a prompt, through the chat template."""
        ...

    def text(self, text: str) -> int:
        """A message's own tokens."""
        ...


class FourCharacters:
    """Tokens at four characters each, where no tokenizer is at hand."""

    def prompt(self, messages: tuple[Message, ...]) -> int:
        return max(1, sum(len(m.content) for m in messages) // 4)

    def text(self, text: str) -> int:
        return max(1, len(text) // 4)


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
    source="seed 003's ShareGPT conversations of 16 messages or more, as its benchmark sent "
    "them: 8,000 prompts of 832 tokens and 76 output tokens on average (6,656,338 and 608,447 "
    "in all); 10 user turns on average is chosen, and user messages sized to give 832",
    min_turns=8,
    mean_turns=10.0,
    user_tokens=60.0,
    assistant_tokens=76.0,
)

SHAPES = {shape.name: shape for shape in (LMSYS_CHAT, SHAREGPT_16)}


@dataclass(frozen=True)
class Conversation:
    session_id: str
    task: str
    messages: tuple[Message, ...]
    """User and assistant in turn, a user message first and an answer last."""


def conversations(
    shape: ChatShape, n: int, seed: int, tasks: Sequence[str] = DEFAULT_TASKS
) -> list[Conversation]:
    """`n` conversations of `shape`, from `seed`."""
    rng = np.random.default_rng([seed, 3])
    out = []
    for index in range(n):
        extra = shape.mean_turns - shape.min_turns
        turns = shape.min_turns + (int(rng.geometric(1 / (1 + extra))) - 1 if extra else 0)
        messages: list[Message] = []
        for _ in range(turns):
            messages.append(Message("user", filler(_length(shape.user_tokens, shape, rng), rng)))
            answer = filler(_length(shape.assistant_tokens, shape, rng), rng)
            messages.append(Message("assistant", answer))
        task = tasks[int(rng.integers(len(tasks)))]
        out.append(Conversation(f"c{index}", task, tuple(messages)))
    return out


def _length(mean: float, shape: ChatShape, rng: np.random.Generator) -> int:
    mu = np.log(mean) - shape.sigma**2 / 2  # the lognormal whose mean is `mean`
    return int(min(shape.max_message_tokens, max(1, round(rng.lognormal(mu, shape.sigma)))))


def turns(
    convs: Sequence[Conversation],
    qos_class: str = "free-tier",
    count: Tokens = FourCharacters(),  # noqa: B008 (immutable)
    max_prompt_tokens: int | None = None,
) -> list[Request]:
    """Every turn of every conversation, in order: turn k's prompt is the conversation's first
    2k - 1 messages, and its max_tokens the length of the answer that follows (which turn k + 1
    carries in its history). A turn whose prompt is longer than `max_prompt_tokens` ends its
    conversation. Arrival times are 0: a closed-loop client sends them."""
    out = []
    for conv in convs:
        for k, end in enumerate(range(1, len(conv.messages), 2)):
            prompt = conv.messages[:end]
            tokens = count.prompt(prompt)
            if max_prompt_tokens is not None and tokens > max_prompt_tokens:
                break
            out.append(
                Request(
                    request_id=f"{conv.session_id}t{k}",
                    arrival=0.0,
                    prompt=prompt,
                    max_tokens=count.text(conv.messages[end].content),
                    qos_class=qos_class,
                    task=conv.task,
                    prompt_tokens=tokens,
                    session_id=conv.session_id,
                )
            )
    return out


def first_turns(
    requests: Sequence[Request], ordered: bool
) -> tuple[list[Request], dict[str, deque[Request]]]:
    """For a closed-loop client: the requests ready by their arrival times, and, with `ordered`,
    each session's later requests in order, each to be ready when the one before it ends."""
    later: dict[str, deque[Request]] = {}
    first: list[Request] = []
    for request in requests:
        session = request.session_id
        if ordered and session is not None and session in later:
            later[session].append(request)
            continue
        if ordered and session is not None:
            later[session] = deque()
        first.append(request)
    return first, later


def seed003_prompts(
    convs: Sequence[Conversation],
    max_prompts: int = 800,
    requests: int = 8000,
    seed: int = 12345,
    count: Tokens = FourCharacters(),  # noqa: B008 (immutable)
    qos_class: str = "free-tier",
) -> list[Request]:
    """Seed 003's benchmark requests (module docstring), with its pruning: prompts or answers
    under 4 tokens, and prompts over 8,192, are left out. Request ids are unique; the prompts
    repeat. Arrival times are 0: the client's rate and concurrency send them."""
    prompts = [
        r
        for r in turns(convs, qos_class, count)
        if r.max_tokens is not None and r.max_tokens >= 4 and 4 <= (r.prompt_tokens or 0) <= 8192
    ][:max_prompts]
    if not prompts:
        raise ValueError("no prompt survives seed 003's pruning")
    order = np.random.default_rng(seed).permutation(len(prompts))
    picks = [int(order[i % len(prompts)]) for i in range(requests)]
    return [replace(prompts[p], request_id=f"p{p}n{i}") for i, p in enumerate(picks)]
