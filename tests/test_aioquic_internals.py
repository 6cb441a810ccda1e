"""Every private name of aioquic (and the one of hypercorn) that the project reads, writes,
overrides or swaps, pinned in one place.

The transport reaches inside aioquic where it has no public hook: the stream scheduler replaces
`_streams_queue` with a property, `adopt()` swaps the class of live connections and of their
loss recovery, the server raises `_local_max_streams_bidi`, the Eloquent driver reads
`_datagrams_pending`, and the retransmission of late stream data reads the sender's buffers.
None of that is aioquic's API, so an upgrade may move any of it without notice; this test is
where such an upgrade fails, loudly and by name, instead of a stream stalling somewhere else.
Code that touches a new private name adds it here.
"""

from __future__ import annotations

import inspect

import pytest
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.recovery import QuicPacketRecovery
from aioquic.quic.stream import QuicStream
from hypercorn.protocol.h2 import H2Protocol

CONNECTION = (
    "_close_event",  # a stateless reset or a refusal ends the connection with its own
    "_configuration",  # transport.client, transport.masque: the peer's settings
    "_datagrams_pending",  # transport.eloquent.driver: which token datagrams still wait
    "_events",  # transport.connection, transport.http3: events queued for the protocol
    "_handshake_complete",
    "_handshake_confirmed",
    "_host_cids",  # the IDs this end issued: their reset tokens come from the reset key
    "_local_max_streams_bidi",  # transport.http3 raises it (aioquic has no setting)
    "_local_next_stream_id_bidi",  # transport.client: streams left before MAX_STREAMS
    "_loss",  # adopt() swaps its class to count losses; the RTT is read from it
    "_network_paths",
    "_peer_cid",  # its stateless_reset_token is checked against every datagram
    "_remote_max_streams_bidi",
    "_spaces",  # the ACK timer reads the 1-RTT space
    "_state",
    "_streams",  # replaced by a table whose values() skips streams owed nothing
)
"""Instance attributes of a QuicConnection the project reads or writes."""

RECOVERY = ("_cc", "_rtt_initialized", "_rtt_smoothed", "_rtt_variance", "congestion_window")
SENDER = ("_acked", "_acked_fin", "_buffer", "_buffer_fin", "_buffer_start", "_buffer_stop",
          "_pending", "_pending_eof", "_stream_id")  # fmt: skip
RECEIVER = ("_buffer_start", "_stream_id", "highest_offset")
PROTOCOL = ("_quic", "_transport", "_closed", "_handle_timer", "_process_events")

SERVER = ("_configuration", "_create_protocol", "_loop", "_protocols", "_transport")
"""A QuicServer's: `ResettingQuicServer` answers for connection IDs missing from `_protocols`."""
CALLED = {
    (QuicConnection, "_close_end"): (),
    (QuicConnection, "_replenish_connection_ids"): (),
}
"""Methods the project calls (or overrides and calls through super()) with no arguments."""

OVERRIDDEN = {
    (QuicConnection, "_on_max_stream_data_delivery"): ("delivery", "stream"),
    (QuicConnection, "_payload_received"): ("context", "plain", "crypto_frame_required"),
    (QuicConnection, "_write_ack_frame"): ("builder", "space", "now"),
    (QuicPacketRecovery, "_on_packets_lost"): ("congestion_event", "packets", "space"),
}
"""Methods the project overrides and calls through super(): their parameters by name."""


def connection() -> QuicConnection:
    return QuicConnection(configuration=QuicConfiguration(is_client=True))


@pytest.mark.parametrize("name", CONNECTION)
def test_a_connection_has_each_private_attribute_the_transport_touches(name: str) -> None:
    assert hasattr(connection(), name), f"aioquic's QuicConnection lost {name}"


def test_the_stream_limit_the_server_raises_has_its_value_and_what_was_sent() -> None:
    limit = connection()._local_max_streams_bidi
    assert isinstance(limit.value, int) and isinstance(limit.sent, int)


def test_the_stream_queue_is_a_plain_instance_attribute_that_a_class_property_can_replace() -> None:
    """adopt() deletes it from the instance and swaps the class, whose property takes over."""
    quic = connection()
    assert isinstance(quic.__dict__["_streams_queue"], list)
    assert not hasattr(QuicConnection, "__slots__")
    assert not hasattr(type(quic._loss), "__slots__")


def test_each_packet_is_built_from_the_stream_queue_and_the_stream_table() -> None:
    """The two reads the scheduler and the stream table hook: one pass over `_streams_queue`,
    and `_streams.values()` for the MAX_STREAM_DATA frames."""
    source = inspect.getsource(QuicConnection._write_application)
    assert "self._streams_queue" in source
    assert "self._streams.values()" in source


def test_loss_recovery_keeps_the_rtt_and_window_the_transport_reads() -> None:
    loss = connection()._loss
    missing = [n for n in RECOVERY if not hasattr(loss, n)]
    assert not missing, f"aioquic's QuicPacketRecovery lost {missing}"


def test_a_streams_sender_and_receiver_keep_the_buffers_the_transport_reads() -> None:
    stream = QuicStream(stream_id=0)
    missing = [f"sender.{n}" for n in SENDER if not hasattr(stream.sender, n)]
    missing += [f"receiver.{n}" for n in RECEIVER if not hasattr(stream.receiver, n)]
    assert not missing, f"aioquic's stream lost {missing}"


async def test_the_asyncio_protocol_keeps_what_the_coalescing_protocol_reads() -> None:
    protocol = QuicConnectionProtocol(connection())  # it takes the running loop
    missing = [n for n in PROTOCOL if not hasattr(protocol, n)]
    assert not missing, f"aioquic's QuicConnectionProtocol lost {missing}"


@pytest.mark.parametrize(("owner", "method"), list(OVERRIDDEN))
def test_an_overridden_method_keeps_the_parameters_it_is_called_with(
    owner: type, method: str
) -> None:
    parameters = inspect.signature(getattr(owner, method)).parameters
    missing = [p for p in OVERRIDDEN[owner, method] if p not in parameters]
    assert not missing, f"{owner.__name__}.{method} lost its parameters {missing}"


def test_hypercorns_http2_protocol_still_handles_its_events_in_one_method() -> None:
    """transport.server wraps it to tolerate a stream the client reset."""
    assert inspect.iscoroutinefunction(H2Protocol._handle_events)


async def test_the_server_keeps_what_the_resetting_server_reads() -> None:
    server = QuicServer(configuration=QuicConfiguration(is_client=False))
    missing = [n for n in SERVER if not hasattr(server, n)]
    assert not missing, f"aioquic's QuicServer lost {missing}"
    assert QuicConfiguration.connection_id_length == 8  # the supervisor's stand-in assumes it


@pytest.mark.parametrize(("owner", "method"), list(CALLED))
def test_a_method_called_without_arguments_still_takes_none(owner: type, method: str) -> None:
    parameters = inspect.signature(getattr(owner, method)).parameters
    assert list(parameters) == ["self"], f"{owner.__name__}.{method} now takes {parameters}"


def test_the_first_connection_ids_token_is_what_the_transport_parameters_carry() -> None:
    """sign_connection_ids() must run before the parameters are serialized: they read it."""
    source = inspect.getsource(QuicConnection._serialize_transport_parameters)
    assert "self._host_cids[0].stateless_reset_token" in source
