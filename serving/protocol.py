"""OpenAI request bodies as pydantic models, so that bad input is a 400 that names the field.

Fields this server does not implement are declared anyway when clients commonly send them at
their defaults; a non-default value is refused rather than silently ignored. Other unknown
fields are ignored, as vLLM's server does.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from serving.engines.base import Sampling
from workloads import Message

# Far beyond any context window here; a bigger value is a client bug, refused before routing.
MAX_TOKENS_LIMIT = 1_000_000


def _unicode(text: str) -> str:
    # JSON may escape a lone surrogate ("\ud800"), which Python decodes to a str that is not
    # Unicode text: every tokenizer fails on it, which would surface as an engine's 500.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise ValueError(f"not Unicode text: a lone surrogate ({bad}) at {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
"""A string of text a model reads: what a request may say in JSON but no tokenizer can take is a
400, whatever the engine."""
StopText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]
"""An empty stop string would end every answer before its first token."""


def asked_for(body: object) -> tuple[str, int | None]:
    """The model and the answer's length (max_tokens) that a body asks for, read without
    validating it, as these models would read them: what admission control needs to shed a
    request before it is parsed (`serving.api.ShedAtTheDoor`). Values of the wrong type read as
    absent; validation refuses them later, if the request gets that far."""
    if not isinstance(body, dict):
        return "auto", None
    model = body.get("model", "auto")
    limits = (body.get("max_tokens"), body.get("max_completion_tokens"))
    max_tokens = next(
        (n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n >= 1), None
    )
    return model if isinstance(model, str) else "auto", max_tokens


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_is_text(cls, content: str | list[TextPart]) -> str | list[TextPart]:
        # Here rather than as the union's Text type, so that an error names the field
        # messages.N.content, not the union's branch.
        return _unicode(content) if isinstance(content, str) else content

    def to_message(self) -> Message:
        text = (
            self.content
            if isinstance(self.content, str)
            else "".join(part.text for part in self.content)
        )
        return Message(role="system" if self.role == "developer" else self.role, content=text)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's extension: usage on every chunk."""


class GenerateRequest(BaseModel):
    """What chat and text completion requests share."""

    model_config = ConfigDict(extra="ignore")

    model: str = "auto"
    """A model of the deployment, or "auto" to let the router choose."""
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[StopText], Field(max_length=4)] | None = None
    """One string or a list of them; read as a list, so that an error names what is wrong with
    it, not that it failed to be each of a union's types."""
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    logprobs: Literal[False, None] = None
    user: str | None = None
    # Extensions.
    ignore_eos: bool = False
    """vLLM's extension: generate exactly max_tokens."""
    task: str | None = None
    """Which task of the quality table the request belongs to; the router uses it."""

    @field_validator("n", mode="before")
    @classmethod
    def _one_choice(cls, n: object) -> object:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, stop: object) -> object:
        return [stop] if isinstance(stop, str) else stop

    def sampling(self) -> Sampling:
        return Sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            stop=tuple(self.stop or ()),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerateRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    tools: Literal[None] = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatCompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(GenerateRequest):
    prompt: str | Annotated[list[Text], Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    suffix: Literal[None] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_is_text(cls, prompt: str | list[str]) -> str | list[str]:
        return _unicode(prompt) if isinstance(prompt, str) else prompt  # see ChatMessage's

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]
