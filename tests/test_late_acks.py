"""A late ACK of a packet that a probe timeout already sent again (transport.connection's
`CountingRecovery` and `send_acknowledged`), sans IO and in virtual time: the test carries each
datagram itself, so it decides which arrive, and when.

aioquic 1.7.2 declares that packet lost and ignores the ACK; a response whose every byte the
client acknowledged must still count as delivered, and one with a byte missing must not."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import pytest

from tests.support.quic import quic_pair
from transport.connection import RESENT_EARLY_S, CountingRecovery, ScheduledQuicConnection

CLIENT, SERVER = ("10.0.0.1", 4433), ("10.0.0.2", 443)
RESPONSE = 3_000  # three packets


class Wire:
    """Both ends, with a clock the test moves."""

    def __init__(self) -> None:
        self.client, self.server = quic_pair()
        self.now = 0.0
        self.client.connect(SERVER, now=self.now)
        for _ in range(10):  # handshake, then until every ACK has gone both ways
            self.tick(0.01)
            self.deliver(self.server, self.sent(self.client))
            self.deliver(self.client, self.sent(self.server))
        assert self.client._handshake_complete and self.server._handshake_complete
        self.stream_id = self.client.get_next_available_stream_id()
        self.client.send_stream_data(self.stream_id, b"request", end_stream=True)
        self.deliver(self.server, self.sent(self.client))
        self.server.send_stream_data(self.stream_id, bytes(RESPONSE), end_stream=True)
        self.originals = self.sent(self.server)
        assert len(self.originals) == 3

    def tick(self, seconds: float) -> None:
        self.now += seconds
        for end in (self.client, self.server):
            while end.next_event() is not None:
                pass

    def sent(self, end: ScheduledQuicConnection) -> list[bytes]:
        return [data for data, _ in end.datagrams_to_send(now=self.now)]

    def deliver(self, end: ScheduledQuicConnection, datagrams: Iterable[bytes]) -> None:
        source = CLIENT if end is self.server else SERVER
        for data in datagrams:
            end.receive_datagram(data, source, now=self.now)

    def probe_timeout(self) -> list[bytes]:
        """The server's PTO fires before any ACK of the response: it sends a copy."""
        recovery = cast(CountingRecovery, self.server._loss)
        lost = recovery.lost
        for _ in range(5):  # pacing and ACK timers may come first
            timer = self.server.get_timer()
            assert timer is not None
            self.now = timer
            self.server.handle_timer(now=self.now)
            copies = self.sent(self.server)
            if recovery.lost > lost:
                return copies
        raise AssertionError("no probe timeout")

    def client_acknowledges(self, datagrams: Iterable[bytes]) -> None:
        self.deliver(self.client, datagrams)
        self.tick(0.002)  # past the client's ack delay
        self.deliver(self.server, self.sent(self.client))

    @property
    def aioquic_finished(self) -> bool:
        stream = self.server._streams.get(self.stream_id)
        return stream is None or stream.sender.is_finished


def test_an_ack_of_the_originals_after_a_pto_copy_delivers_the_response() -> None:
    wire = Wire()
    wire.probe_timeout()  # the copy never arrives: the client closes first
    wire.client_acknowledges(wire.originals)
    # If this fails, aioquic counts late ACKs itself, and CountingRecovery's record can go.
    assert not wire.aioquic_finished
    assert wire.server.send_acknowledged(wire.stream_id)


def test_a_lost_original_is_not_delivered_until_its_copy_is_acknowledged() -> None:
    wire = Wire()
    copies = wire.probe_timeout()
    wire.client_acknowledges(wire.originals[1:])  # the first packet was really lost
    assert not wire.server.send_acknowledged(wire.stream_id)
    wire.client_acknowledges(copies)
    assert wire.aioquic_finished and wire.server.send_acknowledged(wire.stream_id)


@pytest.mark.parametrize("arrived", [[0], [0, 1]], ids=["first", "all-but-the-end"])
def test_a_late_ack_without_the_end_of_the_response_does_not_deliver_it(
    arrived: list[int],
) -> None:
    wire = Wire()
    wire.probe_timeout()
    wire.client_acknowledges(wire.originals[i] for i in arrived)
    assert not wire.server.send_acknowledged(wire.stream_id)


def test_a_copy_is_remembered_for_a_bounded_time() -> None:
    wire = Wire()
    wire.probe_timeout()
    wire.tick(RESENT_EARLY_S + 1)
    wire.client_acknowledges(wire.originals)
    assert not wire.server.send_acknowledged(wire.stream_id)
    assert not cast(CountingRecovery, wire.server._loss)._resent_early
