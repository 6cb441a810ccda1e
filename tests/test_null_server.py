"""The null upstream as the gateways in front of it meet it: vLLM's chunk layout for chat and
completions, its load in vLLM's /metrics names, at most --max-num-seqs at once with the rest
waiting in order, and a client that leaves aborting its request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.sglang_fidelity import prompt_digest
from serving.launch import free_port, launch
from tests.support.servers import PYTHON, Server, wait_until
from tests.support.tiers import starts
from workloads import Message, Request


@pytest.fixture(scope="module")
@starts("twin")
def null_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    folder = tmp_path_factory.mktemp("null")
    command = [PYTHON, "-m", "workloads.null_server", "--port", str(port), "--h3-port", "0",
               "--model", "up", "--token-gap-ms", "20", "--max-num-seqs", "2",
               "--request-log", str(folder / "requests.jsonl")]  # fmt: skip
    with launch("null", command, port, "/health", folder / "null.log") as started:
        started.ready(60)
        server = Server(**vars(started))
        server.request_log = folder / "requests.jsonl"
        yield server


def metrics(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            out[sample.name + (f"[{reason}]" if reason else "")] = sample.value
    return out


def events(response: httpx.Response) -> list[dict]:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert response.text.endswith("data: [DONE]\n\n")
    return out


def test_completions_stream_in_vllms_layout(null_upstream: Server) -> None:
    body = {"model": "up", "prompt": "one two three", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = events(httpx.post(null_upstream.url + "/v1/completions", json=body, timeout=10))
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == [" t0", " t1", " t2"]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_streams_a_role_first_and_usage_on_every_chunk_when_asked(
    null_upstream: Server,
) -> None:
    body = {"model": "up", "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = events(httpx.post(null_upstream.url + "/v1/chat/completions", json=body, timeout=10))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:3]] == [" t0", " t1"]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 2]
    plain = {**body, "stream": False}
    whole = httpx.post(null_upstream.url + "/v1/chat/completions", json=plain, timeout=10).json()
    assert whole["choices"][0]["message"]["content"] == " t0 t1"
    assert whole["usage"]["prompt_tokens"] == 2


def test_a_bad_body_is_a_400_and_health_answers(null_upstream: Server) -> None:
    bad = httpx.post(null_upstream.url + "/v1/completions", content=b"{nope", timeout=10)
    assert bad.status_code == 400 and "invalid JSON" in bad.json()["error"]["message"]
    assert httpx.get(null_upstream.url + "/health").status_code == 200


async def test_past_max_num_seqs_requests_wait_in_order_and_leaving_aborts(
    null_upstream: Server,
) -> None:
    before = metrics(null_upstream)
    body = {"model": "up", "prompt": "x", "max_tokens": 50, "stream": True}
    started: list[int] = []

    leave = asyncio.Event()

    async with httpx.AsyncClient(timeout=30) as client:

        async def stream(i: int, leaves: bool) -> None:
            async with client.stream("POST", null_upstream.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        if i not in started:
                            started.append(i)
                        if leaves and leave.is_set():
                            return

        async def until_started(i: int) -> None:
            while i not in started:
                await asyncio.sleep(0.01)

        first = asyncio.create_task(stream(0, True))
        await until_started(0)
        second = asyncio.create_task(stream(1, False))
        await until_started(1)
        third = asyncio.create_task(stream(2, False))
        await asyncio.sleep(0.2)  # its request is in, waiting for a slot
        now = await asyncio.to_thread(metrics, null_upstream)
        assert (now["vllm:num_requests_running"], now["vllm:num_requests_waiting"]) == (2, 1)
        assert now["vllm:kv_cache_usage_perc"] == 1.0
        assert started == [0, 1]
        leave.set()  # the first leaves mid-answer: its slot goes to the third
        await asyncio.gather(first, second, third)
    assert started == [0, 1, 2]  # the third began only once the first left
    wait_until(
        lambda: metrics(null_upstream)["vllm:num_requests_running"] == 0, 10, "requests to end"
    )
    after = metrics(null_upstream)
    aborted = after.get("vllm:request_success_total[abort]", 0) - before.get(
        "vllm:request_success_total[abort]", 0
    )
    finished = after["vllm:request_success_total[length]"] - before.get(
        "vllm:request_success_total[length]", 0
    )
    assert (aborted, finished) == (1, 2)
    assert after["vllm:num_requests_waiting"] == 0


def test_the_request_log_names_each_prompt_as_its_sender_does(null_upstream: Server) -> None:
    """benchmarks.sglang_fidelity finds which upstream a gateway chose by this digest."""
    said = (Message("user", "which upstream?"),)
    request = Request("r", 0.0, said, 2, "free-tier")
    messages = [{"role": m.role, "content": m.content} for m in said]
    body = {"model": "up", "max_tokens": 2, "messages": messages}
    assert httpx.post(null_upstream.url + "/v1/chat/completions", json=body).status_code == 200
    assert null_upstream.request_log is not None
    lines = [json.loads(line) for line in null_upstream.request_log.read_text().splitlines()]
    assert lines[-1]["prompt_sha1"] == prompt_digest(request)
