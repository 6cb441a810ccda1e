"""The whole server in front of a `vllm serve`-shaped null upstream (`remote` engine): what
reaches the client is what the upstream sent, and an upstream that dies mid-stream ends the
stream in a counted engine error. The upstream is killed by the last test, which stays last."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from serving.launch import free_port
from tests.support.servers import Server, launch, null_remote_config, serving_command
from tests.support.tiers import starts
from tests.test_api import sse_events

ENGINE_ERRORS = {"qos_class": "free-tier", "model": "tiny-s", "outcome": "engine_error"}


@pytest.fixture(scope="module")
@starts("twin")
def gateway(tmp_path_factory: pytest.TempPathFactory, null_upstream: Server) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("gateway")
    config = null_remote_config(folder, null_upstream)
    port = free_port()
    command = serving_command(config, "null_remote", port, "--h3-port", "0")
    server = launch("null-gateway", command, port, "/readyz", folder)
    yield server.wait_ready()
    server.stop()


def stream(server: Server, max_tokens: int) -> list[dict | str]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return sse_events(r)


def test_what_the_client_gets_is_what_the_upstream_sent(gateway: Server) -> None:
    events = stream(gateway, 40)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(f" t{i}" for i in range(40))
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert chunks[-1]["usage"]["prompt_tokens"] == 1  # the upstream's count, relayed


def torch_mapped(server: Server) -> bool:
    """Whether the server process has torch's library in memory (imported, in other words)."""
    return "libtorch" in Path(f"/proc/{server.process.pid}/maps").read_text()


def test_a_gateway_for_remote_replicas_never_loads_torch(
    gateway: Server, null_upstream: Server, tmp_path: Path
) -> None:
    """Neither where it counts prompts with the model's tokenizer (tiny-s's, here), nor where
    the model's tokenizer is nowhere on the machine: transformers 5's AutoTokenizer imports torch
    even to fail its lookup, and a gateway that tried it stayed 0.4 GB larger for good."""
    stream(gateway, 2)
    assert not torch_mapped(gateway)
    spec = yaml.safe_load(null_remote_config(tmp_path, null_upstream).read_text())
    spec["models"]["opt-125m"]["source"] = "example/not-here"  # not even in a cache
    spec["placements"]["null_remote"][0]["model"] = "opt-125m"
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    port = free_port()
    command = serving_command(tmp_path / "models.yaml", "null_remote", port, "--h3-port", "0")
    uncounted = launch("uncounting-gateway", command, port, "/readyz", tmp_path).wait_ready()
    try:
        stream(uncounted, 2)
        assert "prompts are not counted before routing" in uncounted.log.read_text()
        assert not torch_mapped(uncounted)
    finally:
        uncounted.stop()


def test_an_upstream_that_dies_mid_stream_ends_in_a_counted_engine_error(
    gateway: Server, null_upstream: Server
) -> None:
    before = gateway.metric("serving_requests_total", **ENGINE_ERRORS)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000, "stream": True}
    events: list[dict | str] = []
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 3:
                    os.killpg(null_upstream.process.pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert isinstance(last, dict) and last["error"]["code"] == "engine_error", events[-3:]
    assert gateway.metric("serving_requests_total", **ENGINE_ERRORS) == before + 1
