"""Clocks that start at arrival, on real servers: the per-request log against the metrics, the
arrival an edge forwards (and a forged one ignored), and the load generator against a server
whose delays are known."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.support.servers import CERT, EDGE_KEY, PYTHON, ROOT, Server, wait_until
from tests.test_api import HELLO, _in_flight_is_zero
from transport.client import Http3Client
from workloads.chat import chat_body, chat_h3

LOG_FIELDS = {
    "request_id", "qos_class", "tier", "via_edge", "protocol", "model", "replica", "arrival",
    "queue_s", "route_s", "engine_ttft_s", "ttft_s", "e2e_s", "prompt_tokens", "cached_tokens",
    "tokens",
    "outcome", "slo_met", "client_rtt_s", "client_loss", "retries", "worker",
}  # fmt: skip


def counted_outcomes(server: Server) -> Counter:
    """serving_requests_total, as {(qos_class, model, outcome): count}."""
    counts: Counter = Counter()
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("serving_requests_total{"):
            series, _, value = line.rpartition(" ")
            labels = dict(
                part.split("=", 1) for part in series.split("{", 1)[1].rstrip("}").split(",")
            )
            key = tuple(labels[k].strip('"') for k in ("qos_class", "model", "outcome"))
            counts[key] += int(float(value))
    return counts


async def test_every_request_is_logged_once_and_the_log_matches_the_metrics(
    server: Server,
) -> None:
    url = server.url + "/v1/chat/completions"
    ok = httpx.post(url, json={"model": "tiny-s", "messages": HELLO, "max_tokens": 3}, timeout=60)
    httpx.post(url, json={"messages": []}, timeout=30)  # 400
    httpx.post(url, json={"messages": HELLO}, headers={"x-qos-class": "real-time"}, timeout=30)
    late = httpx.post(url, json={"messages": HELLO}, headers={"x-qos-class": "impatient"})
    assert (ok.status_code, late.status_code) == (200, 504)
    assert server.h3_port is not None
    async with Http3Client("localhost", server.h3_port, verify=str(CERT)) as client:
        over_h3 = await chat_h3(client, chat_body(HELLO, "tiny-m", 4, ignore_eos=True))
    assert over_h3.error is None and over_h3.request_id
    wait_until(lambda: _in_flight_is_zero(server), 10, "the running counts to return to 0")

    lines = server.requests_logged()
    for line in lines:
        assert set(line) == LOG_FIELDS, line
    assert len({line["request_id"] for line in lines}) == len(lines)
    from_log = Counter(
        (line["qos_class"] or "none", line["model"] or "none", line["outcome"]) for line in lines
    )
    assert from_log == counted_outcomes(server)

    served = server.logged(ok.headers["x-request-id"])
    assert ok.json()["id"] == f"chatcmpl-{served['request_id']}"
    assert (served["protocol"], served["model"], served["outcome"]) == ("1.1", "tiny-s", "ok")
    assert served["tokens"] == 3 and served["tier"] == "anonymous" and not served["via_edge"]
    # TTFT runs from arrival, through the wait for the handler, routing and the engine.
    parts = served["queue_s"] + served["route_s"] + served["engine_ttft_s"]
    assert served["ttft_s"] == pytest.approx(parts, abs=2e-6)
    assert 0 <= served["queue_s"] <= served["ttft_s"] <= served["e2e_s"]
    assert server.logged(late.headers["x-request-id"])["outcome"] == "deadline"
    assert server.logged(over_h3.request_id)["protocol"] == "3"


def test_a_forged_edge_header_is_ignored_and_the_real_key_is_trusted(server: Server) -> None:
    url = server.url + "/v1/chat/completions"
    body = {"model": "tiny-s", "messages": HELLO, "max_tokens": 2}
    edge = {"x-edge-age": "30", "x-edge-qos-class": "long", "x-edge-tier": "premium"}
    forged = httpx.post(url, json=body, headers={**edge, "x-edge-key": "guess"}, timeout=60)
    assert forged.status_code == 200 and forged.headers["x-qos-class"] == "free-tier"
    line = server.logged(forged.headers["x-request-id"])
    assert not line["via_edge"] and line["queue_s"] < 30 and line["qos_class"] == "free-tier"

    trusted = httpx.post(url, json=body, headers={**edge, "x-edge-key": EDGE_KEY}, timeout=60)
    assert trusted.status_code == 200 and trusted.headers["x-qos-class"] == "long"
    line = server.logged(trusted.headers["x-request-id"])
    assert line["via_edge"] and line["tier"] == "premium"
    assert 30 <= line["queue_s"] < 60


def test_the_edge_forwards_the_clients_arrival(frontend: Server, server: Server) -> None:
    body = json.dumps({"model": "tiny-s", "messages": HELLO, "max_tokens": 2}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-edge-age: 300\r\nx-edge-key: guess\r\n"
        "x-edge-path: rtt=2.5; loss=0.3\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", frontend.port), timeout=60) as sock:
        sock.sendall(head.encode())
        time.sleep(1.0)  # the edge has the request's head now; its body follows a second later
        sock.sendall(body)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    status, *header_lines = response.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
    assert " 200 " in status, response
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    line = server.logged(headers["x-request-id"])
    # The back-end's clock started when the edge began to read the request, not when the
    # back-end got it; and not 300 s earlier, as the client's own x-edge-* headers claimed.
    assert line["via_edge"] and line["protocol"] == "3"
    assert 1.0 <= line["queue_s"] < 30
    # The client's path is the edge's measurement of it (loopback, TCP_INFO), not the one the
    # client claimed in the edge's header, which the edge drops.
    assert line["client_rtt_s"] < 0.05 and line["client_loss"] == 0.0


def replay(out: Path, *args: str) -> dict:
    subprocess.run(
        [PYTHON, "-m", "workloads.replay", "--model", "null", "--out", str(out), "--no-progress",
         "--tasks", "copa", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return json.loads(out.read_text())


@pytest.mark.parametrize("proto", ["h1", "h3"])
def test_the_replay_measures_a_known_delay(null_server: Server, proto: str, tmp_path: Path) -> None:
    url = null_server.url if proto == "h1" else f"https://localhost:{null_server.h3_port}"
    record = replay(
        tmp_path / "run.json", "--proto", proto, "--url", url, "--cacert", str(CERT),
        "--rate", "10", "--num-requests", "20", "--output-tokens", "8:8",
    )  # fmt: skip
    summary = record["summary"]
    assert summary["completed"] == 20, summary["errors"]
    # Physics bounds below (the last token is due 70 ms after the first is); the slack above
    # is for a busy two-core machine. A late first token lets the rest catch up, so the gap
    # between tokens has no hard floor.
    assert 300 <= summary["median_ttft_ms"] < 400
    assert 300 + 7 * 10 <= summary["median_e2el_ms"] < 500
    assert 5 <= summary["median_tpot_ms"] < 30
    assert record["client"]["kept_up"], record["client"]["warnings"]
    assert all(r["server_request_id"] for r in record["requests"])


def test_streams_past_the_servers_limit_wait_for_credit_unless_spread(
    null_server: Server, tmp_path: Path
) -> None:
    # 200 requests at once, each open for 0.3 s: more than one connection's 128 streams.
    burst = ["--proto", "h3", "--url", f"https://localhost:{null_server.h3_port}",
             "--cacert", str(CERT), "--rate", "2000", "--num-requests", "200",
             "--output-tokens", "1:1"]  # fmt: skip
    one = replay(tmp_path / "one.json", *burst, "--connections", "1")
    assert one["summary"]["completed"] == 200
    assert one["client"]["credit_waited"] >= 200 - 128
    # A request past the 128th waits for a stream opened 128 arrivals before it (about 64 ms at
    # 2,000 req/s, more or less as Poisson arrivals fall) to end its 300 ms: about 236 ms.
    assert one["client"]["p99_credit_wait_ms"] >= 150
    assert any("stream credit" in warning for warning in one["client"]["warnings"])
    # TTFT starts when a request really went out, so the wait is not in it: those that waited
    # read as those that did not, not a wait later (against each other, in the same run, so
    # that a busy machine's slower server moves both alike).
    waited = [r for r in one["requests"] if r["credit_wait_s"] > 0.1]
    went = [r for r in one["requests"] if r["credit_wait_s"] == 0]
    wait = statistics.median(r["credit_wait_s"] for r in waited)
    later = statistics.median(r["ttft_s"] for r in waited) - statistics.median(
        r["ttft_s"] for r in went
    )
    assert later < wait / 2, (later, wait)
    assert one["summary"]["median_ttft_ms"] >= 300

    spread = replay(tmp_path / "spread.json", *burst, "--connections", "2")
    assert spread["summary"]["completed"] == 200
    assert spread["client"]["credit_waited"] == 0


async def test_a_request_cancelled_while_it_waits_for_credit_leaves_the_connection_whole(
    null_server: Server,
) -> None:
    assert null_server.h3_port is not None
    body = json.dumps(chat_body(HELLO, "null", 1)).encode()
    headers = {"content-type": "application/json"}
    async with Http3Client("localhost", null_server.h3_port, verify=str(CERT)) as client:
        limit = client.stream_credit
        requests = [
            asyncio.create_task(client.request("POST", "/v1/chat/completions", headers, body))
            for _ in range(limit + 2)
        ]
        while client.stream_credit > -2:  # every request is out or waiting for credit
            await asyncio.sleep(0.01)
        for waiting in requests[-2:]:
            waiting.cancel()
        answered = await asyncio.gather(*requests[:-2])
        assert [r.status for r in answered] == [200] * limit
        for response in answered:
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
        # The server never saw a frame for a stream past its limit, so the connection lives.
        assert client.is_open
        assert (await client.request("GET", "/v1/models")).status == 200
