"""What a workload is: arrivals plus request contents. The one source of requests for both the
router's simulator and the live load generator (`python -m workloads.replay`).

`requests(spec, seed)` lazily turns the spec's arrival times into `Request`s: a task and a QoS
class drawn from their mixes, token lengths per task (or from a trace), task-shaped prompt text,
and, if asked, multi-turn sessions whose prompts repeat the whole conversation so far.

Arrivals and contents draw from separate generators, so changing the mix leaves the arrival
times of a seed alone.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from config import DEFAULT_MAX_MODEL_LEN
from workloads.arrivals import ArrivalProcess, Replay
from workloads.examples import EXAMPLES, corpus
from workloads.lengths import Lengths
from workloads.request import Message, Request
from workloads.traces import TraceRecord

DEFAULT_TASKS = ("hellaswag", "copa", "piqa", "openbookqa")
"""The four zero-shot tasks of Chuppala (2024) §5.1.1, drawn uniformly by default."""


@dataclass(frozen=True)
class TaskShape:
    prompt_tokens: tuple[int, int] | None = None
    """Uniform range of prompt tokens; None keeps an example's own length."""
    output_tokens: tuple[int, int] = (32, 128)
    """Uniform range of max output tokens."""


@dataclass(frozen=True)
class Sessions:
    """Multi-turn conversations, like the ShareGPT-derived workload of KubeAI's benchmark: turn
    n of a conversation sends messages 1..n-1 again, so prompts share growing prefixes."""

    turns: tuple[int, int] = (2, 6)
    """Uniform range of user turns per conversation."""
    new_share: float = 0.3
    """Share of arrivals that open a new conversation rather than continue an open one."""
    context_tokens: tuple[int, int] = (128, 384)
    """A background document in the first message makes each conversation's prefix its own."""


V = TypeVar("V")


def _frozen(mapping: Mapping[str, V]) -> Mapping[str, V]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class WorkloadSpec:
    arrivals: ArrivalProcess
    tasks: Mapping[str, float] = field(
        default_factory=lambda: _frozen(dict.fromkeys(DEFAULT_TASKS, 1.0))
    )
    """Relative weights; uniform over the four tasks by default."""
    classes: Mapping[str, float] = field(default_factory=lambda: _frozen({"free-tier": 1.0}))
    """Relative weights of QoS classes (names from models.yaml)."""
    shapes: Mapping[str, TaskShape] = field(default_factory=lambda: _frozen({}))
    """Per-task token lengths; a task without an entry gets `default_shape`."""
    default_shape: TaskShape = TaskShape()
    sessions: Sessions | None = None
    trace: Sequence[TraceRecord] | None = None
    """Token lengths per arrival, in arrival order, taking the place of the shapes."""
    prompts: Mapping[str, Sequence[str]] = field(default_factory=lambda: _frozen(EXAMPLES))
    """Prompt texts per task: the built-in examples, or real task data loaded by the caller."""
    max_prompt_tokens: int | None = None
    """Clip longer prompts (a trace's, say) to fit the model's context."""
    max_output_tokens: int | None = None
    chars_per_token: float = 4.0
    """Sizes text for a token count before any tokenizer is known; servers report the truth."""
    lengths: Lengths | None = None
    """Prompt and answer lengths and max_tokens (`workloads.lengths`), taking the place of the
    shapes; each request carries its answer's length (`Request.answer_tokens`)."""
    context: int = DEFAULT_MAX_MODEL_LEN
    """The model's context, which `lengths` fit each request into."""
    text: bool = True
    """False: with `lengths`, a prompt is the task example alone, its drawn length only counted
    (`Request.prompt_tokens`): for the simulator, which needs no text, and draws millions."""

    def __post_init__(self) -> None:
        for name, mix in (("tasks", self.tasks), ("classes", self.classes)):
            if not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
                raise ValueError(f"the {name} mix needs non-negative weights that sum above 0")
        if self.lengths is not None and (self.sessions is not None or self.trace is not None):
            raise ValueError("lengths take the place of a trace's and of sessions: give one")
        if missing := sorted(t for t in self.tasks if not self.prompts.get(t)):
            raise ValueError(f"no prompts for task(s): {', '.join(missing)}")


def from_trace(records: Sequence[TraceRecord], **overrides: Any) -> WorkloadSpec:
    """Replay a trace's arrival times and token lengths, with contents drawn as usual."""
    arrivals = Replay(tuple(r.arrival for r in records))
    return WorkloadSpec(arrivals=arrivals, trace=tuple(records), **overrides)


def load_prompts(path: str | Path) -> dict[str, tuple[str, ...]]:
    """Prompts per task from a JSONL file of {"task": ..., "prompt": ...} rows, such as real
    benchmark questions exported from lm-eval's task data where the user has it."""
    prompts: dict[str, list[str]] = {}
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from exc
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.setdefault(str(row["task"]), []).append(str(row["prompt"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f'{path}:{number}: expected {{"task": ..., "prompt": ...}}: {exc}'
            ) from None
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return {task: tuple(texts) for task, texts in prompts.items()}


def parse_mix(text: str) -> dict[str, float]:
    """'a=3,b=1' or 'a,b' (equal weights) as a weight mapping."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"bad weight in {part!r}: expected name=number") from None
    if not mix:
        raise ValueError(f"empty mix {text!r}")
    return mix


_SENTENCE = re.compile(r"[^.?!\n]+[.?!]")


@dataclass
class _Conversation:
    session_id: str
    task: str
    qos_class: str
    turns_left: int
    messages: list[Message]


class _Contents:
    """Draws everything about a request except when it arrives."""

    def __init__(self, spec: WorkloadSpec, rng: np.random.Generator) -> None:
        self.spec, self.rng = spec, rng
        # Cumulative weights once per mix: a simulator draws millions of requests.
        self.mixes = {
            name: (list(mix), np.cumsum(list(mix.values())) / sum(mix.values()))
            for name, mix in (("tasks", spec.tasks), ("classes", spec.classes))
        }
        self.open: list[_Conversation] = []
        self.sessions = 0

    def pick(self, mix: str) -> str:
        """A name from the spec's "tasks" or "classes" mix, by weight."""
        names, cumulative = self.mixes[mix]
        return names[
            min(int(np.searchsorted(cumulative, self.rng.random(), "right")), len(names) - 1)
        ]

    def uniform(self, bounds: tuple[int, int]) -> int:
        return int(self.rng.integers(bounds[0], bounds[1] + 1))

    def filler(self, tokens: int) -> str:
        return filler(tokens, self.rng, self.spec.chars_per_token)

    def example(self, task: str) -> str:
        texts = self.spec.prompts[task]
        return texts[int(self.rng.integers(len(texts)))]

    def prompt(self, task: str, tokens: int | None) -> str:
        """A task example, led by background text when `tokens` asks for more than it has."""
        text = self.example(task)
        if tokens:
            text = with_background(text, tokens, self.rng, self.spec.chars_per_token)
        limit = self.spec.max_prompt_tokens
        if limit is not None and len(text) > limit * self.spec.chars_per_token:
            text = text[-int(limit * self.spec.chars_per_token) :]
        return text

    def lengths(self, task: str, index: int) -> tuple[int | None, int]:
        if self.spec.trace is not None:
            record = self.spec.trace[index]
            return record.prompt_tokens, max(1, record.output_tokens)
        shape = self.spec.shapes.get(task, self.spec.default_shape)
        prompt = self.uniform(shape.prompt_tokens) if shape.prompt_tokens else None
        return prompt, self.uniform(shape.output_tokens)

    def tokens(self, text: str) -> int:
        return max(1, round(len(text) / self.spec.chars_per_token))

    def request(self, index: int, arrival: float) -> Request:
        if self.spec.sessions is not None:
            return self.turn(index, arrival, self.spec.sessions)
        if self.spec.lengths is not None:
            return self.drawn(index, arrival, self.spec.lengths)
        task = self.pick("tasks")
        qos_class = self.pick("classes")
        prompt_tokens, output = self.lengths(task, index)
        text = self.prompt(task, prompt_tokens)
        return Request(
            request_id=f"r{index}",
            arrival=arrival,
            prompt=(Message("user", text),),
            max_tokens=self.clip_output(output),
            qos_class=qos_class,
            task=task,
            prompt_tokens=self.tokens(text),
        )

    def drawn(self, index: int, arrival: float, lengths: Lengths) -> Request:
        task = self.pick("tasks")
        qos_class = self.pick("classes")
        prompt_tokens, answer, max_tokens = lengths.draw(self.rng, self.spec.context)
        text = self.prompt(task, prompt_tokens) if self.spec.text else self.example(task)
        return Request(
            request_id=f"r{index}",
            arrival=arrival,
            prompt=(Message("user", text),),
            max_tokens=max_tokens,
            qos_class=qos_class,
            task=task,
            prompt_tokens=prompt_tokens if prompt_tokens is not None else self.tokens(text),
            answer_tokens=answer,
        )

    def clip_output(self, tokens: int) -> int:
        limit = self.spec.max_output_tokens
        return tokens if limit is None else min(tokens, limit)

    def turn(self, index: int, arrival: float, sessions: Sessions) -> Request:
        if not self.open or self.rng.random() < sessions.new_share:
            task = self.pick("tasks")
            context = self.filler(self.uniform(sessions.context_tokens))
            first = f"Background: {context}\n\n{self.example(task)}"
            conv = _Conversation(
                f"s{self.sessions}",
                task,
                self.pick("classes"),
                self.uniform(sessions.turns),
                [Message("user", first)],
            )
            self.sessions += 1
            self.open.append(conv)
        else:
            conv = self.open[int(self.rng.integers(len(self.open)))]
            conv.messages.append(Message("user", self.example(conv.task)))
        _, output = self.lengths(conv.task, index)
        output = self.clip_output(output)
        conv.turns_left -= 1
        messages = tuple(conv.messages)
        if conv.turns_left <= 0:
            self.open.remove(conv)
        else:
            # The recorded answer the next turn repeats, as a ShareGPT conversation carries one.
            conv.messages.append(Message("assistant", self.filler(output)))
        return Request(
            request_id=f"r{index}",
            arrival=arrival,
            prompt=messages,
            max_tokens=output,
            qos_class=conv.qos_class,
            task=conv.task,
            prompt_tokens=self.tokens("".join(m.content for m in messages)),
            session_id=conv.session_id,
        )


@functools.cache
def _sentences() -> list[str]:
    return [s.strip() for s in _SENTENCE.findall(corpus())]


def filler(tokens: int, rng: np.random.Generator, chars_per_token: float = 4.0) -> str:
    """Corpus sentences in random order, about `tokens` long."""
    sentences = _sentences()
    out: list[str] = []
    chars = 0
    while chars < tokens * chars_per_token:
        sentence = sentences[int(rng.integers(len(sentences)))]
        out.append(sentence)
        chars += len(sentence) + 1
    return " ".join(out)


def with_background(
    text: str, tokens: int, rng: np.random.Generator, chars_per_token: float = 4.0
) -> str:
    """`text`, led by background text if it is shorter than `tokens`, to make it about that long."""
    missing = int(tokens - len(text) / chars_per_token)
    if missing <= 0:
        return text
    return f"Background: {filler(missing, rng, chars_per_token)}\n\n{text}"


def requests(
    spec: WorkloadSpec, seed: int, duration: float | None = None, limit: int | None = None
) -> Iterator[Request]:
    """The workload's requests in arrival order, lazily. An infinite arrival process needs
    `duration` (seconds) or `limit` (requests) unless the caller stops iterating."""
    arrivals: Iterator[float] = spec.arrivals.iter(seed)
    if duration is not None:
        arrivals = itertools.takewhile(lambda t: t < duration, arrivals)
    if limit is not None:
        arrivals = itertools.islice(arrivals, limit)
    contents = _Contents(spec, np.random.default_rng([seed, 1]))
    for index, arrival in enumerate(arrivals):
        yield contents.request(index, arrival)
