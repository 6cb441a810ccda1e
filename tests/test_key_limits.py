"""Per-key limits: the limiter's arithmetic on a virtual clock, then the live server's 429s (on
the embedded deployment's twin: limits are the front door's, whatever the engine)."""

from __future__ import annotations

import math

import httpx
import pytest

from config import Limits
from serving.key_limits import CONCURRENT, RATE, KeyLimiter, OverLimit
from tests.support.servers import METERED_KEY, PREMIUM_KEY, SINGLE_KEY, Server, wait_until

HELLO = [{"role": "user", "content": "Hello there!"}]


def limiter(**limits: float) -> KeyLimiter:
    return KeyLimiter(lambda key: Limits(**limits) if key == "k" else Limits())


def test_a_rate_allows_its_burst_then_refills_at_its_rate() -> None:
    keys = limiter(requests_per_s=2, burst=3)
    for _ in range(3):
        keys.acquire("k", now=0.0)
    with pytest.raises(OverLimit) as over:
        keys.acquire("k", now=0.1)
    assert over.value.limit == RATE
    assert over.value.retry_after_s == 1  # 0.3 s to the next token, in whole seconds
    keys.acquire("k", now=0.5)  # one token back after 0.5 s
    with pytest.raises(OverLimit):
        keys.acquire("k", now=0.6)
    keys.acquire("other", now=0.6)  # another key has its own (here: no) limits


def test_the_burst_defaults_to_a_seconds_worth_and_a_long_wait_is_said() -> None:
    keys = limiter(requests_per_s=0.01)
    keys.acquire("k", now=0.0)
    with pytest.raises(OverLimit) as over:
        keys.acquire("k", now=1.0)
    assert over.value.retry_after_s == 99


def test_concurrency_counts_requests_until_released() -> None:
    keys = limiter(concurrent=2)
    keys.acquire("k", now=0.0)
    keys.acquire("k", now=0.0)
    with pytest.raises(OverLimit) as over:
        keys.acquire("k", now=0.0)
    assert over.value.limit == CONCURRENT
    keys.release("k")
    keys.acquire("k", now=0.0)
    keys.release("never-seen")  # harmless


def admitted(keys: KeyLimiter, times: list[float]) -> int:
    """How many of a stream of requests of key k, arriving at `times`, are let in."""
    count = 0
    for now in times:
        try:
            keys.acquire("k", now)
        except OverLimit:
            continue
        count += 1
    return count


@pytest.mark.parametrize("hosts", [2, 3, 5])
@pytest.mark.parametrize(
    "limits", [{"requests_per_s": 2.0, "burst": 3}, {"requests_per_s": 0.5}, {"concurrent": 4}]
)
def test_hosts_sharing_a_key_admit_no_more_than_the_stated_bound(
    hosts: int, limits: dict[str, float]
) -> None:
    """Each of `hosts` front-end hosts admits its share: a storm of the key's requests on every
    host at once, for 10 s, lets in at most burst + hosts - 1 + rate x 10 requests over all
    (concurrent + hosts - 1 in flight), and every host lets some in."""
    fleet = [limiter(**limits) for _ in range(hosts)]
    for keys in fleet:
        keys.set_hosts(hosts)
    storm = [i / 100 for i in range(1000)]  # 100 requests a second at each host, none ending
    each = [admitted(keys, storm) for keys in fleet]
    assert min(each) >= 1
    whole = Limits(**limits)  # type: ignore[arg-type]
    if whole.concurrent is not None:
        assert sum(each) <= whole.concurrent + hosts - 1
    else:
        assert whole.requests_per_s is not None
        burst = whole.burst or max(1, math.ceil(whole.requests_per_s))
        assert sum(each) <= burst + hosts - 1 + whole.requests_per_s * 10
    # One host alone would let in the whole key's worth: what the share is for.
    alone = admitted(limiter(**limits), storm)
    assert sum(each) < alone * hosts


def _chat(server: Server, key: str | None, **extra: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny-s", "messages": HELLO, "max_tokens": 2, **extra}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_a_key_over_its_rate_gets_429_and_other_keys_do_not(twin_server: Server) -> None:
    server = twin_server
    limited = {"tier": "anonymous", "limit": "rate"}
    before = server.metric("serving_limited_total", **limited)
    assert [_chat(server, METERED_KEY).status_code for _ in range(2)] == [200, 200]
    refused = _chat(server, METERED_KEY)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert server.metric("serving_limited_total", **limited) == before + 1
    assert _chat(server, PREMIUM_KEY).status_code == 200
    assert _chat(server, None).status_code == 200  # the anonymous bucket is another one


def test_a_key_at_its_concurrency_limit_gets_429_until_its_request_ends(
    twin_server: Server,
) -> None:
    server = twin_server
    # Long enough to be still running when asked: 2,000 tokens at tiny-l's 25 ms a step.
    body = {"model": "tiny-l", "messages": HELLO, "max_tokens": 2000, "ignore_eos": True}
    headers = {"authorization": f"Bearer {SINGLE_KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", timeout=60, headers=headers,
        json={**body, "stream": True},
    ) as stream:  # fmt: skip
        lines = stream.iter_lines()  # held: a dropped iterator closes the response
        assert next(lines).startswith("data: ")
        refused = _chat(server, SINGLE_KEY)
        assert refused.status_code == 429, refused.text
        assert "in flight" in refused.json()["error"]["message"]
        assert _chat(server, None).status_code == 200
    # Hanging up ended the first request, which frees the key's slot.
    wait_until(lambda: _chat(server, SINGLE_KEY).status_code == 200, 10, "the slot to free")
