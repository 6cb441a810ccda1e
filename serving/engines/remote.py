"""An engine behind any OpenAI-compatible `vllm serve` URL: how the system reaches past one machine.

It speaks through the official `openai` client, which already handles streaming, error bodies and
timeouts. While the server cannot be reached the engine reports itself unhealthy; the replica's
supervisor (`serving.replicas.Supervisor`, the same for every engine kind) then calls `recover`,
which probes the server, with backoff until it answers again.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Literal, TypedDict

import openai
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam

from config import ReplicaConfig
from serving.engines.base import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
)
from workloads import Message, Request, TokenIds

log = logging.getLogger(__name__)


class WrongModel(Exception):
    """The server answers, but does not serve the model under the configured name."""


class _StreamArgs(TypedDict):
    """What a chat and a plain completion request share, as the openai client takes it."""

    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: list[str] | None
    seed: int | None
    presence_penalty: float
    frequency_penalty: float
    stream: Literal[True]
    stream_options: ChatCompletionStreamOptionsParam
    extra_body: dict[str, object]


class RemoteEngine:
    def __init__(self, config: ReplicaConfig, read_timeout_s: float = 60.0) -> None:
        if config.url is None:
            raise ValueError(f"{config.name}: a remote engine needs a url")
        self.config = config
        self._client = openai.AsyncOpenAI(
            base_url=config.url,
            api_key="unused",  # vllm serve ignores it unless started with --api-key
            max_retries=0,  # the gateway decides where a failed request goes, not the client
            timeout=openai.Timeout(read_timeout_s, connect=5.0),
        )
        self._healthy = False
        self._open: set[str] = set()
        self._streams: dict[str, openai.AsyncStream] = {}

    async def start(self) -> None:
        # A server that is not up yet is an outage for the supervisor to ride out, not a reason
        # to refuse to start; one that serves another model is a configuration error and raises.
        self._healthy = await self._reachable()
        if not self._healthy:
            log.warning("%s: %s does not answer", self.config.name, self.config.url)

    async def recover(self) -> None:
        if not await self._reachable():
            raise EngineUnavailable(f"{self.config.url} does not answer")
        self._healthy = True

    async def _reachable(self) -> bool:
        try:
            models = await self._client.models.list()
        except (openai.APIConnectionError, openai.APIStatusError):
            return False
        served = {m.id for m in models.data}
        if self.config.served_name not in served:
            raise WrongModel(
                f"{self.config.name}: {self.config.url} serves {sorted(served)}, not "
                f"{self.config.served_name!r}; set served_name in models.yaml"
            )
        return True

    async def generate(self, request: Request, sampling: Sampling) -> AsyncIterator[TokenDelta]:
        if not self._healthy:
            raise EngineUnavailable(f"{self.config.name}: {self.config.url} is unreachable")
        if sampling.logprobs is not None or sampling.echo:
            # Not relayed yet: the upstream's streamed logprobs would need mapping chunk by chunk.
            raise InvalidRequest(
                f"{self.config.name} is a remote replica, which does not relay logprobs or echo "
                "yet; pin a model this server runs itself.",
                param="logprobs" if sampling.logprobs is not None else "echo",
            )
        self._open.add(request.request_id)
        try:
            stream = await self._start(request, sampling)
            self._streams[request.request_id] = stream
            generated = 0
            async for chunk in stream:
                usage = chunk.usage
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                text = (choice.delta.content if request.is_chat else choice.text) or ""
                # vLLM's continuous usage gives exact counts; other servers send one token a chunk.
                total = usage.completion_tokens if usage else generated + (1 if text else 0)
                yield TokenDelta(
                    text=text,
                    tokens=total - generated,
                    prompt_tokens=usage.prompt_tokens if usage else 0,
                    finish_reason=choice.finish_reason,
                )
                generated = total
        except openai.APITimeoutError as exc:
            # One slow stream is this request's failure, not proof that the server is gone.
            raise EngineError(
                f"{self.config.name}: no output from {self.config.url} in time"
            ) from exc
        except openai.APIConnectionError as exc:
            self._healthy = False  # until the supervisor's probe finds it
            raise EngineError(f"{self.config.name}: lost {self.config.url}: {exc}") from exc
        except openai.APIError as exc:
            raise EngineError(f"{self.config.name}: {_message(exc)}") from exc
        finally:
            self._open.discard(request.request_id)
            still_open = self._streams.pop(request.request_id, None)
            if still_open is not None:
                await still_open.close()  # vllm serve aborts a request whose connection closes

    async def _start(self, request: Request, sampling: Sampling) -> openai.AsyncStream:
        """Send the request. Failures here mean the server never took it, so another may."""
        try:
            return await self._create(request, sampling)
        except openai.BadRequestError as exc:
            raise InvalidRequest(_message(exc), _error_field(exc, "param")) from exc
        except openai.APITimeoutError:
            raise
        except openai.APIConnectionError as exc:
            self._healthy = False  # until the supervisor's probe finds it
            raise EngineUnavailable(f"{self.config.name}: cannot reach {self.config.url}") from exc
        except openai.APIStatusError as exc:
            if exc.status_code == 503:  # busy or draining: it did not take the request
                raise EngineUnavailable(f"{self.config.name}: {_message(exc)}") from exc
            raise

    async def _create(self, request: Request, sampling: Sampling) -> openai.AsyncStream:
        common = _StreamArgs(
            model=self.config.served_name,
            max_tokens=request.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            stream=True,
            # continuous_usage_stats is vLLM's, unknown to openai's type.
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"ignore_eos": sampling.ignore_eos},
        )
        if isinstance(request.prompt, tuple):  # a chat
            messages = [_chat_message(m) for m in request.prompt]
            return await self._client.chat.completions.create(messages=messages, **common)
        prompt = (
            list(request.prompt.ids) if isinstance(request.prompt, TokenIds) else request.prompt
        )
        return await self._client.completions.create(prompt=prompt, **common)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            await stream.close()

    def healthy(self) -> bool:
        return self._healthy

    def unfinished(self) -> int:
        return len(self._open)

    async def close(self) -> None:
        self._healthy = False
        await self._client.close()


def _error_field(exc: openai.APIError, field: str) -> str | None:
    """A field of the server's OpenAI-shaped error body, where it sent one."""
    body = exc.body if isinstance(exc.body, dict) else {}
    inner = body.get("error", body)
    value = inner.get(field) if isinstance(inner, dict) else None
    return value if isinstance(value, str) else None


def _chat_message(message: Message) -> ChatCompletionMessageParam:
    # A branch per role: openai's type of a message is one TypedDict per role.
    if message.role == "system":
        return {"role": "system", "content": message.content}
    if message.role == "user":
        return {"role": "user", "content": message.content}
    return {"role": "assistant", "content": message.content}


def _message(exc: openai.APIError) -> str:
    return _error_field(exc, "message") or exc.message
