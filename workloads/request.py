"""The request: what crosses from the client, through the router, to an engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class Request:
    request_id: str
    """Unique while the request lives."""
    arrival: float
    """Seconds on the caller's clock: monotonic when live, virtual in simulation."""
    prompt: str | tuple[Message, ...]
    """Raw text for a completion, or the conversation for a chat completion."""
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

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)
