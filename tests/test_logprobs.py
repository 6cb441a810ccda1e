"""Log-probabilities, echo, token-id prompts and batches of prompts, as lm-eval's
`local-completions` and OpenAI's clients ask for them, on the real embedded deployment."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from serving.engines.base import TokenLogprob
from serving.logprobs import FLOOR, chat_logprobs, completion_logprobs
from tests.support.servers import ROOT, Server
from tests.test_api import sse_events

GREEDY = {"model": "tiny-m", "temperature": 0.0, "seed": 0}


def complete(server: Server, **body: object) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={**GREEDY, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echoed_prompt_logprobs_are_the_logprobs_the_model_generated_with(server: Server) -> None:
    """What lm-eval's loglikelihood reads (echo, logprobs, one token) is the model's own: a token
    generated after a prompt has, echoed as part of a longer prompt, the logprob it had."""
    prompt = [2, 120, 340, 56, 78]
    generated = complete(server, prompt=prompt, max_tokens=3, logprobs=2)["choices"][0]
    lp = generated["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    for token, logprob, top in zip(
        *(lp[k] for k in ("tokens", "token_logprobs", "top_logprobs")), strict=True
    ):
        # Greedy: each token is its position's most likely, and its top list holds it.
        assert top[token] == logprob == max(top.values())
        assert 2 <= len(top) <= 3  # its own entry and the top 2, which include it
    assert "".join(lp["tokens"]) == generated["text"]

    tokens = httpx.post(
        server.url + "/v1/completions",
        json={**GREEDY, "prompt": prompt, "max_tokens": 3, "logprobs": 0, "echo": True},
        timeout=60,
    ).json()["choices"][0]
    echoed = tokens["logprobs"]
    assert echoed["token_logprobs"][0] is None and echoed["top_logprobs"][0] is None
    assert len(echoed["tokens"]) == len(prompt) + 3
    assert echoed["token_logprobs"][len(prompt) :] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert tokens["text"].endswith(generated["text"])

    # The generated ids, fed back as prompt, score as they were generated, one batch, two orders.
    ids = _ids(server, prompt, 3)
    body = {"prompt": [prompt + ids, prompt], "max_tokens": 1, "logprobs": 1, "echo": True}
    batch = complete(server, **body)
    first, second = sorted(batch["choices"], key=lambda c: c["index"])
    assert first["logprobs"]["token_logprobs"][len(prompt) : len(prompt) + 3] == pytest.approx(
        lp["token_logprobs"], abs=1e-4
    )
    assert second["logprobs"]["token_logprobs"][len(prompt)] == pytest.approx(
        lp["token_logprobs"][0], abs=1e-4
    )
    assert batch["usage"]["prompt_tokens"] == 2 * len(prompt) + 3


def _ids(server: Server, prompt: list[int], n: int) -> list[int]:
    """The ids of the `n` tokens tiny-m generates greedily after `prompt`: its text, tokenised
    (a byte-level tokenizer gives the same ids back for this text, checked by the count)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / ".models/tiny-m")
    text = complete(server, prompt=prompt, max_tokens=n)["choices"][0]["text"]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == n, (text, ids)
    return ids


def test_a_batch_answers_each_prompt_as_alone_in_order(server: Server) -> None:
    prompts = ["The sky is", "One, two,", "A long time ago"]
    batch = complete(server, prompt=prompts, max_tokens=4)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    alone = [complete(server, prompt=p, max_tokens=4)["choices"][0]["text"] for p in prompts]
    assert [c["text"] for c in batch["choices"]] == alone
    assert batch["usage"]["completion_tokens"] == 12
    assert batch["id"].startswith("cmpl-") and batch["model"] == "tiny-m"


def test_openai_client_reads_chat_logprobs_streamed_and_whole(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    ask = dict(model="tiny-s", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    whole = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, temperature=0)
    content = whole.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob == token.logprob  # greedy
        assert bytes(token.bytes).decode() == token.token
    stream = client.chat.completions.create(
        **ask, logprobs=True, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    streamed = [
        (chunk.choices[0].delta.content, chunk.choices[0].logprobs.content)
        for chunk in stream
        if chunk.choices
    ]
    assert "".join(text or "" for text, _ in streamed) == whole.choices[0].message.content
    for text, tokens in streamed:
        assert "".join(t.token for t in tokens) == text  # each chunk carries its own tokens
        assert all(t.top_logprobs == [] for t in tokens)
    logprobs = [t.logprob for _, tokens in streamed for t in tokens]
    assert logprobs == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_a_streamed_echo_starts_with_the_prompt(server: Server) -> None:
    body = {**GREEDY, "prompt": "Once upon", "max_tokens": 3, "echo": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r)
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["choices"][0]["text"].startswith("Once upon")
    whole = complete(server, prompt="Once upon", max_tokens=3, echo=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_a_simulated_replica_refuses_logprobs_and_says_why(twin_server: Server) -> None:
    r = httpx.post(
        twin_server.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1, "logprobs": 1},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "logprobs" and "simulated" in error["message"]


def test_logprob_shapes_follow_vllms_server() -> None:
    entries = [
        TokenLogprob("A", None),
        TokenLogprob(" b", -0.5, ((" b", -0.5), ("c", -1.0))),
        TokenLogprob("d", -math.inf, (("e", -0.1),)),
    ]
    legacy = completion_logprobs(entries, offset=3)
    assert legacy == {
        "text_offset": [3, 4, 6],
        "token_logprobs": [None, -0.5, FLOOR],
        "tokens": ["A", " b", "d"],
        "top_logprobs": [None, {" b": -0.5, "c": -1.0}, {"d": FLOOR, "e": -0.1}],
    }
    json.dumps(legacy, allow_nan=False)  # -inf would not be JSON
    chat = chat_logprobs(entries[1:])["content"]
    assert chat[0] == {
        "token": " b",
        "logprob": -0.5,
        "bytes": [32, 98],
        "top_logprobs": [
            {"token": " b", "logprob": -0.5, "bytes": [32, 98]},
            {"token": "c", "logprob": -1.0, "bytes": [99]},
        ],
    }
    assert chat[1]["logprob"] == FLOOR
