"""Building a packet costs what is sent, not what is open: a connection with a thousand open
streams, most of them idle, finds the few with data, and offers flow-control credit, without
walking the idle ones, and without its scheduler popping them. Counted in visits, not timed:
real aioquic connections in virtual time (netsim.simlink)."""

from __future__ import annotations

import pytest
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent, StreamDataReceived

from netsim.link import LinkConfig
from netsim.simlink import SimulatedPath
from tests.support.quic import quic_pair
from transport.connection import _StreamTable
from transport.schedulers import SCHEDULERS

OPEN = 1000
BUSY = (40, 2000, 3996)  # stream ids among the thousand: the first, one in the middle, the last


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_a_thousand_idle_streams_are_not_visited_to_send_three(scheduler: str) -> None:
    client, server = quic_pair(scheduler)
    limit = server._local_max_streams_bidi  # as transport.http3 raises it
    limit.value = limit.sent = 2 * OPEN
    requests: set[int] = set()
    received: dict[int, int] = {}

    def on_event(connection: QuicConnection, event: QuicEvent, now: float) -> None:
        if not isinstance(event, StreamDataReceived):
            return
        if connection is server and event.end_stream:
            requests.add(event.stream_id)
        elif connection is client:
            received[event.stream_id] = received.get(event.stream_id, 0) + len(event.data)

    path = SimulatedPath(client, server, LinkConfig(rate_bps=50e6, delay_s=0.005), on_event)
    path.run(until=lambda: client._handshake_complete)
    for _ in range(OPEN):
        client.send_stream_data(client.get_next_available_stream_id(), b"request", True)
    table = server._streams
    assert isinstance(table, _StreamTable)
    # Every request read, and the credit for them settled; no response has begun: a thousand
    # idle streams.
    path.run(until=lambda: len(requests) == OPEN and not table.credit)
    assert len(table) == OPEN
    scanned, offers = server.scanned, table.visits
    pops = 0
    pop = server.scheduler.pop

    def counted_pop(now: float) -> int | None:
        nonlocal pops
        pops += 1
        return pop(now)

    server.scheduler.pop = counted_pop  # type: ignore[method-assign]

    for stream_id in BUSY:
        server.send_stream_data(stream_id, b"x" * 3000)
    path.run(until=lambda: all(received.get(s, 0) == 3000 for s in BUSY))

    assert set(received) == set(BUSY)
    # Streams looked at for what to send, and streams offered flow-control credit: a handful
    # for the three, where walking the open streams before every packet was thousands.
    assert server.scanned - scanned <= 10 * len(BUSY), server.scanned - scanned
    assert table.visits - offers <= 10 * len(BUSY), table.visits - offers
    # The scheduler pops the three, not the idle streams ahead of them in its order (FCFS: all
    # the thousand before the last, every packet).
    assert pops <= 10 * len(BUSY) and server.skipped == 0, (pops, server.skipped)
    assert len(table) == OPEN  # all still open
