"""A QuicConnection whose stream service order comes from a `transport.schedulers.Scheduler`.

aioquic builds each packet in `QuicConnection._write_application()`, with one pass over
`self._streams_queue`: each stream in turn fills what it can. Afterwards the streams that sent are
moved to the tail, collected in a set, so aioquic's own order is round-robin and varies from run to
run. We turn `_streams_queue` into a property (the clean hook: unchanged from aioquic 1.0 to 1.7.2,
and pinned with every other private name we touch by tests/test_aioquic_internals.py) rather than
copy `_write_application`, whose copies break silently across versions:
- the getter hands out a view whose iteration pops streams from the scheduler, in its order;
- `append` on that view (aioquic calls it when a stream is created) adds the stream;
- the setter, which aioquic calls after every packet with the streams it keeps, tells the
  scheduler which streams sent how much and which were discarded.

Streams the scheduler does not own go first: unidirectional streams (the HTTP/3 control and QPACK
streams, small and needed by every request) and streams with a reset or STOP_SENDING to write.

Deadlines: before every batch of packets, streams whose hard deadline has passed are reset with
`H3_REQUEST_CANCELLED`, and a `StreamExpired` event tells the application, which then cancels the
work behind the stream. It runs the same on the client side (requests) and on the server side
(responses). Time is whatever `now` aioquic is given, so tests run it in virtual time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from aioquic import tls
from aioquic.asyncio import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import ErrorCode
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import (
    QuicConnection,
    QuicConnectionState,
    stream_is_unidirectional,
)
from aioquic.quic.events import ConnectionTerminated, QuicEvent
from aioquic.quic.packet import QuicErrorCode
from aioquic.quic.packet_builder import QuicDeliveryState, QuicSentPacket
from aioquic.quic.rangeset import RangeSet
from aioquic.quic.recovery import QuicPacketRecovery
from aioquic.quic.stream import QuicStream, QuicStreamReceiver, QuicStreamSender

from config.paths import PathEstimate
from transport.schedulers import DEFAULT_SPEC, Scheduler, StreamSpec, make_scheduler
from transport.stateless_reset import ResetKey, ResetResponder, is_reset, is_short_header
from transport.udp import BatchedDatagramTransport, open_udp, send_all, widen_receive_buffer

EXPIRED_ERROR = ErrorCode.H3_REQUEST_CANCELLED
"""The HTTP/3 error code of a stream dropped at its deadline (RFC 9114 8.1: the request was
cancelled, none of it was processed further)."""


@dataclass
class StreamExpired(QuicEvent):
    """A stream passed its hard deadline; the connection has reset it."""

    stream_id: int


@dataclass
class StatelessReset(ConnectionTerminated):
    """The peer sent a stateless reset with this connection's token (RFC 9000 10.3): it no
    longer knows the connection, and whatever was in flight on it is lost."""


RESENT_EARLY_KEPT = 64
"""Packets a probe timeout sent again, remembered for an ACK of the original that comes late:
at most this many, for at most `RESENT_EARLY_S`. Every ACK is checked against them."""
RESENT_EARLY_S = 10.0
"""Seconds. Far longer than a late ACK takes (an RTT spike of 300 ms is ten PTOs of a fast path),
short enough that a connection's spurious PTOs do not pile up."""


class CountingRecovery(QuicPacketRecovery):
    """aioquic's loss recovery, counting the packets it sends in flight and those it declares
    lost (by ACKs, or at a probe timeout), for the path estimate: aioquic keeps no such count.

    It also keeps the ACKs aioquic throws away. At a probe timeout aioquic 1.7.2 declares the
    oldest packet in flight lost and sends its data again, although RFC 9002 6.2 says a PTO
    must not mark packets lost; an ACK of the original that arrives afterwards is then ignored.
    On a path slower than the PTO expects (a MASQUE tunnel, a loaded machine), the last packet
    of a response is often sent again this way, and a client that closes the connection right
    after reading never acknowledges the copy: the response was delivered, but the stream never
    finishes. `late_acks` records what such ACKs acknowledged, stream by stream, without
    touching aioquic's own state, for `ScheduledQuicConnection.send_acknowledged`."""

    sent_in_flight = 0
    lost = 0
    # Set on first use: the class is swapped onto aioquic's instance, so __init__ never runs.
    _resent_early: dict[int, QuicSentPacket] | None = None
    _late_acks: dict[int, tuple[RangeSet, bool]] | None = None
    on_stream_acked: Callable[[int], None] | None = None
    """Told the stream of every late ACK, as `_AckedSender` tells it of aioquic's own."""

    def on_packet_sent(self, *, packet: QuicSentPacket, space: Any) -> None:
        super().on_packet_sent(packet=packet, space=space)
        if packet.in_flight:
            self.sent_in_flight += 1

    def _on_packets_lost(
        self, *, packets: Any, space: Any, congestion_event: bool = True, **kwargs: Any
    ) -> None:
        packets = list(packets)
        self.lost += sum(1 for packet in packets if packet.in_flight)
        if not congestion_event and space.is_application_data:  # a PTO's early retransmission
            if self._resent_early is None:
                self._resent_early = {}
            for packet in packets:
                self._resent_early[packet.packet_number] = packet
            while len(self._resent_early) > RESENT_EARLY_KEPT:
                del self._resent_early[next(iter(self._resent_early))]
        super()._on_packets_lost(
            packets=packets, space=space, congestion_event=congestion_event, **kwargs
        )

    def on_ack_received(
        self, *, ack_rangeset: RangeSet, ack_delay: float, now: float, space: Any
    ) -> None:
        if self._resent_early and space.is_application_data:
            while self._resent_early:  # oldest first: they are kept in the order PTOs sent them
                oldest = next(iter(self._resent_early.values()))
                assert oldest.sent_time is not None  # aioquic stamps every packet it sends
                if oldest.sent_time >= now - RESENT_EARLY_S:
                    break
                del self._resent_early[oldest.packet_number]
            late = [n for n in self._resent_early if n in ack_rangeset]
            for packet_number in late:
                self._record_late_ack(self._resent_early.pop(packet_number))
        super().on_ack_received(
            ack_rangeset=ack_rangeset, ack_delay=ack_delay, now=now, space=space
        )

    def _record_late_ack(self, packet: QuicSentPacket) -> None:
        if self._late_acks is None:
            self._late_acks = {}
        for handler, args in packet.delivery_handlers:
            sender = getattr(handler, "__self__", None)
            if not isinstance(sender, QuicStreamSender) or sender._stream_id is None:
                continue  # not stream data (an ACK, a MAX_DATA, ...): nothing to finish
            start, stop, fin = args
            ranges, acked_fin = self._late_acks.get(sender._stream_id, (RangeSet(), False))
            if stop > start:
                ranges.add(start, stop)
            self._late_acks[sender._stream_id] = (ranges, acked_fin or fin)
            if self.on_stream_acked is not None:
                self.on_stream_acked(sender._stream_id)

    def late_acks(self, stream_id: int) -> tuple[RangeSet, bool] | None:
        """The stream's byte ranges, and whether its FIN, acknowledged only in packets aioquic
        had already declared lost at a probe timeout."""
        return self._late_acks.get(stream_id) if self._late_acks else None

    def forget(self, stream_id: int) -> None:
        if self._late_acks:
            self._late_acks.pop(stream_id, None)


class _WatchedSender(QuicStreamSender):
    """aioquic's stream sender, which tells its connection whenever it may have something new to
    send or to end (`_touch`: bytes written or lost, a reset, its end or a reset acknowledged)
    and whenever the peer acknowledged some of its data (`_stream_acked`).

    The first keeps the connection's set of streams with something to send exact, so that
    building a packet never walks the idle ones; the second wakes a writer waiting for ACKs on
    its own stream's ACKs, not on every datagram the connection receives. Swapped onto each
    stream as it is created. Upstream would need a state-change callback per stream."""

    connection: ScheduledQuicConnection

    def write(self, data: bytes, end_stream: bool = False) -> None:
        super().write(data, end_stream)
        self.connection._touch(self._stream_id)

    def reset(self, error_code: int) -> None:
        super().reset(error_code)
        self.connection._touch(self._stream_id)

    def on_data_delivery(
        self, delivery: QuicDeliveryState, start: int, stop: int, fin: bool
    ) -> None:
        super().on_data_delivery(delivery, start, stop, fin)
        if delivery != QuicDeliveryState.ACKED:  # lost: to be sent again
            self.connection._touch(self._stream_id)
        elif self._stream_id is not None:
            if self.is_finished:  # its end acknowledged: the stream may be done
                self.connection._touch(self._stream_id)
            self.connection._stream_acked(self._stream_id)

    def on_reset_delivery(self, delivery: QuicDeliveryState) -> None:
        super().on_reset_delivery(delivery)
        self.connection._touch(self._stream_id)


class _WatchedReceiver(QuicStreamReceiver):
    """aioquic's stream receiver, which tells its connection whenever it received (its stream
    may then be finished, and may need more flow-control credit: see `_StreamTable`) and whenever
    a STOP_SENDING is to be (re)sent."""

    connection: ScheduledQuicConnection
    stream: QuicStream

    def handle_frame(self, frame: Any) -> Any:
        event = super().handle_frame(frame)
        self.connection._received(self.stream)
        if frame.fin:
            self.connection._ended_stream = True
        return event

    def handle_reset(self, *, final_size: int, error_code: int = 0) -> Any:
        event = super().handle_reset(final_size=final_size, error_code=error_code)
        self.connection._received(self.stream)
        return event

    def stop(self, error_code: int = 0) -> None:
        super().stop(error_code)
        self.connection._touch(self.stream.stream_id)

    def on_stop_sending_delivery(self, delivery: QuicDeliveryState) -> None:
        super().on_stop_sending_delivery(delivery)
        self.connection._touch(self.stream.stream_id)


class _StreamTable(dict[int, QuicStream]):
    """aioquic's table of a connection's streams (`_streams`), whose `values()` yields only the
    streams that may be due a MAX_STREAM_DATA frame.

    Before every packet, aioquic offers every stream of the connection a MAX_STREAM_DATA frame
    (`_write_application`: `for stream in self._streams.values()`, its only use of values()),
    and a stream is due one only after it received data, or when the frame that carried its last
    one was lost. With hundreds of open streams that walk was about a tenth of the server's CPU
    (py-spy, `paper-4gpu-sim` at 96 req/s over HTTP/3). The streams that received, or lost such a
    frame, are kept aside, and each leaves once aioquic has nothing more to send it; the rest are
    never visited. Upstream would need the same set kept in `_handle_stream_frame`."""

    def __init__(self) -> None:
        super().__init__()
        self.credit: dict[int, QuicStream] = {}
        self.visits = 0
        """How many streams `values()` has yielded: what a test counts."""

    def credit_due(self, stream: QuicStream) -> None:
        if stream.stream_id is not None:
            self.credit[stream.stream_id] = stream

    def values(self) -> Iterator[QuicStream]:  # type: ignore[override]
        for stream_id, stream in list(self.credit.items()):
            self.visits += 1
            yield stream
            # Past the yield, aioquic has written the frame (or found none was due).
            local = stream.max_stream_data_local
            wants_more = bool(local) and stream.receiver.highest_offset * 2 > local
            if not wants_more and stream.max_stream_data_local_sent == local:
                self.credit.pop(stream_id, None)

    def pop(self, stream_id: int, *default: Any) -> Any:
        self.credit.pop(stream_id, None)
        return super().pop(stream_id, *default)


class ScheduledQuicConnection(QuicConnection):
    def __init__(self, *args: Any, scheduler: Scheduler | str = "rr", **kwargs: Any) -> None:
        self._init_scheduling(scheduler)
        super().__init__(*args, **kwargs)
        self._loss.__class__ = CountingRecovery
        self._track_streams()

    def path_estimate(self) -> PathEstimate | None:
        """The peer's path as this connection has measured it so far: smoothed RTT and its
        variation, the share of packets sent that were lost, and the rate the congestion window
        allows (window / RTT); None before the first RTT sample."""
        loss = self._loss
        if not loss._rtt_initialized:  # aioquic's recovery state, which has no accessors
            return None
        sent = getattr(loss, "sent_in_flight", 0)
        lost = getattr(loss, "lost", 0)
        return PathEstimate(
            loss._rtt_smoothed,
            loss._rtt_variance,
            lost / sent if sent else 0.0,
            loss.congestion_window * 8 / max(loss._rtt_smoothed, 1e-6),
        ).clamped()

    def send_acknowledged(self, stream_id: int) -> bool:
        """Whether the peer acknowledged every byte this end sent on the stream, and its end:
        aioquic's `is_finished`, or the same once the ACKs aioquic ignored are counted
        (`CountingRecovery`). A stream aioquic has discarded was finished."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.sender.is_finished:
            return True
        sender = stream.sender
        late = cast(CountingRecovery, self._loss).late_acks(stream_id)
        if late is None or sender._buffer_fin is None:  # aioquic's sender has no accessors
            return False
        late_ranges, late_fin = late
        if not (late_fin or sender._acked_fin):
            return False
        acked = RangeSet(list(sender._acked) + list(late_ranges))
        if sender._buffer_start:
            acked.add(0, sender._buffer_start)
        end = sender._buffer_fin
        return end == 0 or (len(acked) == 1 and acked[0].start == 0 and acked[0].stop >= end)

    def _track_streams(self) -> None:
        """Our stream table, and the ACK notices (both before any stream exists)."""
        assert not self._streams
        self._streams = _StreamTable()
        self._acked: set[int] | None = None  # None: nobody asks (see watch_acks)
        cast(CountingRecovery, self._loss).on_stream_acked = self._stream_acked

    def watch_acks(self) -> None:
        """From now on, remember which streams the peer acknowledged data of (`take_acked`)."""
        if self._acked is None:
            self._acked = set()

    def take_acked(self) -> set[int]:
        """The streams the peer acknowledged data of since the last call (with `watch_acks`)."""
        if not self._acked:
            return set()
        acked, self._acked = self._acked, set()
        return acked

    def _stream_acked(self, stream_id: int) -> None:
        if self._acked is not None:
            self._acked.add(stream_id)

    def _touch(self, stream_id: int | None) -> None:
        """The stream's state changed (`_WatchedSender`, `_WatchedReceiver`)."""
        if stream_id is None:
            return
        if (stream := self._owned.get(stream_id)) is not None:
            self._classify(stream_id, stream)
        elif (stream := self._unscheduled.get(stream_id)) is not None:
            self._first[stream_id] = stream  # shown first until `_scan` finds it done with

    def _due_first(self, stream_id: int, stream: QuicStream) -> bool:
        """Whether the stream is still to be shown ahead of the scheduler's: a control frame
        or a discard to come, or, for a unidirectional stream, any bytes."""
        sender = stream.sender
        if sender.reset_pending or stream.receiver.stop_pending or stream.is_finished:
            return stream_id in self._owned or stream_id in self._unscheduled
        return stream_id in self._unscheduled and bool(len(sender._pending) or sender._pending_eof)

    def _classify(self, stream_id: int, stream: QuicStream) -> None:
        if stream.sender.reset_pending or stream.receiver.stop_pending or stream.is_finished:
            self._first[stream_id] = stream
        sender = stream.sender
        # aioquic's `buffer_is_empty` stays False after a stream's last bytes went out, until
        # it next asks the stream for a frame; what is left to send is in `_pending`.
        if sender.buffer_is_empty or not (len(sender._pending) or sender._pending_eof):
            ready = False
            self._blocked.pop(stream_id, None)
        elif stream.is_blocked:
            ready = False
            self._blocked[stream_id] = stream
        else:
            ready = True
            self._blocked.pop(stream_id, None)
        if ready == (stream_id in self._ready):
            return
        served = self._round.get(stream_id)
        if ready:
            self._ready.add(stream_id)
            if served is None or not served.popped:
                self.scheduler.unpark(stream_id)
        else:
            self._ready.discard(stream_id)
            if served is None or not served.popped:  # a popped one is parked once given back
                self.scheduler.park(stream_id)

    def _received(self, stream: QuicStream) -> None:
        cast(_StreamTable, self._streams).credit_due(stream)
        self._touch(stream.stream_id)

    def _on_max_stream_data_delivery(self, delivery: QuicDeliveryState, stream: QuicStream) -> None:
        super()._on_max_stream_data_delivery(delivery, stream)
        if delivery != QuicDeliveryState.ACKED:  # lost: aioquic will send it again
            cast(_StreamTable, self._streams).credit_due(stream)

    def _init_scheduling(self, scheduler: Scheduler | str) -> None:
        self.scheduler = make_scheduler(scheduler) if isinstance(scheduler, str) else scheduler
        self._owned: dict[int, QuicStream] = {}  # the streams the scheduler orders
        # Which of them have something to send, kept as it changes (`_classify`) so that no
        # packet walks the idle ones: a reset, a STOP_SENDING or an end to be discarded at
        # (`_first`, written before any data), bytes (`_ready`), or bytes that must wait until
        # the peer allows more streams (`_blocked`, a client's; checked before each batch).
        self._first: dict[int, QuicStream] = {}
        self._ready: set[int] = set()
        self._blocked: dict[int, QuicStream] = {}
        self.scanned = 0
        """Streams looked at before batches of packets (`_scan`): what a test counts."""
        self.skipped = 0
        """Streams the scheduler popped with nothing to send, requeued in place. Streams with
        nothing to send are parked in the scheduler (`Scheduler.park`), so this stays 0: a test
        counts it."""
        # Unidirectional streams (HTTP/3's control and QPACK streams): in `_first` whenever they
        # have anything to send, never scheduled.
        self._unscheduled: dict[int, QuicStream] = {}
        self._early_specs: dict[int, StreamSpec] = {}  # tagged before the stream existed
        self._round: dict[int, _Served] = {}  # what the packet being built was offered
        self._round_open = False
        self._queue_view = _QueueView(self)
        self._now = 0.0

    # -- the hook --------------------------------------------------------------------------

    @property  # type: ignore[override]
    def _streams_queue(self) -> _QueueView:
        return self._queue_view

    @_streams_queue.setter
    def _streams_queue(self, kept: list[QuicStream]) -> None:
        # aioquic assigns the streams it keeps after every packet, then extend()s with those
        # that sent (`_settle_round`). What it discarded it has popped from `_streams` too,
        # which is all the settling needs to know: nothing to keep here.
        pass

    def _settle_round(self, sent: list[QuicStream]) -> None:
        streams = self._streams
        for stream_id, served in self._round.items():
            if stream_id not in streams:  # aioquic discarded it: finished
                self._unscheduled.pop(stream_id, None)
                self._owned.pop(stream_id, None)
                self._first.pop(stream_id, None)
                self._ready.discard(stream_id)
                self._blocked.pop(stream_id, None)
                self.scheduler.remove(stream_id)
                cast(CountingRecovery, self._loss).forget(stream_id)
            elif served.popped:
                sent_bytes = served.stream.sender.highest_offset - served.start
                self.scheduler.requeue(stream_id, sent_bytes, self._now)
                if stream_id not in self._ready:
                    self.scheduler.park(stream_id)
        if self._round:
            self._round = {}
        self._round_open = False

    def _adopt(self, stream: QuicStream) -> None:
        stream_id = _id(stream)
        stream.sender.__class__ = _WatchedSender
        cast(_WatchedSender, stream.sender).connection = self
        stream.receiver.__class__ = _WatchedReceiver
        receiver = cast(_WatchedReceiver, stream.receiver)
        receiver.connection, receiver.stream = self, stream
        cast(_StreamTable, self._streams).credit_due(stream)
        if stream_is_unidirectional(stream_id):
            self._unscheduled[stream_id] = stream
            self._first[stream_id] = stream
            return
        self._owned[stream_id] = stream
        self.scheduler.add(stream_id, self._early_specs.pop(stream_id, DEFAULT_SPEC))
        self.scheduler.park(stream_id)  # until it has bytes to send, which _classify sees
        self._classify(stream_id, stream)

    def _service_order(self) -> Iterator[QuicStream]:
        if self._round_open:
            # aioquic's `finally` walks the queue a second time, after the packet is built, to
            # decide what it keeps: show it this round's streams, not a new round.
            yield from [served.stream for served in self._round.values()]
            return
        self._round_open = True
        # Control streams, and control frames and discards, are not bandwidth: they go first
        # whatever the order (a stream reset at its deadline has left the scheduler).
        for stream in list(self._first.values()):
            self._round[_id(stream)] = _Served(stream, stream.sender.highest_offset)
            yield stream
        # The scheduler's queue holds only the streams with bytes (the others are parked,
        # keeping their places: schedulers.py), so every pop is a stream to offer the packet.
        ready = self._ready
        while ready and (stream_id := self.scheduler.pop(self._now)) is not None:
            if stream_id in self._round:
                self._round[stream_id].popped = True
                continue
            stream = self._owned[stream_id]
            start = stream.sender.highest_offset
            self._round[stream_id] = _Served(stream, start, popped=True)
            if stream_id not in ready:
                # A stream queued with nothing to send would be a slip in the parking above
                # (`_classify`): counted, for the tests, and given back in its place unshown.
                self.skipped += 1
                continue
            next_offset = stream.sender.next_offset
            yield stream
            self._classify(stream_id, stream)
            if (stream.sender.highest_offset, stream.sender.next_offset) == (start, next_offset):
                if stream.sender.buffer_is_empty:
                    # It had nothing after all: aioquic clears `buffer_is_empty` only when it
                    # next asks a stream whose last bytes went out for a frame. Not a full
                    # packet; taken for one, the streams behind it waited a transmit each.
                    continue
                # It had bytes and the packet took none: the packet (or the connection's flow
                # control) is full. The streams not yet popped keep their places untouched, so
                # the scheduler's work per packet is O(streams served), not O(streams). (The
                # scan for `first` above, like aioquic's own stream-limits pass, still visits
                # every stream: a few attribute reads each.)
                return

    # -- the application's side ------------------------------------------------------------

    def set_stream_spec(self, stream_id: int, spec: StreamSpec) -> None:
        """Tag a stream with its class's priority and deadline. A server learns the class from
        the request headers, after the stream exists; a client tags a stream before it sends."""
        if stream_id in self.scheduler:
            self.scheduler.update(stream_id, spec)
        elif stream_id not in self._owned:  # not yet created; an expired stream stays untagged
            self._early_specs[stream_id] = spec

    datagram_allowance = 0
    """Bytes by which packets may exceed the congestion window while DATAGRAM frames wait for
    it; 0 (the default) keeps RFC 9221 §5.4, which puts datagrams under congestion control.

    Eloquent's datagrams are application-limited (one per token, about a hundred bytes) and
    each one supersedes the last, and after a burst of loss QUIC's window sits at its minimum
    behind packets that are lost but not yet declared so, for a probe timeout or more: the
    datagrams meant to bridge the burst wait behind the very losses they were sent to bridge.
    Chatterbox ran over RTP, with no congestion control at all. A server that sets this lets
    them through with a bounded excess: ours grants one packet (`eloquent.DATAGRAM_ALLOWANCE`)
    to a connection once it carries Eloquent, measured on and off in `experiments.eloquent_sim`."""

    def _scan(self) -> None:
        """Before a batch of packets: the streams waiting for more streams to be allowed may
        have been unblocked (aioquic clears `is_blocked` in its MAX_STREAMS handler, which has
        no hook), and those shown first may be done with."""
        for stream_id, stream in list(self._blocked.items()):
            self._classify(stream_id, stream)
        for stream_id, stream in list(self._first.items()):
            if not self._due_first(stream_id, stream):
                del self._first[stream_id]
        self.scanned += len(self._blocked) + len(self._first)

    ack_every = 1
    """Acknowledge once this many packets have come since the last ACK, or one that ends a
    stream, else `ack_delay` after the first of them. aioquic's own policy is 1 and 1 ms: an
    ACK for nearly every packet of a token stream, each one a datagram its sender must decrypt
    and process. RFC 9000 13.2.2 recommends 2; browsers' stacks do 2 or more. The client sets 2
    (`transport.client`)."""
    ack_delay = 0.025
    """Seconds: the longest an ACK is held under `ack_every`; the max_ack_delay that aioquic
    announces in its transport parameters, so the peer's loss timers allow for it."""
    _ack_first_at: float | None = None
    _acked_largest = -1

    reset_key: ResetKey | None = None
    """Where set (a server's connections: `ResettingQuicServer`), the stateless-reset tokens of
    the connection IDs this end issues come from it, not from aioquic's `os.urandom`."""

    def sign_connection_ids(self) -> None:
        """Give every connection ID this end has issued, or will, its token from `reset_key`.
        Before the first datagram: the first ID's token goes out in the transport parameters.
        Upstream aioquic would need a token function in QuicConfiguration instead."""
        if self.reset_key is not None:
            for issued in self._host_cids:
                issued.stateless_reset_token = self.reset_key.token(issued.cid)

    def _replenish_connection_ids(self) -> None:
        # aioquic issues more IDs (NEW_CONNECTION_ID) once the handshake is done, each with a
        # random token; they are signed before any frame carries them.
        super()._replenish_connection_ids()
        self.sign_connection_ids()

    _elicited = False
    _ended_stream = False

    def receive_datagram(self, data: bytes, addr: Any, now: float) -> None:
        if is_reset(data, self._peer_cid.stateless_reset_token):
            # Checked before decryption, which RFC 9000 10.3.1 allows: a datagram that could
            # be decrypted ends in its 16-byte tag, which matches the token by chance 2^-128.
            # Upstream aioquic would check where a datagram fails to decrypt.
            self._reset()
            return
        self._elicited = self._ended_stream = False
        lost = cast(CountingRecovery, self._loss).lost
        super().receive_datagram(data, addr, now)
        if self._state is QuicConnectionState.DRAINING and not self._handshake_complete:
            # Closed by the server before the handshake, as a stand-in refuses a connection
            # (`transport.stateless_reset`): there is nothing to drain, and aioquic's 3 PTOs
            # of draining would hold the client's ConnectionRefused back for about a second.
            # Upstream aioquic would end such a connection in its close-frame handler.
            self._close_end()
        if self.ack_every > 1 and self._handshake_confirmed:
            self._hold_ack(now)
        self.reply_due = bool(
            self._elicited
            or cast(CountingRecovery, self._loss).lost != lost
            or not self._handshake_confirmed
            or self._state != QuicConnectionState.CONNECTED
            or self._first
            or self._ready
            or self._blocked
            or self._datagrams_pending
            or cast(_StreamTable, self._streams).credit
        )

    def _reset(self) -> None:
        """The peer reset the connection: end it now, sending nothing more (RFC 9000 10.3.1:
        the draining period is for a peer that still has state)."""
        if self._state in (QuicConnectionState.CLOSING, QuicConnectionState.DRAINING,
                           QuicConnectionState.TERMINATED):  # fmt: skip
            return
        self._close_event = StatelessReset(
            error_code=QuicErrorCode.NO_ERROR, frame_type=None, reason_phrase="stateless reset"
        )
        self._close_end()
        self.reply_due = False

    reply_due = True
    """Whether the last datagram received may have left something to send at once. Not after
    one that held only ACKs (and padding) on an established connection, declared nothing
    lost and left no stream anything to send: most of a server's datagrams, its clients'
    ACKs of the tokens it sent (47k datagrams received against 107k transmits at 96 req/s on
    paper-4gpu-sim, each of which transmitted). An ACK due for what came is sent by the timer;
    what the ACK made of streams, losses and flow control is in the sets above."""

    def _payload_received(
        self, context: Any, plain: bytes, crypto_frame_required: bool = False
    ) -> tuple[bool, bool]:
        result = super()._payload_received(
            context, plain, crypto_frame_required=crypto_frame_required
        )
        self._elicited = self._elicited or result[0]
        return result

    def _hold_ack(self, now: float) -> None:
        space = self._spaces[tls.Epoch.ONE_RTT]
        if space.ack_at is None:
            self._ack_first_at = None
            return
        if self._ack_first_at is None:
            self._ack_first_at = now
        # Packet numbers, not packets: a gap (a loss, or reordering) acknowledges at once too,
        # as RFC 9000 13.2.1 wants for packets received out of order. So does the end of a
        # stream: a client that reads a response and closes would otherwise close before its
        # ACK of the last packet went out, and the server never learns the response arrived.
        if (
            self._ended_stream
            or space.largest_received_packet - self._acked_largest >= self.ack_every
        ):
            space.ack_at = now
        else:
            space.ack_at = self._ack_first_at + self.ack_delay

    def _write_ack_frame(self, builder: Any, space: Any, now: float) -> None:
        super()._write_ack_frame(builder, space, now)
        one_rtt = self._spaces.get(tls.Epoch.ONE_RTT)
        if one_rtt is not None and space is one_rtt:
            self._acked_largest = one_rtt.largest_received_packet
            self._ack_first_at = None

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        self._expire(now)
        self._scan()
        sent = super().datagrams_to_send(now)
        if self.datagram_allowance and self._datagrams_pending:
            cc = self._loss._cc  # aioquic has no hook for this; its controller keeps the window
            cc.congestion_window += self.datagram_allowance
            try:
                sent += super().datagrams_to_send(now)
            finally:
                cc.congestion_window -= self.datagram_allowance
        return sent

    def handle_timer(self, now: float) -> None:
        # get_timer() asks to wake at the next deadline, so expiry happens here, where the
        # caller processes the events next, and not only when a packet is due anyway.
        self._expire(now)
        super().handle_timer(now)

    def _expire(self, now: float) -> None:
        self._now = now
        for stream_id in self.scheduler.expired(now):
            if stream_id not in self._owned:
                continue
            stream = self._owned[stream_id]
            if not self.send_acknowledged(stream_id):
                self.reset_stream(stream_id, EXPIRED_ERROR)
            if not stream.receiver.is_finished:
                self.stop_stream(stream_id, EXPIRED_ERROR)
            self._events.append(StreamExpired(stream_id=stream_id))

    def get_timer(self) -> float | None:
        timer = super().get_timer()
        deadline = self.scheduler.next_deadline()
        if deadline is not None and (timer is None or deadline < timer):
            return deadline
        return timer


def _id(stream: QuicStream) -> int:
    # Optional in aioquic's type for its crypto streams, which never reach the stream queue.
    assert stream.stream_id is not None
    return stream.stream_id


@dataclass(slots=True)
class _Served:
    stream: QuicStream
    start: int  # the stream's highest sent offset before this packet
    popped: bool = False


class _QueueView:
    """What `_streams_queue` returns: iterates in the scheduler's order; `append` adopts."""

    def __init__(self, connection: ScheduledQuicConnection) -> None:
        self._connection = connection

    def __iter__(self) -> Iterator[QuicStream]:
        return self._connection._service_order()

    def append(self, stream: QuicStream) -> None:
        self._connection._adopt(stream)

    def extend(self, sent: list[QuicStream]) -> None:
        self._connection._settle_round(sent)


def adopt(connection: QuicConnection, scheduler: Scheduler | str) -> ScheduledQuicConnection:
    """Turn a freshly made QuicConnection into a ScheduledQuicConnection.

    aioquic's server makes its connections by the module-global name `QuicConnection` (aioquic
    1.7.2's asyncio/server.py), so the only ways in are this, patching that global for every server
    in the process, or a copy of its 150-line datagram router. The connection has processed nothing
    yet, so swapping its class and moving its (empty) stream queue over is safe."""
    if connection._streams:
        raise ValueError("adopt() needs a connection that has no streams yet")
    del connection.__dict__["_streams_queue"]
    connection.__class__ = ScheduledQuicConnection
    connection._loss.__class__ = CountingRecovery
    assert isinstance(connection, ScheduledQuicConnection)
    connection._init_scheduling(scheduler)
    connection._track_streams()
    return connection


class CoalescingProtocol(QuicConnectionProtocol):
    """`transmit_soon()` sends once per event-loop pass, however many writes (and datagrams
    received) asked for it, and, with a `flush_interval`, at most once per interval while the
    connection is busy.

    Every `transmit()` builds packets, and building one walks every stream of the connection, so
    transmitting after each of a thousand small writes costs a thousand walks where one does.

    Once per pass is not once per packet's worth of data: token events come from many engine
    steps a millisecond apart, and each pass sent them in a packet of their own (1.5 writes per
    transmit, 3.4 tokens per packet, at 96 req/s on paper-4gpu-sim over 8 connections). The
    interval is the Nagle delay of this transport, bounded: a transmit asked for within the
    interval after the last one waits for the interval's end, so a busy connection's packets
    each carry an interval's tokens, and its peer acknowledges fewer packets; the first write
    after a quiet spell still goes out in the next pass."""

    _transmit_pending = False
    _last_transmit = float("-inf")
    flush_interval = 0.0
    """Seconds; 0 sends in the next pass, always."""

    def transmit_soon(self) -> None:
        if not self._transmit_pending:
            self._transmit_pending = True
            at = self._last_transmit + self.flush_interval
            if at > self._loop.time():
                self._loop.call_at(at, self._transmit_now)
            else:
                self._loop.call_soon(self._transmit_now)

    def _transmit_now(self) -> None:
        self._transmit_pending = False
        self.transmit()

    def transmit(self) -> None:
        # aioquic's transmit, with the datagrams handed over in one call, so that a transport of
        # ours sends a run to one peer in one syscall (`transport.udp`).
        self._transmit_task = None
        self._last_transmit = now = self._loop.time()
        datagrams = self._quic.datagrams_to_send(now=now)
        if datagrams:
            send_all(udp_transport(self), datagrams)
        self._arm_timer()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic's own transmits after every datagram. Most of them are the peer's ACKs of
        # what was just sent (aioquic's client acknowledges every packet), so at a few thousand
        # token events a second that was one full walk of the streams per ACK on top of one
        # per write (profiled at 48 req/s on paper-4gpu-sim: 14% of the server's samples).
        quic = cast(ScheduledQuicConnection, self._quic)
        quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        self._process_events()
        if quic.reply_due:
            self.transmit_soon()
        elif not self._transmit_pending:
            self._arm_timer()  # the ACK moved the loss-detection timer

    def _arm_timer(self) -> None:
        """Set the timer to the connection's, as aioquic's transmit() does after sending."""
        timer_at = self._quic.get_timer()
        if self._timer is not None and self._timer_at != timer_at:
            self._timer.cancel()
            self._timer = None
        if self._timer is None and timer_at is not None:
            self._timer = self._loop.call_at(timer_at, self._handle_timer)
        self._timer_at = timer_at


def udp_transport(endpoint: QuicConnectionProtocol | QuicServer) -> asyncio.DatagramTransport:
    """The socket's transport of a connection or server that aioquic's `connect` or `serve` has
    set up; aioquic types it optional, as it is until the socket is bound."""
    transport = endpoint._transport
    assert transport is not None
    return transport


class ResettingQuicServer(QuicServer):
    """aioquic's server, with stateless resets (`transport.stateless_reset`): its connections'
    tokens derive from `reset_key`, and a short-header packet for a connection ID it does not
    know is answered with a reset, where aioquic drops it.

    Its connections must be `ScheduledQuicConnection`s (`create_protocol` adopts them), which
    sign the IDs they issue. Upstream aioquic would need a hook in `QuicServer` for datagrams
    whose connection ID it does not know, which it drops now."""

    def __init__(
        self, *, reset_key: ResetKey, create_protocol: Callable[..., Any], **options: Any
    ) -> None:
        def signed(connection: QuicConnection, **kwargs: Any) -> Any:
            protocol = create_protocol(connection, **kwargs)
            quic = protocol._quic
            if not isinstance(quic, ScheduledQuicConnection):
                raise TypeError("a ResettingQuicServer's create_protocol must adopt() its QUIC")
            quic.reset_key = reset_key
            quic.sign_connection_ids()
            return protocol

        super().__init__(create_protocol=signed, **options)
        cid_length = self._configuration.connection_id_length
        self.responder = ResetResponder(reset_key, cid_length)
        self._cid_end = 1 + cid_length

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        data = cast(bytes, data)
        if is_short_header(data) and data[1 : self._cid_end] not in self._protocols:
            reset = self.responder.reset(data, self._loop.time())
            if reset is not None:
                udp_transport(self).sendto(reset, addr)
            return
        super().datagram_received(data, addr)


async def serve_quic(
    host: str,
    port: int,
    sock: socket.socket | None = None,
    reset_key: ResetKey | None = None,
    **server_options: Any,
) -> QuicServer:
    """aioquic's `serve` on a `transport.udp` transport: aioquic's takes no transport of ours.
    On `sock` where given (a UDP socket bound to `host:port`), else on one bound here. With a
    `reset_key`, a `ResettingQuicServer`. `server_options` are QuicServer's."""
    server = (
        QuicServer(**server_options)
        if reset_key is None
        else ResettingQuicServer(reset_key=reset_key, **server_options)
    )
    if sock is None:
        await open_udp(server, host, port)
    else:
        BatchedDatagramTransport(asyncio.get_running_loop(), sock, server)
    return server


CONNECT_TRIES = 16
"""Handshakes `connect_quic` tries while the server refuses them. A server of ours refuses only
where another process may take the connection (a dead worker's stand-in, `transport.workers`),
and each try goes out from a new port, hashed afresh over the workers: with one of two workers
down, 16 refusals in a row come once in 65,536 connections."""


@contextlib.asynccontextmanager
async def connect_quic(
    host: str,
    port: int,
    *,
    configuration: QuicConfiguration,
    create_protocol: Callable[..., QuicConnectionProtocol],
) -> AsyncIterator[QuicConnectionProtocol]:
    """aioquic's `connect` (waiting for the handshake) on a `transport.udp` transport. The socket
    is bound in the server address's own family, where aioquic's binds a dual-stack one. A
    server that refuses the connection (CONNECTION_REFUSED) is tried again at once from a new
    socket, up to CONNECT_TRIES in all; then ConnectionRefusedError."""
    loop = asyncio.get_running_loop()
    family, _, _, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM))[0]
    if configuration.server_name is None:
        configuration.server_name = host
    refusals_left = CONNECT_TRIES - 1
    while True:
        try:
            protocol, transport = await _handshake(family, address, configuration, create_protocol)
            break
        except ConnectionRefusedError:
            if not refusals_left:
                raise
            refusals_left -= 1
    try:
        yield protocol
    finally:
        await _close(protocol, transport)


async def _handshake(
    family: int,
    address: Any,
    configuration: QuicConfiguration,
    create_protocol: Callable[..., QuicConnectionProtocol],
) -> tuple[QuicConnectionProtocol, BatchedDatagramTransport]:
    """One connection, from a socket of its own, once its handshake is done."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
    except OSError:
        sock.close()
        raise
    widen_receive_buffer(sock)
    protocol = create_protocol(QuicConnection(configuration=configuration))
    transport = BatchedDatagramTransport(asyncio.get_running_loop(), sock, protocol)
    try:
        protocol.connect(address)
        await protocol.wait_connected()
    except BaseException as exc:
        await _close(protocol, transport)
        closed = protocol._quic._close_event
        if closed is not None and closed.error_code == QuicErrorCode.CONNECTION_REFUSED:
            raise ConnectionRefusedError(
                f"QUIC connection to {address[0]}:{address[1]} refused: {closed.reason_phrase}"
            ) from exc
        raise
    return protocol, transport


async def _close(protocol: QuicConnectionProtocol, transport: BatchedDatagramTransport) -> None:
    protocol.close()
    await protocol.wait_closed()
    transport.close()
