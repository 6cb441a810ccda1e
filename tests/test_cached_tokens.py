"""How much of a prompt its engine found cached reaches the client as OpenAI's
`usage.prompt_tokens_details.cached_tokens`, and the request log. The twin's whole app in this
process, on a deployment whose engines cache prefixes and whose router keeps a prompt on the
replica that holds it; tests/test_remote.py checks the same number from a real `vllm serve`."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from config import load_deployment
from serving.app import build_app

WORDS = " ".join(f"word{i % 89}" for i in range(400))


async def test_the_second_sending_of_a_prompt_is_told_its_cached_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="serving.requests")
    deployment = load_deployment(name="kubeai-l4-sim").with_time_scale(0.01)
    app = build_app(deployment)
    chat = {"messages": [{"role": "user", "content": WORDS}], "max_tokens": 2}
    streamed = chat | {"stream": True, "stream_options": {"include_usage": True}}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://twin") as http,
    ):
        first = (await http.post("/v1/chat/completions", json=chat)).json()["usage"]
        second = (await http.post("/v1/chat/completions", json=chat)).json()["usage"]
        async with http.stream("POST", "/v1/chat/completions", json=streamed) as response:
            events = [line[6:] async for line in response.aiter_lines() if line[:6] == "data: "]
    third = json.loads(events[-2])["usage"]  # the last event is [DONE]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    tokens = first["prompt_tokens"]
    block = deployment.hash_block
    # Every whole block but the one holding the last token, which vLLM always computes.
    cached = (tokens - 1) // block * block
    assert tokens > 8 * block and cached > 0
    assert (
        second["prompt_tokens_details"]
        == third["prompt_tokens_details"]
        == {"cached_tokens": cached}
    )
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "serving.requests"]
    assert [line["cached_tokens"] for line in logged] == [0, cached, cached]
