"""A token stream's body goes past the app's middleware (`transport.body_send`), and is still
whole, counted and logged: the twin's whole app in this process, its engines started, a
middleware outside all of ours that counts what passes through its `send`."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message, Receive, Scope, Send

from config import load_deployment
from serving.app import build_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "stream": True,
        "ignore_eos": True}  # fmt: skip


class CountSends:
    """Outermost middleware: the messages each response sent through the chain, by type."""

    def __init__(self, app: Any, seen: list[str]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def counted(message: dict) -> None:
            self.seen.append(message["type"])
            await send(message)

        await self.app(scope, receive, counted)


def served(metrics: str) -> float:
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "serving_requests_total" and sample.labels["outcome"] == "ok":
                return sample.value
    return 0.0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_a_streams_tokens_skip_the_middleware_and_it_still_counts(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="serving.requests")
    app = build_app(load_deployment(name="embedded-sim").with_time_scale(0.01))
    seen: list[str] = []
    app.add_middleware(CountSends, seen=seen)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://twin") as http,
    ):
        response = await http.post("/v1/chat/completions", json=CHAT | {"stream": stream})
        metrics = (await http.get("/metrics")).text
    assert response.status_code == 200
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
        assert text
        # The chain saw the start of each response (the stream's, then /metrics'), and the
        # body of /metrics only.
        assert seen == ["http.response.start", "http.response.start", "http.response.body"]
    else:
        assert seen.count("http.response.body") == 2  # an answer's one body, and /metrics'
    assert served(metrics) == 1
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "serving.requests"]
    assert [line["outcome"] for line in logged] == ["ok"]


async def test_a_streams_plain_chunks_are_written_by_the_engines_task() -> None:
    # Between the first chunk and the last, a token goes from the engine's task (the generation's
    # pump) to the transport, not through a wake of the response's task (`Generation.relay`).
    # The events are the same: each one is a whole chunk, in order, and the text adds up.
    app = build_app(load_deployment(name="embedded-sim").with_time_scale(0.01))
    writers: list[tuple[str, asyncio.Task | None]] = []

    async def recorded(scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            writers.append((message["type"], asyncio.current_task()))
            await send(message)

        await app(scope, receive, sending)

    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=recorded), base_url="http://t") as http,
    ):
        response = await http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 64})
    assert response.status_code == 200
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len("".join(c["choices"][0]["delta"].get("content", "") for c in chunks).split()) == 64
    (start_type, responder), *bodies = writers
    assert start_type == "http.response.start"
    relayed = [task for _, task in bodies if task is not responder]
    # The first chunk, the last, [DONE] and the end come from the response's own task.
    assert responder is bodies[0][1] and responder is bodies[-1][1]
    assert len(relayed) >= (len(bodies) - 4) // 2, (len(relayed), len(bodies))
