"""Multi-turn chat conversations whose every prompt carries the whole history so far, and the
workload of KubeAI's benchmark cut from them.

Conversations are generated here, from corpus sentences, with the turn counts and message
lengths of published chat datasets (`ChatShape`; docs/workloads.md says which statistics each
matches). Message lengths are lognormal: the datasets publish means, not shapes, so the spread
(`sigma`) is chosen, not matched.

Two ways to send them:
- `turns`: every conversation's turns, in order, for a closed-loop client that sends a
  conversation's next turn only when the previous answer has ended (`router.closed_loop`,
  `python -m workloads.replay --max-concurrency N --conversations`).
- `kubeai_benchmark_prompts`: what KubeAI's benchmark script sent (its chat-py
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
from workloads.lengths import LMSYS_CHAT, SHAREGPT_16, ChatShape
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
        messages: list[Message] = []
        for _ in range(shape.turns(rng)):
            messages.append(Message("user", filler(shape.message(shape.user_tokens, rng), rng)))
            answer = filler(shape.message(shape.assistant_tokens, rng), rng)
            messages.append(Message("assistant", answer))
        task = tasks[int(rng.integers(len(tasks)))]
        out.append(Conversation(f"c{index}", task, tuple(messages)))
    return out


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


def kubeai_benchmark_prompts(
    convs: Sequence[Conversation],
    max_prompts: int = 800,
    requests: int = 8000,
    seed: int = 12345,
    count: Tokens = FourCharacters(),  # noqa: B008 (immutable)
    qos_class: str = "free-tier",
) -> list[Request]:
    """KubeAI's benchmark requests (module docstring), with its pruning: prompts or answers
    under 4 tokens, and prompts over 8,192, are left out. Request ids are unique; the prompts
    repeat. Arrival times are 0: the client's rate and concurrency send them."""
    prompts = [
        r
        for r in turns(convs, qos_class, count)
        if r.max_tokens is not None and r.max_tokens >= 4 and 4 <= (r.prompt_tokens or 0) <= 8192
    ][:max_prompts]
    if not prompts:
        raise ValueError("no prompt survives the pruning of KubeAI's benchmark")
    order = np.random.default_rng(seed).permutation(len(prompts))
    picks = [int(order[i % len(prompts)]) for i in range(requests)]
    return [replace(prompts[p], request_id=f"p{p}n{i}") for i, p in enumerate(picks)]
