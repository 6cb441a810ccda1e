"""Stateless resets (RFC 9000 10.3) and refusals, sans IO where the logic is, and live where the
client meets them: tokens from one key, the RFC's size and rate rules, a connection that ends on
its own token and ignores any other, and a refused connection that fails at once."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aioquic.quic.connection import QuicConnectionState
from aioquic.quic.events import ConnectionTerminated
from aioquic.quic.packet import QuicErrorCode

from netsim.link import LinkConfig
from netsim.simlink import SERVER_ADDR, SimulatedPath
from tests.support.quic import quic_pair
from transport.client import Http3Client
from transport.connection import CONNECT_TRIES, ScheduledQuicConnection, StatelessReset
from transport.stateless_reset import (
    MAX_RESET,
    MIN_RESET,
    RESET_RATE,
    TOKEN_SIZE,
    ResetKey,
    ResetResponder,
    is_reset,
)

KEY = ResetKey(b"k" * 32)
CID = bytes(range(8))


def short_packet(cid: bytes, size: int) -> bytes:
    """A short-header packet to `cid`, as a client sends on an established connection."""
    return bytes([0x40]) + cid + b"\x00" * (size - 1 - len(cid))


def test_tokens_come_from_the_key_alone() -> None:
    assert KEY.token(CID) == ResetKey(b"k" * 32).token(CID)
    assert len(KEY.token(CID)) == TOKEN_SIZE
    assert KEY.token(CID) != ResetKey(b"j" * 32).token(CID)
    assert KEY.token(CID) != KEY.token(CID[::-1])
    assert "kkkk" not in repr(KEY)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ResetKey(b"short")


def test_a_reset_is_smaller_than_what_triggered_it_and_never_answers_a_resets_size() -> None:
    responder = ResetResponder(KEY, len(CID), rate=1e9)
    for size in range(1 + len(CID), 1500):
        reset = responder.reset(short_packet(CID, size), now=size)
        if size <= MIN_RESET:  # could itself be a reset: answering it could loop
            assert reset is None, size
            continue
        assert reset is not None
        assert MIN_RESET <= len(reset) < size and len(reset) <= MAX_RESET
        assert reset[0] & 0xC0 == 0x40  # a short header, fixed bit set
        assert reset[-TOKEN_SIZE:] == KEY.token(CID)
    long_header = bytes([0xC0]) + b"\x00" * 1199
    assert responder.reset(long_header, now=0.0) is None


def test_resets_are_rate_limited() -> None:
    responder = ResetResponder(KEY, len(CID))
    packet = short_packet(CID, 100)
    answered = [responder.reset(packet, now=0.0) is not None for _ in range(int(RESET_RATE) * 2)]
    assert sum(answered) == RESET_RATE and responder.limited == RESET_RATE
    assert responder.reset(packet, now=0.0) is None
    assert responder.reset(packet, now=0.5) is not None  # half a second refills half


def connected_pair() -> tuple[ScheduledQuicConnection, ScheduledQuicConnection, list[Any]]:
    """A client and a server connection whose tokens come from KEY, after the handshake and
    the server's NEW_CONNECTION_IDs; with the client's events."""
    client, server = quic_pair()
    server.reset_key = KEY
    server.sign_connection_ids()
    events: list[Any] = []

    def on_event(connection: Any, event: Any, now: float) -> None:
        if connection is client:
            events.append(event)

    path = SimulatedPath(client, server, LinkConfig(delay_s=0.005), on_event)
    path.run(until=lambda: client._handshake_confirmed and len(client._peer_cid_available) > 0)
    return client, server, events


def test_the_server_gives_the_client_tokens_from_its_key() -> None:
    client, server, _ = connected_pair()
    assert client._peer_cid.stateless_reset_token == KEY.token(client._peer_cid.cid)
    for issued in client._peer_cid_available:  # NEW_CONNECTION_ID, after the handshake
        assert issued.stateless_reset_token == KEY.token(issued.cid)
    assert {c.stateless_reset_token for c in server._host_cids} == {
        KEY.token(c.cid) for c in server._host_cids
    }


def test_a_connection_ends_on_a_reset_with_its_token_and_ignores_any_other() -> None:
    client, _, events = connected_pair()
    trigger = short_packet(client._peer_cid.cid, 200)
    wrong = ResetResponder(ResetKey(b"x" * 32), len(CID)).reset(trigger, now=0.0)
    assert wrong is not None
    client.receive_datagram(wrong, SERVER_ADDR, now=1.0)
    assert client._state == QuicConnectionState.CONNECTED  # RFC 9000 10.3.1: not ours
    right = ResetResponder(KEY, len(CID)).reset(trigger, now=0.0)
    assert right is not None and is_reset(right, client._peer_cid.stateless_reset_token)
    client.receive_datagram(right, SERVER_ADDR, now=1.0)
    assert client._state == QuicConnectionState.TERMINATED
    assert client.datagrams_to_send(now=1.0) == []  # nothing more is said on it
    ended = [e for e in iter(client.next_event, None) if isinstance(e, ConnectionTerminated)]
    assert len(ended) == 1 and isinstance(ended[0], StatelessReset)


def test_a_refused_connection_ends_on_the_refusal_without_draining() -> None:
    client, _ = quic_pair()
    client.connect(SERVER_ADDR, now=0.0)
    (initial, _), *_ = client.datagrams_to_send(now=0.0)
    refusal = ResetResponder(KEY, len(CID)).refuse(initial, now=0.0)
    assert refusal is not None and len(refusal) < len(initial)
    client.receive_datagram(refusal, SERVER_ADDR, now=0.01)
    # aioquic alone would drain for three probe timeouts (about a second) before saying so.
    assert client._state == QuicConnectionState.TERMINATED
    ended = [e for e in iter(client.next_event, None) if isinstance(e, ConnectionTerminated)]
    assert [e.error_code for e in ended] == [QuicErrorCode.CONNECTION_REFUSED]


class _Refuser(asyncio.DatagramProtocol):
    """A UDP port where every datagram meets a stand-in: a refusal for each new connection."""

    def __init__(self) -> None:
        self.responder = ResetResponder(KEY, len(CID))
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        answer = self.responder.respond(data, 0.0)
        if answer is not None and self.transport is not None:
            self.transport.sendto(answer, addr)


def test_a_refused_client_tries_again_from_new_ports_then_says_connection_refused() -> None:
    async def refused() -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        transport, refuser = await loop.create_datagram_endpoint(
            _Refuser, local_addr=("127.0.0.1", 0), family=socket.AF_INET
        )
        port = transport.get_extra_info("sockname")[1]
        try:
            with pytest.raises(ConnectionRefusedError) as refused:
                async with asyncio.timeout(30), Http3Client("127.0.0.1", port, verify=False):
                    pass
            return str(refused.value), refuser.responder.refusals
        finally:
            transport.close()

    message, refusals = asyncio.run(refused())
    assert "refused: worker restarting" in message
    assert refusals == CONNECT_TRIES  # each try from a new port, as another worker may take it
