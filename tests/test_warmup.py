"""Ready means ready: a fresh server's first requests meet the deadlines of their class.

An engine serves every path once before its replica is ready (`serving.engines.warmup`), so the
paths that cost seconds on their first run (vLLM compiles the ranking of log-probabilities on
first use) cost them before /readyz says 200, not in a user's request. This server keeps the
shipped classes' real deadlines (the suite's shared servers give every class 60 s), so a cold
path shows as the 504 a user would get.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import yaml

from serving.engines.warmup import paths
from serving.launch import free_port
from tests.support.servers import (
    ROOT,
    Server,
    launch,
    one_vllm_engine,
    serving_command,
    write_test_config,
)
from tests.support.tiers import starts
from workloads import TokenIds

LOGLIKELIHOOD = {"prompt": "The cat sat on the mat", "max_tokens": 1, "echo": True, "logprobs": 1}
"""What lm-eval's local-completions sends to score a continuation (no class header: free tier)."""


@pytest.fixture(scope="module")
@starts("vllm")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One vLLM engine of tiny-s, the classes' real deadlines, no request served yet."""
    work = tmp_path_factory.mktemp("warmup")
    config = write_test_config(work, fresh=one_vllm_engine("fresh", "tiny-s"))
    spec = yaml.safe_load(config.read_text())
    spec["qos_classes"].update(yaml.safe_load((ROOT / "models.yaml").read_text())["qos_classes"])
    config.write_text(yaml.safe_dump(spec, sort_keys=False))
    port = free_port()
    server = launch("fresh", serving_command(config, "fresh", port, "--h3-port", "0"), port,
                    "/readyz", work)  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_a_fresh_server_answers_a_loglikelihood_request_in_the_free_tier_first_time(
    fresh: Server,
) -> None:
    reply = httpx.post(
        fresh.url + "/v1/completions", json={"model": "tiny-s", **LOGLIKELIHOOD}, timeout=30
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"].startswith("The cat sat on the mat")
    assert choice["logprobs"]["token_logprobs"][0] is None  # the prompt's first token
    assert all(lp is not None for lp in choice["logprobs"]["token_logprobs"][1:])
    log = fresh.log.read_text()
    assert "cpu/tiny-s: ready in" in log and "log-probabilities of prompt and output" in log


def test_the_warm_up_covers_batches_log_probabilities_and_the_longest_prompt() -> None:
    decode, logprobs, longest = paths(max_model_len=2048, max_batch=64, filler_token=7)
    # Sent at once, they decode in a batch that halves each step, from the full batch to one.
    tokens = [r.max_tokens or 0 for r, _ in decode.requests]
    assert [sum(n >= step for n in tokens) for step in range(1, 8)] == [64, 32, 16, 8, 4, 2, 1]
    assert max(tokens) == 7 and all(s.ignore_eos for _, s in decode.requests)
    samplings = [s for _, s in decode.requests]
    assert {s.temperature for s in samplings} >= {0.0, 1.0}
    assert any(s.top_p < 1 for s in samplings)
    seeded, *_ = paths(max_model_len=2048, max_batch=64, filler_token=7, seeded=True)
    assert any(s.seed is not None for _, s in seeded.requests)
    assert all(s.echo and s.logprobs is not None for _, s in logprobs.requests)
    assert max(s.logprobs or 0 for _, s in logprobs.requests) == 20
    ((request, _),) = longest.requests
    assert request.prompt == TokenIds((7,) * 2047) and request.max_tokens == 1


def test_a_cpu_engine_refuses_seeded_sampling_that_would_kill_it(fresh: Server) -> None:
    # vLLM's CPU backend dies on a seeded request whose prefill is split over steps; refused at
    # once, the request cannot take the engine and its other requests down with it.
    url = fresh.url + "/v1/chat/completions"
    body = {"model": "tiny-s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    refused = httpx.post(url, json={**body, "seed": 1, "temperature": 0.8}, timeout=30)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "seed"
    greedy = httpx.post(url, json={**body, "seed": 1, "temperature": 0}, timeout=30)
    assert greedy.status_code == 200, greedy.text
    assert httpx.get(fresh.url + "/readyz", timeout=5).status_code == 200
