"""What a datagram received costs: a client that acknowledges every second packet (RFC 9000
13.2.2) rather than nearly every one, as aioquic's own policy does, and a connection that knows
when an ACK left it nothing to send. Real aioquic connections in virtual time (netsim.simlink),
counted, not timed."""

from __future__ import annotations

from typing import Any

import pytest

from netsim.link import LinkConfig
from netsim.simlink import SimulatedPath
from tests.support.quic import quic_pair
from transport.connection import ScheduledQuicConnection

WRITES = 41  # odd: the last packet has no second to be acknowledged with
GAP_S = 0.01  # between two writes: each goes in a packet of its own


def stream_of_packets(ack_every: int, fin: bool) -> tuple[int, float, bool]:
    """The server writes a response in WRITES packets GAP_S apart, the last with the stream's
    end or not. Returns the ACK frames the client sent, how long after the last write the
    server knew all of it delivered, and whether the client got every byte."""
    client, server = quic_pair("rr")
    client.ack_every = ack_every
    acks = 0
    write_ack_frame = client._write_ack_frame

    def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal acks
        acks += 1
        write_ack_frame(*args, **kwargs)

    client._write_ack_frame = counted  # type: ignore[method-assign]
    received = bytearray()

    def on_event(connection: Any, event: Any, now: float) -> None:
        if connection is client and hasattr(event, "data"):
            received.extend(event.data)

    path = SimulatedPath(client, server, LinkConfig(rate_bps=50e6, delay_s=0.005), on_event)
    path.run(until=lambda: client._handshake_confirmed)
    stream_id = client.get_next_available_stream_id()
    client.send_stream_data(stream_id, b"request", True)
    path.run(until=lambda: stream_id in server._streams)
    acks = 0
    for i in range(WRITES):
        path.call_at(path.now + i * GAP_S, lambda now, i=i: server.send_stream_data(
            stream_id, bytes([i]) * 100, fin and i == WRITES - 1))  # fmt: skip
    last_write = path.now + (WRITES - 1) * GAP_S
    sender = server._streams[stream_id].sender

    def delivered() -> bool:  # every byte written acknowledged (aioquic has no accessor)
        return path.now > last_write and sender._buffer_start == WRITES * 100

    done = path.run(until=delivered)
    expected = b"".join(bytes([i]) * 100 for i in range(WRITES))
    return acks, done - last_write, bytes(received) == expected


def test_the_client_acknowledges_every_second_packet_and_the_last_within_its_delay() -> None:
    every, _, whole = stream_of_packets(ack_every=1, fin=False)
    second, after_last, whole_too = stream_of_packets(ack_every=2, fin=False)
    assert whole and whole_too
    assert every >= WRITES - 2, every  # aioquic's policy: one ACK a packet, this far apart
    assert second <= WRITES // 2 + 3, second
    # The odd last packet waits for the ACK delay, no more: one RTT plus at most 25 ms.
    assert 0.010 + 0.020 < after_last <= 0.010 + ScheduledQuicConnection.ack_delay + 0.002


def test_the_end_of_a_stream_is_acknowledged_at_once() -> None:
    # A client that reads a response and closes must not hold the ACK of its last packet: the
    # server would never learn that the response arrived.
    _, after_last, whole = stream_of_packets(ack_every=2, fin=True)
    assert whole and after_last <= 0.010 + 0.002, after_last


@pytest.mark.parametrize("scheduler", ["rr", "fcfs"])
def test_an_ack_that_leaves_nothing_to_send_asks_for_no_transmit(scheduler: str) -> None:
    client, server = quic_pair(scheduler)
    now = 0.0

    def deliver(source: ScheduledQuicConnection, to: ScheduledQuicConnection) -> None:
        address = ("1.2.3.4", 443) if source is server else ("1.1.1.1", 1000)
        for data, _ in source.datagrams_to_send(now):
            to.receive_datagram(data, address, now)

    client.connect(("1.2.3.4", 443), now)
    for _ in range(6):
        deliver(client, server)
        deliver(server, client)
        now += 0.01
    assert server._handshake_confirmed
    stream_id = client.get_next_available_stream_id()
    client.send_stream_data(stream_id, b"request", True)
    deliver(client, server)
    assert server.reply_due  # a request: the app answers, and it must be acknowledged

    server.send_stream_data(stream_id, b"x" * 500)
    deliver(server, client)
    now += 0.03  # past the client's ACK delay
    deliver(client, server)  # its ACK, only
    assert not server.reply_due

    server.send_stream_data(stream_id, b"y" * 500)
    deliver(server, client)
    server.send_stream_data(stream_id, b"z" * 500)  # not yet sent when the next ACK comes
    now += 0.03
    deliver(client, server)
    assert server.reply_due
