"""Real vLLM CPU engines in the engine host: `python -m serving --workers 2` on one vLLM engine.
Both workers stream the engine's own text through the engine link, with its log probabilities,
and SIGTERM leaves no process of the server (the engine host's vLLM processes included)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving.launch import free_port
from tests.support.processes import processes_under
from tests.support.servers import Server, launch, one_vllm_engine, serving_command
from tests.support.servers import write_test_config as write_config
from tests.support.tiers import starts

TRIES = 40
"""New connections until both workers have answered: all on one of two has odds of 2 in 2^40."""


@pytest.fixture(scope="module")
@starts("vllm")
def vllm_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("vllm-workers")
    config = write_config(folder, hosted=one_vllm_engine("hosted", "tiny-s"))
    port = free_port()
    log = folder / "requests.jsonl"
    command = serving_command(config, "hosted", port, "--h3-port", "0", "--workers", "2",
                              "--request-log", str(log))  # fmt: skip
    server = launch("vllm-workers", command, port, "/readyz", folder)
    server.request_log = log
    yield server.wait_ready()
    server.stop()


def chat(server: Server, **extra: object) -> httpx.Response:
    body = {"model": "tiny-s", "messages": [{"role": "user", "content": "Hello there!"}],
            "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}  # fmt: skip
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer


def test_both_workers_serve_the_hosted_vllm_engine(vllm_workers: Server) -> None:
    texts: dict[int, str] = {}
    for _ in range(TRIES):
        answer = chat(vllm_workers, logprobs=True, top_logprobs=2)
        line = vllm_workers.logged(answer.headers["x-request-id"])
        assert line["outcome"] == "ok" and line["tokens"] == 8
        choice = answer.json()["choices"][0]
        # vLLM's own log probabilities, carried over the link.
        assert len(choice["logprobs"]["content"]) == 8
        assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])
        texts[int(line["worker"])] = choice["message"]["content"]
        if len(texts) == 2:
            break
    assert set(texts) == {0, 1}
    assert texts[0] == texts[1]  # one engine, greedy: the same answer whichever worker asked


def test_sigterm_leaves_no_process_behind(vllm_workers: Server) -> None:
    under = processes_under(vllm_workers.pid)
    # The supervisor's two workers and its engine host, and under the host vLLM's own.
    assert len(under) >= 4, under
    os.kill(vllm_workers.pid, signal.SIGTERM)
    assert vllm_workers.process.wait(120) == 0
    deadline = time.monotonic() + 30
    while (alive := [p for p in under if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, {p: under[p] for p in alive}


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
