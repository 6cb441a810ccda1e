"""OpenAI request bodies as pydantic models, so that bad input is a 400 that names the field.

Fields this server does not implement are declared anyway when clients commonly send them at
their defaults; a non-default value is refused rather than silently ignored. Other unknown
fields are ignored, as vLLM's server does.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    field_validator,
    model_validator,
)

from serving.engines.base import MAX_LOGPROBS, Sampling
from workloads import Message, TokenIds

# Far beyond any context window here; a bigger value is a client bug, refused before routing.
MAX_TOKENS_LIMIT = 1_000_000
MAX_PROMPTS = 256
"""The largest batch of prompts one completion request may carry: each is a request of its own
to the router, admission control and the key's limits."""


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
    request before it is parsed (`serving.middleware.ShedAtTheDoor`). Values of the wrong type
    read as absent; validation refuses them later, if the request gets that far."""
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

    @field_validator("content", mode="before")
    @classmethod
    def _parts_are_text(cls, content: object) -> object:
        # Said here, as pydantic would report the union's first branch ("should be a valid
        # string") for an image part.
        if isinstance(content, list):
            kinds = {p.get("type") for p in content if isinstance(p, dict)} - {"text"}
            if kinds:
                got = ", ".join(sorted(map(str, kinds)))
                raise ValueError(f"only text content parts are served here, not {got}")
        return content

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
    user: str | None = None
    # Extensions.
    ignore_eos: bool = False
    """vLLM's extension: generate exactly max_tokens."""
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] = 0
    """vLLM's extension: no end of sequence before this many tokens (a replay of recorded
    answers sends their lengths; the twin's model ends its answer there)."""
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
            logprobs=self.top_logprobs_asked,
            echo=self.echoes,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=tuple(self.stop or ()),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per position the answer shows; None: no logprobs at all."""
        return None

    @property
    def echoes(self) -> bool:
        return False


class ChatCompletionRequest(GenerateRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    tools: Literal[None] = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> Self:
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> Self:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


TokenPrompt = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
"""Token ids of the model's vocabulary (the engine checks the upper bound)."""
OnePrompt = Annotated[
    Annotated[Text, Tag("text")] | Annotated[TokenPrompt, Tag("token ids")],
    Discriminator(lambda p: "text" if isinstance(p, str) else "token ids"),
]
"""Told apart by its JSON type, so that an error names the branch the client meant."""


class CompletionRequest(GenerateRequest):
    prompt: Annotated[list[OnePrompt], Field(min_length=1, max_length=MAX_PROMPTS)]
    """One prompt (text, or token ids) or a batch of them; read as a batch."""
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: Literal[None] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_or_a_batch(cls, prompt: object) -> object:
        one = isinstance(prompt, str) or (
            isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
        )
        return [prompt] if one else prompt

    @model_validator(mode="after")
    def _one_prompt_streams(self) -> Self:
        if self.stream and len(self.prompt) > 1:
            raise ValueError(
                "a streamed completion takes one prompt; send a batch of prompts unstreamed, "
                "or one request per prompt"
            )
        return self

    @property
    def prompts(self) -> list[str | TokenIds]:
        return [p if isinstance(p, str) else TokenIds(tuple(p)) for p in self.prompt]

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def echoes(self) -> bool:
        return self.echo
