"""The OpenAI-compatible API on the real embedded deployment (three vLLM CPU engines)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace

import httpx
import openai
import pytest

from serving.engines.base import TokenDelta
from serving.render import Relay, Shape, event
from tests.support.processes import ENGINE_CORE, processes_under, thread_cores
from tests.support.servers import PREMIUM_KEY, Server, wait_until

HELLO = [{"role": "user", "content": "Hello there!"}]


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The data payloads of an SSE response: dicts, and the final "[DONE]"."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_chat_completion_streams_token_by_token(server: Server) -> None:
    body = {
        "messages": HELLO,
        "max_tokens": 12,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict) and e["choices"]]
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    # Not a count of events: vLLM (and the engine link) merge the deltas a reader has not yet
    # taken, so on a loaded machine 12 tokens came in 2 events (CI, 2026-11-28). That each delta
    # goes out as its own event is test_each_event_is_its_chunk_rendered_whole's, without timing.
    assert all(c["choices"][0]["delta"].get("content") is not None for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Every response says which model and replica served it, in headers and body alike.
    assert {c["model"] for c in chunks} == {r.headers["x-model"]}
    assert {c["replica"] for c in chunks} == {r.headers["x-replica"]}
    assert r.headers["x-replica"].endswith("/" + r.headers["x-model"])


def test_official_openai_client_streams(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-checked")
    stream = client.chat.completions.create(
        model="auto",
        messages=HELLO,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces, usage, models = [], None, set()
    for chunk in stream:
        models.add(chunk.model)
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 10
    assert "".join(pieces)  # how many pieces is vLLM's timing (see the test above)
    assert models <= {"tiny-s", "tiny-m", "tiny-l"} and len(models) == 1


def test_openai_client_non_streaming_and_completions(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-checked")
    chat = client.chat.completions.create(
        model="tiny-m", messages=HELLO, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert chat.model == "tiny-m"
    assert chat.usage.completion_tokens == 6
    assert chat.choices[0].finish_reason == "length"
    assert isinstance(chat.choices[0].message.content, str)
    text = client.completions.create(
        model="tiny-s", prompt="The moon", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert text.model == "tiny-s"
    assert text.usage.completion_tokens == 4
    assert text.usage.prompt_tokens > 0


def test_models_health_and_metrics(server: Server) -> None:
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["auto", "tiny-s", "tiny-m", "tiny-l"]
    health = httpx.get(server.url + "/healthz").json()
    assert health == {
        "status": "ok",
        "replicas": {"cpu/tiny-s": True, "cpu/tiny-m": True, "cpu/tiny-l": True},
    }
    before = server.metric(
        "serving_requests_total", qos_class="free-tier", model="tiny-s", outcome="ok"
    )
    httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny-s", "prompt": "Hi", "max_tokens": 3},
    )
    assert (
        server.metric("serving_requests_total", qos_class="free-tier", model="tiny-s", outcome="ok")
        == before + 1
    )
    text = httpx.get(server.url + "/metrics").text
    for family in (
        "serving_ttft_seconds_bucket",
        "serving_tpot_seconds_bucket",
        "serving_replica_in_flight",
        "serving_engine_unfinished",
    ):
        assert family in text


def _in_flight_is_zero(server: Server) -> bool:
    return all(
        server.metric(name, replica=f"cpu/{m}", model=m) == 0
        for name in ("serving_replica_in_flight", "serving_engine_unfinished")
        for m in ("tiny-s", "tiny-m", "tiny-l")
    )


def test_engines_leave_the_last_core_to_the_front_end(server: Server) -> None:
    everything = frozenset(os.sched_getaffinity(0))
    if len(everything) < 2:
        pytest.skip("one core: nothing to leave free")
    engine_cores = everything - {max(everything)}
    processes = processes_under(server.process.pid)
    engine_core_pids = [pid for pid, name in processes.items() if name == ENGINE_CORE]
    assert len(engine_core_pids) == 3, processes
    for pid in engine_core_pids:  # vLLM itself pins only the worker, not its EngineCore
        assert thread_cores(pid) == {engine_cores}
    # Threads the front-end started while its engines started (ZMQ's) inherited the engines'
    # cores, and must have been given all of them back.
    assert thread_cores(server.process.pid) == {everything}


def test_client_disconnect_mid_stream_frees_the_engine_slot(server: Server) -> None:
    # Long enough (about 2,000 tokens on the biggest model) that only an abort ends it soon.
    body = {
        "model": "tiny-l",
        "messages": HELLO,
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        received = sum(
            1 for _, line in zip(range(6), lines, strict=False) if line.startswith("data: ")
        )
        assert received >= 2
        assert server.metric("serving_replica_in_flight", replica="cpu/tiny-l", model="tiny-l") == 1
        assert server.metric("serving_engine_unfinished", replica="cpu/tiny-l", model="tiny-l") == 1
    # Leaving the block closed the connection.
    wait_until(lambda: _in_flight_is_zero(server), 10, "the running counts to return to 0")


def test_client_disconnect_while_waiting_for_a_whole_response_aborts_it(server: Server) -> None:
    body = json.dumps(
        {"model": "tiny-l", "messages": HELLO, "max_tokens": 2000, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    # A client that gives up: it sends the request, then hangs up before the answer.
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body)
        wait_until(
            lambda: (
                server.metric("serving_engine_unfinished", replica="cpu/tiny-l", model="tiny-l")
                == 1
            ),
            10,
            "the request to reach the engine",
        )
    wait_until(lambda: _in_flight_is_zero(server), 10, "the running counts to return to 0")


def test_deadline_passes_before_the_first_token(twin_server: Server) -> None:
    # A deadline is the gateway's, whatever the engine: the embedded deployment's twin.
    server = twin_server
    labels = {"qos_class": "impatient", "model": "tiny-l", "outcome": "deadline"}
    before = server.metric("serving_requests_total", **labels)
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"x-qos-class": "impatient"},
        json={"model": "tiny-l", "messages": HELLO, "max_tokens": 50},
        timeout=30,
    )
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "deadline_exceeded"
    assert "deadline" in r.json()["error"]["message"]
    assert server.metric("serving_requests_total", **labels) == before + 1
    wait_until(lambda: _in_flight_is_zero(server), 10, "the aborted request to leave the engine")


def test_premium_key_grants_the_real_time_class(server: Server) -> None:
    body = {"messages": HELLO, "max_tokens": 2}
    url = server.url + "/v1/chat/completions"
    anonymous = httpx.post(url, json=body, headers={"x-qos-class": "real-time"}, timeout=30)
    assert anonymous.status_code == 403
    assert anonymous.json()["error"]["code"] == "qos_class_not_granted"
    urgent = httpx.post(url, json=body, headers={"priority": "u=0"}, timeout=30)
    assert urgent.headers["x-qos-class"] == "free-tier"  # the nearest class it may have
    premium = httpx.post(
        url, json=body, timeout=30, headers={"authorization": f"Bearer {PREMIUM_KEY}"}
    )
    assert premium.status_code == 200
    assert premium.headers["x-qos-class"] == "real-time"


LONG_PROMPT = "word " * 3000

BAD_INPUTS = {
    "malformed JSON": ("/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    "not an object": ("/v1/chat/completions", [], 400, "invalid_value"),
    "not UTF-8": ("/v1/chat/completions", b'{"messages": "\xff"}', 400, "invalid_json"),
    "nested too deep": (
        "/v1/chat/completions",
        b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        "invalid_json",
    ),  # fmt: skip
    "messages missing": ("/v1/chat/completions", {"max_tokens": 3}, 400, "invalid_value"),
    "empty messages": ("/v1/chat/completions", {"messages": []}, 400, "invalid_value"),
    "wrong type": (
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": "ten"},
        400,
        "invalid_value",
    ),
    "wrong role": (
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "invalid_value",
    ),
    "max_tokens zero": (
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 0},
        400,
        "invalid_value",
    ),
    "min_tokens negative": (
        "/v1/chat/completions",
        {"messages": HELLO, "min_tokens": -1},
        400,
        "invalid_value",
    ),
    "max_tokens negative": (
        "/v1/completions",
        {"prompt": "x", "max_tokens": -5},
        400,
        "invalid_value",
    ),
    "max_tokens absurd": (
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 10**12},
        400,
        "invalid_value",
    ),
    "max_tokens past the context": (
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 4000},
        400,
        "context_length_exceeded",
    ),
    "prompt past the context": (
        "/v1/completions",
        {"prompt": LONG_PROMPT, "max_tokens": 4},
        400,
        "context_length_exceeded",
    ),
    "unknown model": (
        "/v1/chat/completions",
        {"model": "gpt-9", "messages": HELLO},
        404,
        "model_not_found",
    ),
    "an image part": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "invalid_value",
    ),
    "n above 1": ("/v1/chat/completions", {"messages": HELLO, "n": 2}, 400, "invalid_value"),
    "lone surrogate": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "invalid_value",
    ),
    "empty stop string": (
        "/v1/chat/completions",
        {"messages": HELLO, "stop": [""]},
        400,
        "invalid_value",
    ),
    "unknown task": (
        "/v1/chat/completions",
        {"messages": HELLO, "task": "chess"},
        400,
        "invalid_request_error",
    ),
    "a batch streamed": (
        "/v1/completions",
        {"prompt": ["a", "b"], "stream": True},
        400,
        "invalid_value",
    ),
    "top_logprobs without logprobs": (
        "/v1/chat/completions",
        {"messages": HELLO, "top_logprobs": 2},
        400,
        "invalid_value",
    ),
    "logprobs above vLLM's 20": (
        "/v1/completions",
        {"prompt": "x", "logprobs": 21},
        400,
        "invalid_value",
    ),
    "token id out of the vocabulary": (
        "/v1/completions",
        {"model": "tiny-s", "prompt": [[2, 10**9]], "max_tokens": 1},
        400,
        "invalid_request_error",
    ),
    "token id negative": ("/v1/completions", {"prompt": [5, -1]}, 400, "invalid_value"),
    "token id not an integer": ("/v1/completions", {"prompt": [[5, True]]}, 400, "invalid_value"),
    "empty batch": ("/v1/completions", {"prompt": []}, 400, "invalid_value"),
    "suffix": ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "invalid_value"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_gets_a_clear_4xx(server: Server, case: str) -> None:
    path, body, status, code = BAD_INPUTS[case]
    if isinstance(body, bytes):
        r = httpx.post(
            server.url + path,
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
    else:
        r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert error["message"] and "Traceback" not in error["message"]


def test_refused_requests_are_counted_without_client_chosen_labels(server: Server) -> None:
    def count(qos_class: str, outcome: str) -> float:
        return server.metric(
            "serving_requests_total", qos_class=qos_class, model="none", outcome=outcome
        )

    url = server.url + "/v1/chat/completions"
    before = {k: count(*k) for k in [("free-tier", "invalid"), ("none", "refused")]}
    # Every request is classified as it arrives, so a bad body counts under its class too.
    httpx.post(url, json={"model": "made-up", "messages": HELLO})  # 404
    httpx.post(url, json={"messages": []})  # 400
    httpx.post(url, content=b'{"messages": "\xff"}', headers={"content-type": "application/json"})
    httpx.post(url, json={"messages": HELLO}, headers={"x-qos-class": "real-time"})  # 403: no class
    assert count("free-tier", "invalid") == before[("free-tier", "invalid")] + 3
    assert count("none", "refused") == before[("none", "refused")] + 1
    assert "made-up" not in httpx.get(server.url + "/metrics").text


def test_oversized_body_is_refused_with_413(server: Server) -> None:
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}).encode()
    url = server.url + "/v1/chat/completions"
    declared = httpx.post(
        url, content=huge, headers={"content-type": "application/json"}, timeout=30
    )
    assert declared.status_code == 413
    assert declared.json()["error"]["code"] == "body_too_large"

    def chunks():  # chunked transfer: the size is never declared up front
        for i in range(0, len(huge), 2**16):
            yield huge[i : i + 2**16]

    chunked = httpx.post(
        url, content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    assert chunked.status_code == 413
    # And the server keeps serving.
    ok = httpx.post(url, json={"messages": HELLO, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


class _Replayed:
    """A finished generation's deltas, for `Shape` alone (the live tests stream real ones)."""

    def __init__(self, request_id: str, texts: list[str]) -> None:
        self.request = SimpleNamespace(request_id=request_id)
        self.model, self.replica = "tiny-s", SimpleNamespace(name="cpu/tiny-s")
        self.prompt_tokens, self.completion_tokens = 3, len(texts)
        self._deltas = [TokenDelta(t, 1, 3) for t in texts[:-1]] + [
            TokenDelta(texts[-1], 1, 3, "stop")
        ]

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        while self._deltas:
            yield self._deltas.pop(0)

    async def relay(self, write: Callable[[TokenDelta], Awaitable[None]]) -> None:
        """As `Generation.relay`: the deltas up to the last go to `write`."""
        while self._deltas[0].finish_reason is None:
            await write(self._deltas.pop(0))


async def _events(shape: Shape, relay: bool) -> list[str]:
    """The events `shape` sends, those the engine's task writes (`Relay`) included."""
    events: list[str] = []

    def writer(render: Callable[[str], str]) -> Callable[[TokenDelta], Awaitable[None]]:
        async def write(delta: TokenDelta) -> None:
            events.append(render(delta.text))

        return write

    events_of = shape.sse(False, relay=True) if relay else shape.sse(False)
    async for e in events_of:
        if isinstance(e, Relay):
            await shape.generation.relay(writer(e.render))
        else:
            events.append(e)
    return events


@pytest.mark.parametrize("relay", [False, True], ids=["iterated", "relayed"])
@pytest.mark.parametrize("chat", [True, False])
async def test_each_event_is_its_chunk_rendered_whole(chat: bool, relay: bool) -> None:
    # Events between the first and the last are rendered from a template; they must be the bytes
    # that rendering the whole chunk gives, whatever the text and the (client-chosen) id hold,
    # and whether the response's task sends them or the engine's (`Generation.relay`).
    texts = ["Hi", ' "quoted"', "\\back\\slash", "\x00\n\t", "é ☃ 𝄞", "", "end"]
    for request_id in ["chatcmpl-1", 'a"\\u0000"b', "\x00"]:
        generation = _Replayed(request_id, texts)
        shape = Shape(generation, chat)  # type: ignore[arg-type]
        events = await _events(shape, relay)
        whole = [
            event(shape.chunk(t, "stop" if i == len(texts) - 1 else None, i == 0))
            for i, t in enumerate(texts)
        ]
        assert events == [*whole, "data: [DONE]\n\n"]
