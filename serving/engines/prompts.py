"""A request's prompt as an engine's tokenizer counts it, and the output room the context leaves:
what every engine that tokenises locally (vLLM's, the simulated one) must do alike, down to the
400 a prompt too long for the context gets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from config import Deployment, ReplicaConfig
from router.kv_cache import block_hashes
from serving.embedded import ensure_built
from serving.engines.base import InvalidRequest
from workloads import Message, Request, TokenIds

log = logging.getLogger(__name__)


# Tokenising took 0.46 ms per 1,000 characters here (the embedded tokenizer, 2-core CPU) and
# 7 ms for 16,000; a thread hop costs about a tenth of a millisecond. Longer prompts go to a thread.
_INLINE_TOKENIZE_CHARS = 1_024


class PromptTokenizer:
    """Token ids of a request's prompt: raw text as is, a conversation through the chat template
    (the model's override, the tokenizer's own, else the file-wide fallback), as vLLM's OpenAI
    server does."""

    def __init__(self, tokenizer: Any, config: ReplicaConfig) -> None:
        self.tokenizer = tokenizer
        self.chat_template = (
            config.chat_template
            or getattr(tokenizer, "chat_template", None)
            or config.fallback_chat_template
        )
        # Characters in the vocabulary's longest token (byte-level tokens spell a character in
        # one to four, so a prompt never has fewer tokens than its characters over this).
        # A walk of the vocabulary: made once, where the engine is built, not in a request.
        self._longest = max(len(token) for token in tokenizer.get_vocab())
        self._vocabulary = len(tokenizer)

    async def ids(self, request: Request, max_model_len: int) -> list[int]:
        """Tokenise; a long prompt in a thread, so that it does not stall every other stream.
        Raises InvalidRequest if the chat template refuses the conversation, or, before any
        tokenising, if the prompt has more characters than `max_model_len` of the vocabulary's
        longest tokens hold: a 4 MB prompt would otherwise take seconds of a core in a thread
        that cannot be stopped, long after its deadline answered the client."""
        from jinja2 import TemplateError

        chars = _prompt_chars(request)
        if chars > max_model_len * self._longest:
            raise InvalidRequest(
                f"This model's maximum context length is {max_model_len} tokens, and the prompt "
                f"has {chars} characters, more than that many tokens can hold.",
                param="messages" if request.is_chat else "prompt",
                code="context_length_exceeded",
            )
        try:
            if chars < _INLINE_TOKENIZE_CHARS:
                return self.encode(request)
            return await asyncio.to_thread(self.encode, request)
        except TemplateError as exc:  # a model's own template may refuse a conversation
            raise InvalidRequest(
                f"The chat template refused the messages: {exc}", param="messages"
            ) from exc

    def text(self, request: Request, ids: list[int]) -> str:
        """The prompt as text, as an echo gives it back: as sent, or its ids read back."""
        return request.prompt if isinstance(request.prompt, str) else self.tokenizer.decode(ids)

    def token(self, token_id: int) -> str:
        """One token's text on its own."""
        return self.tokenizer.decode([token_id])

    def encode(self, request: Request) -> list[int]:
        """The prompt's token ids, here and now (`ids` guards the size and the thread)."""
        if isinstance(request.prompt, TokenIds):
            ids = list(request.prompt.ids)
            bad = next((i for i in ids if not 0 <= i < self._vocabulary), None)
            if bad is not None:
                raise InvalidRequest(
                    f"Token id {bad} is out of the vocabulary (0 to {self._vocabulary - 1}).",
                    param="prompt",
                )
            return ids
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt)
        messages = [{"role": m.role, "content": m.content} for m in request.prompt]
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
        )
        # As vLLM does: a chat template writes its own special tokens.
        return self.tokenizer.encode(text, add_special_tokens=False)


class PromptCounter:
    """Counts prompts once, as the engines will: a request with its token count and its block
    hashes (`Request.blocks`) filled in. Also what the workload generators count with
    (`workloads.conversations.Tokens`), so the simulator's counts are the live ones. Where the
    same prompt comes again (a benchmark that repeats its prompts), the count is remembered."""

    def __init__(self, prompts: PromptTokenizer, hash_block: int, remember: bool = False) -> None:
        self.prompts = prompts
        self.hash_block = hash_block
        self._seen: dict[object, tuple[int, tuple[int, ...]]] | None = {} if remember else None

    async def count(self, request: Request, max_model_len: int) -> Request:
        """`counted`, as an engine tokenises: a long prompt in a thread, an absurd one refused
        (InvalidRequest, a 400) before any tokenising (`PromptTokenizer.ids`)."""
        ids = await self.prompts.ids(request, max_model_len)
        return replace(request, prompt_tokens=len(ids), blocks=block_hashes(ids, self.hash_block))

    def counted(self, request: Request) -> Request:
        seen = self._seen
        got = seen.get(request.prompt) if seen is not None else None
        if got is None:
            ids = self.prompts.encode(request)
            got = len(ids), block_hashes(ids, self.hash_block)
            if seen is not None:
                seen[request.prompt] = got
        return replace(request, prompt_tokens=got[0], blocks=got[1])

    def prompt(self, messages: tuple[Message, ...]) -> int:
        return len(self.prompts.encode(Request("count", 0.0, messages, None, "")))

    def text(self, text: str) -> int:
        return len(self.prompts.tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(source: str, local_only: bool = False) -> Any:
    """`source`'s tokenizer, as vLLM would load it (AutoTokenizer), but without importing torch
    where the files allow: transformers 5's AutoTokenizer imports torch (and with it triton), a
    third of a gigabyte resident and seconds of start-up in a process that runs no engine. A
    tokenizer saved as the plain tokenizers backend (the embedded models' are, and so is any
    `PreTrainedTokenizerFast`) is loaded as that class directly; any other goes through
    AutoTokenizer. `local_only`: from files already here (a folder, or the Hugging Face cache),
    never downloading; where there are none, OSError before transformers is imported at all."""
    config = _local_file(source, "tokenizer_config.json")
    if local_only and config is None and _local_file(source, "tokenizer.json") is None:
        raise OSError(f"no tokenizer files of {source} on this machine")
    if config is not None:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(config.read_text()).get("tokenizer_class") in _TOKENIZERS_BACKEND:
                from transformers.tokenization_utils_tokenizers import TokenizersBackend

                return TokenizersBackend.from_pretrained(source, local_files_only=local_only)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, local_files_only=local_only)


_TOKENIZERS_BACKEND = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""Tokenizer classes that are transformers 5's plain tokenizers backend (one class, two names)."""


def _local_file(source: str, name: str) -> Path | None:
    """`source`'s file `name` on this machine: in its folder, or in the Hugging Face cache."""
    folder = Path(source)
    if folder.is_dir():
        return folder / name if (folder / name).is_file() else None
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(source, name)
    except HFValidationError:  # neither a folder here nor a repository's name
        return None
    return Path(cached) if isinstance(cached, str) else None


def gateway_counter(deployment: Deployment, remember: bool = False) -> PromptCounter | None:
    """What the gateway counts prompts with before it routes: the tokenizer the simulated
    engines count with, else the first replica's model's, where its files are here (a local
    model, or one already in the Hugging Face cache: a gateway never downloads). None, logged,
    where there is none: requests then go unrouted by their length, as before. `remember`:
    count each distinct prompt once (for a workload that repeats its prompts)."""
    simulation = deployment.simulation
    if simulation is not None and simulation.tokenizer_source is not None:
        source, build = simulation.tokenizer_source, simulation.tokenizer_build
    else:
        first = deployment.replicas[0]
        source, build = first.source, first.build
    try:
        if build is not None:
            ensure_built(source, build)
        tokenizer = load_tokenizer(source, local_only=True)
    except (OSError, ValueError) as exc:
        log.warning("prompts are not counted before routing: no tokenizer of %s here (%s)",
                    source, exc)  # fmt: skip
        return None
    prompts = PromptTokenizer(tokenizer, deployment.replicas[0])
    return PromptCounter(prompts, deployment.hash_block, remember)


def output_budget(request: Request, prompt_tokens: int, max_model_len: int) -> int:
    """The output tokens to generate at most: the request's max_tokens, or all the context leaves.
    Raises InvalidRequest (a 400, code context_length_exceeded) where they do not fit."""
    room = max_model_len - prompt_tokens
    if room <= 0:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"and the prompt has {prompt_tokens} tokens.",
            param="messages" if request.is_chat else "prompt",
            code="context_length_exceeded",
        )
    max_tokens = request.max_tokens if request.max_tokens is not None else room
    if max_tokens > room:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} in the completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def _prompt_chars(request: Request) -> int:
    if isinstance(request.prompt, str):
        return len(request.prompt)
    if isinstance(request.prompt, TokenIds):  # a token spells at least one character
        return len(request.prompt.ids)
    return sum(len(m.content) for m in request.prompt)
