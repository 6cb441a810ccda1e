"""The request: what crosses from the client, through the router, to an engine."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from config.paths import PathEstimate

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class TokenIds:
    """A prompt given as token ids of the model's vocabulary, as lm-eval sends them."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Request:
    request_id: str
    """Unique while the request lives."""
    arrival: float
    """Seconds on the caller's clock: monotonic when live, virtual in simulation."""
    prompt: str | TokenIds | tuple[Message, ...]
    """Raw text or token ids for a completion, or the conversation for a chat completion."""
    max_tokens: int | None
    """Output tokens to generate at most; None means up to the model's context."""
    qos_class: str
    """A name from models.yaml's qos_classes."""
    task: str | None = None
    """A task from models.yaml's quality table, if the client says which one."""
    prompt_tokens: int | None = None
    """Known in advance for generated workloads; live requests learn it from the tokenizer."""
    session_id: str | None = None
    """Requests of one multi-turn session share a growing prefix."""
    path: PathEstimate | None = None
    """What the server measured of its client's network path (None: nothing), or, in the
    simulator, the estimate of the path its client was drawn on."""
    blocks: tuple[int, ...] | None = None
    """The chained hashes of its prompt's full blocks of tokens (`router.kv_cache.block_hashes`,
    at the deployment's smallest KV block), where whoever counted its tokens cut them: what a
    prefix cache and a prefix-aware router know it by."""
    answer_tokens: int | None = None
    """Where its answer ends on its own (the model's end-of-sequence token), where the workload
    knows it: a generated request's drawn length, a trace's recorded one. For the engines the
    simulator models, not for the router, which predicts it (`router.features.OutputPredictor`).
    None: the answer runs to max_tokens."""

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, tuple)


def save_requests(path: str | Path, requests: Iterable[Request]) -> None:
    """A workload as JSON lines, one request each, so that another process (the load generator,
    in another network namespace, say) sends exactly these requests: `load_requests` reads them."""
    with Path(path).open("w") as f:
        for request in requests:
            f.write(json.dumps(asdict(request)) + "\n")


def load_requests(path: str | Path) -> list[Request]:
    """What `save_requests` wrote, in arrival order; ValueError naming the line that is bad."""
    out = []
    with Path(path).open() as f:
        for number, line in enumerate(f, 1):
            try:
                out.append(request_from_row(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}, line {number}: not a request ({exc})") from exc
    return sorted(out, key=lambda r: r.arrival)


def request_from_row(row: dict[str, Any]) -> Request:
    """A request from its `asdict` form, as `save_requests` writes it and the engine link sends
    it; ValueError, TypeError or KeyError if it is not one."""
    prompt = row["prompt"]
    if isinstance(prompt, dict):
        prompt = TokenIds(tuple(prompt["ids"]))
    elif not isinstance(prompt, str):
        prompt = tuple(Message(m["role"], m["content"]) for m in prompt)
    path, blocks = row.get("path"), row.get("blocks")
    request = Request(
        **{
            **row,
            "prompt": prompt,
            "path": PathEstimate(*path) if path is not None else None,
            "blocks": tuple(blocks) if blocks is not None else None,
        }
    )
    # What the server checks (max_tokens, the class, the prompt) is its to refuse, with a 4xx the
    # run counts; when to send is the load generator's alone.
    if not (isinstance(request.arrival, int | float) and 0 <= request.arrival < math.inf):
        raise ValueError(f"arrival must be a number of seconds from 0 on, not {request.arrival!r}")
    return request
