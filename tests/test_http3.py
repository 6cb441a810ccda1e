"""The serving app over HTTP/3 (transport.http3), end to end against real vLLM CPU engines: the
aioquic client, an independent HTTP/3 client (curl, through curl_cffi), the edge front-end, and
bad input at the UDP port."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from aioquic.h3.connection import ErrorCode

from netsim.link import LinkConfig
from netsim.relay import LossyRelay
from tests.support.servers import CERT, PREMIUM_KEY, Server, wait_until
from tests.test_api import HELLO, _in_flight_is_zero
from transport.client import Http3Client, StreamError
from workloads.chat import chat_body, chat_h3

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def h3_client(server: Server, **kwargs: object) -> Http3Client:
    assert server.h3_port is not None
    return Http3Client("localhost", server.h3_port, verify=str(CERT), **kwargs)


async def test_chat_streams_over_http3_as_over_http1(server: Server) -> None:
    async with h3_client(server) as client:
        result = await chat_h3(client, chat_body(HELLO, "tiny-m", 12, **GREEDY))
    assert result.error is None and result.status == 200
    assert result.model == "tiny-m" and result.replica == "cpu/tiny-m"
    # Streamed, not one body. Not one chunk per token: vLLM merges the deltas of steps its
    # consumer has not yet taken (CI, loaded, once carried 12 tokens in 5 chunks).
    assert result.ttft_s is not None and len(result.itl_s) >= 2
    assert result.usage is not None and result.usage["completion_tokens"] == 12
    http1 = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "tiny-m", "messages": HELLO, "max_tokens": 12, **GREEDY},
        timeout=60,
    )
    assert http1.json()["choices"][0]["message"]["content"] == result.text


def test_http1_answers_advertise_http3(server: Server) -> None:
    response = httpx.get(server.url + "/healthz")
    assert response.headers["alt-svc"] == f'h3=":{server.h3_port}"; ma=86400'


def test_an_independent_http3_client_gets_a_completion(server: Server) -> None:
    # curl_cffi is libcurl with ngtcp2/nghttp3: no aioquic on the client side.
    from curl_cffi import CurlHttpVersion, requests

    response = requests.post(
        f"https://localhost:{server.h3_port}/v1/chat/completions",
        json={"model": "tiny-s", "messages": HELLO, "max_tokens": 5},
        http_version=CurlHttpVersion.V3ONLY,
        verify=str(CERT),
        timeout=60,
    )
    assert response.http_version == 30  # CURL_HTTP_VERSION_3
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 5
    assert response.headers["x-model"] == "tiny-s"


async def test_qos_over_http3_needs_a_key_for_real_time(server: Server) -> None:
    async with h3_client(server) as client:
        refused = await chat_h3(client, chat_body(HELLO, "auto", 2), {"x-qos-class": "real-time"})
        granted = await chat_h3(
            client,
            chat_body(HELLO, "auto", 2),
            {"x-qos-class": "real-time", "authorization": f"Bearer {PREMIUM_KEY}"},
        )
    assert refused.status == 403 and "real-time" in (refused.error or "")
    assert granted.status == 200 and granted.error is None


@pytest.mark.parametrize("leaving", ["reset", "stop-sending"])
async def test_a_client_leaving_aborts_the_engine_request(server: Server, leaving: str) -> None:
    async with h3_client(server) as client:
        body = {"model": "tiny-l", "messages": HELLO, "max_tokens": 2000, "stream": True}
        response = await client.request(
            "POST", "/v1/chat/completions", {"content-type": "application/json"},
            json.dumps({**body, **GREEDY}).encode(),
        )  # fmt: skip
        chunks = response.iter_bytes()
        for _ in range(3):
            await anext(chunks)
        if leaving == "reset":
            response.close()  # RESET_STREAM + STOP_SENDING: the client has gone
        else:  # STOP_SENDING alone: the client wants no more of the response
            client.protocol.quic.stop_stream(response.stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            client.protocol.transmit_soon()
        await asyncio.to_thread(
            wait_until, lambda: _in_flight_is_zero(server), 10, "the engine request to abort"
        )
    # Aborted, not run to its end: the engine stopped generating when the client left.
    line = server.logged(response.headers["x-request-id"])
    assert line["outcome"] == "cancelled" and 3 <= line["tokens"] < 2000
    # An ordinary way for a client to leave, not a failure of the app.
    assert "ASGI app failed" not in server.log.read_text(errors="replace")


async def test_an_answer_whose_last_packet_was_sent_again_still_counts_as_delivered(
    server: Server,
) -> None:
    """The path back to the client slows from 1 ms to 300 ms (a route change, a loaded tunnel)
    while the answer is on its way. The server's probe timeout, sized to the fast path, fires
    first and aioquic sends the answer's packet again, declaring the original lost; the
    client gets the original, acknowledges it and closes before the copy comes. The answer
    reached its client, so it counts as ok, not as cancelled: aioquic alone ignores that late
    ACK (a CI run of the MASQUE edge test caught it)."""
    assert server.h3_port is not None
    relay = LossyRelay(("127.0.0.1", server.h3_port), LinkConfig(rate_bps=1e9, delay_s=0.0005))
    port = await relay.start()
    try:
        async with Http3Client("127.0.0.1", port, verify=False) as client:
            await (await client.request("GET", "/healthz")).read()  # the fast path's RTT
            relay.down.config = relay.down.config.replace(delay_s=0.3)
            chat = {"model": "tiny-s", "messages": HELLO, "max_tokens": 4, **GREEDY}
            response = await client.request(
                "POST", "/v1/chat/completions", {"content-type": "application/json"},
                json.dumps(chat).encode(),
            )  # fmt: skip
            body = json.loads(await response.read())
        assert response.status == 200 and body["usage"]["completion_tokens"] == 4
    finally:
        relay.close()
    assert server.logged(response.headers["x-request-id"])["outcome"] == "ok"


async def test_oversized_body_gets_413(server: Server) -> None:
    async with h3_client(server) as client:
        response = await client.request(
            "POST",
            "/v1/chat/completions",
            {"content-type": "application/json"},
            b"{" + b" " * (5 * 2**20) + b"}",
        )
        assert response.status == 413
        assert "larger than" in json.loads(await response.read())["error"]["message"]
        ok = await client.request("GET", "/healthz")  # the connection is still good
        assert ok.status == 200


async def test_a_body_longer_than_it_declared_still_gets_413(server: Server) -> None:
    # The HTTP/3 server passes on every DATA frame whatever content-length said, so the limit
    # must count what arrives, not trust the header.
    async with h3_client(server) as client:
        response = await client.request(
            "POST",
            "/v1/chat/completions",
            {"content-type": "application/json", "content-length": "2"},
            b"{" + b" " * (5 * 2**20) + b"}",
        )
        assert response.status == 413


async def test_malformed_json_over_http3_gets_400(server: Server) -> None:
    async with h3_client(server) as client:
        response = await client.request(
            "POST", "/v1/chat/completions", {"content-type": "application/json"}, b"{nope"
        )
        assert response.status == 400
        assert json.loads(await response.read())["error"]["type"] == "invalid_request_error"


async def test_malformed_request_headers_close_only_that_connection(server: Server) -> None:
    async with h3_client(server) as bad:
        protocol = bad.protocol
        stream_id = protocol.quic.get_next_available_stream_id()
        # No :path and an upper-case name: RFC 9114 4.1.2 makes the request malformed.
        protocol.h3.send_headers(
            stream_id, [(b":method", b"GET"), (b":scheme", b"https"), (b"X-Bad", b"1")], True
        )
        protocol.transmit()
        await asyncio.wait_for(_closed(bad), 10)
        assert bad.closed is not None and bad.closed.error_code == ErrorCode.H3_MESSAGE_ERROR
    async with h3_client(server) as good:
        assert (await good.request("GET", "/healthz")).status == 200


async def _closed(client: Http3Client) -> None:
    while client.is_open:
        await asyncio.sleep(0.01)


async def test_random_udp_datagrams_are_ignored(server: Server) -> None:
    import random

    rng = random.Random(0)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for size in (0, 1, 7, 21, 1200, 1500, 65000):
            sock.sendto(rng.randbytes(size), ("127.0.0.1", server.h3_port))
        # A long-header-looking datagram with a made-up version and garbage after it.
        sock.sendto(b"\xc0\x1a\x2b\x3c\x4d" + rng.randbytes(1200), ("127.0.0.1", server.h3_port))
    async with h3_client(server) as client:
        assert (await client.request("GET", "/healthz")).status == 200


async def test_thousands_of_streams_are_held_to_the_stream_limit(server: Server) -> None:
    async with h3_client(server) as client:
        # aioquic's client waits for MAX_STREAMS credit, so 2,000 requests go 128 at a time.
        responses = await asyncio.gather(
            *[client.request("GET", "/v1/models") for _ in range(2000)]
        )
        assert {r.status for r in responses} == {200}
        await asyncio.gather(*[r.read() for r in responses])
    async with h3_client(server) as rogue:
        # A client that ignores the limit is cut off with STREAM_LIMIT_ERROR, and only it.
        rogue.protocol.quic._remote_max_streams_bidi = 10**6
        with pytest.raises(StreamError):
            await asyncio.gather(*[rogue.request("GET", "/healthz") for _ in range(1000)])
    async with h3_client(server) as client:
        assert (await client.request("GET", "/healthz")).status == 200


async def test_the_edge_frontend_forwards_http3_and_http1(frontend: Server) -> None:
    async with h3_client(frontend) as client:
        result = await chat_h3(client, chat_body(HELLO, "tiny-s", 8, **GREEDY))
    assert result.error is None and result.model == "tiny-s" and len(result.itl_s) >= 3
    http1 = httpx.post(
        frontend.url + "/v1/chat/completions",
        json={"model": "tiny-s", "messages": HELLO, "max_tokens": 8, **GREEDY},
        timeout=60,
    )
    assert http1.status_code == 200
    assert http1.headers["x-replica"] == "cpu/tiny-s"
    assert http1.json()["choices"][0]["message"]["content"] == result.text


async def test_the_edge_frontend_passes_errors_and_disconnects(
    frontend: Server, server: Server
) -> None:
    refused = httpx.post(
        frontend.url + "/v1/chat/completions",
        headers={"x-qos-class": "real-time"},
        json={"model": "tiny-s", "messages": HELLO},
    )
    assert refused.status_code == 403
    body = {"model": "tiny-l", "messages": HELLO, "max_tokens": 2000, "stream": True, **GREEDY}
    with httpx.stream("POST", frontend.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines, strict=False) if line) >= 2
    # The edge reset its stream to the back-end, which aborted the engine request.
    await asyncio.to_thread(
        wait_until, lambda: _in_flight_is_zero(server), 10, "the engine request to abort"
    )
