"""Eloquent end to end: the real embedded server, HTTP/3, and a lossy link in between."""

from __future__ import annotations

import json

from netsim.link import GilbertElliott, LinkConfig
from netsim.relay import LossyRelay
from tests.support.servers import Server
from transport.client import Http3Client
from workloads.chat import ChatResult, read_chat_stream

BODY = {
    "model": "tiny-m",
    "messages": [{"role": "user", "content": "Tell me a story."}],
    # Long enough to outlast an RTT and the sender's 50 ms coalescing several times over, so that
    # ACKs can come back while datagrams still flow (tiny-m streams 48 tokens in under 50 ms).
    "max_tokens": 200,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.0,
    "ignore_eos": True,
}


async def run_both_ways(h3_port: int) -> tuple[dict, LossyRelay]:
    # Lossy bursts of 200 ms every 500 ms at 90% loss, 40 ms RTT. The bursts come by the clock,
    # and a fast run can finish before the first one: 5% loss between them makes sure the
    # link drops something whatever the timing. Only the datagrams' way is lossy: a burst that
    # outlasted the whole lane took every ACK with it in one CI run, and whether the envelope
    # stops (checked below) is then a coin toss; lost ACKs are the sender's unit tests' matter.
    bursts = GilbertElliott(good_slots=5, good_loss=0.05)
    downlink = LinkConfig(rate_bps=20e6, delay_s=0.02, bursts=bursts)
    link = LinkConfig(rate_bps=20e6, delay_s=0.02, seed=2, downlink=downlink)
    relay = LossyRelay(("127.0.0.1", h3_port), link)
    port = await relay.start()
    runs = {}
    try:
        async with Http3Client("127.0.0.1", port, verify=False) as client:
            for eloquent in (False, True):
                response = await client.request(
                    "POST", "/v1/chat/completions", {"content-type": "application/json"},
                    json.dumps(BODY).encode(), eloquent=eloquent,
                )  # fmt: skip
                assert response.status == 200
                result = ChatResult(status=200)
                await read_chat_stream(response.iter_lines(), result, 0.0)
                runs[eloquent] = (result, response)
    finally:
        relay.close()
    return runs, relay


def check(runs: dict, relay: LossyRelay) -> None:
    assert relay.down.dropped > 0
    plain, plain_response = runs[False]
    result, response = runs[True]
    assert plain_response.lane is None and plain.error is None
    assert result.error is None, result.error
    assert result.usage and plain.usage
    assert result.usage["completion_tokens"] == 200 == plain.usage["completion_tokens"]
    lane = response.lane
    assert lane is not None and lane.active
    receiver = lane.receiver
    # Every event of the stream was rendered once, in order, and each datagram copy matched it:
    # the reader got the stream's bytes exactly.
    assert receiver.next_event == receiver.next_position == lane.streamed
    assert receiver.stats.mismatches == 0 and lane.matches_stream
    assert receiver.stats.datagrams > 0 and receiver.stats.acks > 0
    # The envelope stops once the sender has an ACK saying it arrived: ACKs made it back.
    assert receiver.stats.with_envelope < receiver.stats.datagrams
    text = "".join(receiver.text_of(p) for p in range(receiver.next_position))
    assert text == result.text


async def test_eloquent_over_a_lossy_link_ends_with_the_streamed_text(server: Server) -> None:
    check(*await run_both_ways(server.h3_port or 0))


async def test_the_edge_forwards_datagrams_and_acks_end_to_end(frontend: Server) -> None:
    """The lossy link is between the client and the edge; the back-end's sender does the work,
    so a client of the edge gets the same protection, and its ACKs reach the back-end."""
    check(*await run_both_ways(frontend.h3_port or 0))
