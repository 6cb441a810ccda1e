"""The one glue between Eloquent's sans-IO endpoints and an HTTP/3 response stream.

The server (`transport.http3`), the client (`transport.client`) and the virtual-time experiment
(`experiments.eloquent_sim`) all drive the endpoints through these two lanes, so the simulation
frames exactly what the server frames. A lane is told what the stream carried and which datagrams
came; it hands payloads to `send` and keeps the endpoint's timer armed on a `Clock`: the event
loop live, the simulated link's clock in virtual time.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from aioquic.h3.connection import H3Connection
from aioquic.quic.connection import QuicConnection

from transport.eloquent.endpoints import EloquentReceiver, EloquentSender
from transport.eloquent.sse import SseEvents
from transport.eloquent.wire import Ack, EloquentFormatError, decode_message


class Clock(Protocol):
    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Any:
        """Call `callback` at `when`; what it returns may have a `cancel()`."""


logger = logging.getLogger(__name__)


def datagram_sender(
    quic: QuicConnection,
    h3: H3Connection,
    stream_id: int,
    transmit: Callable[[], None] = lambda: None,
) -> Callable[[bytes], None]:
    """A lane's `send`: HTTP/3 datagrams on the stream, where a newer payload replaces an older
    one still waiting in aioquic's queue if it carries everything that one did.

    aioquic queues datagrams in order behind the congestion window; after a burst of loss the
    window sits shut for a probe timeout or more, and every datagram Eloquent sends meanwhile
    would wait there, stale, in front of the ones that matter. RFC 9221 §5.4 lets a sender drop
    a datagram instead of delaying it. Measured in virtual time (`experiments.eloquent_sim`),
    a hundred stale datagrams once filled every probe, so the stream's retransmissions never
    fitted and the connection died of its backed-off probe timeout."""
    queued: list[tuple[bytes, frozenset[object]]] = []

    def send(payload: bytes) -> None:
        carries = _carries(payload)
        queued[:] = [
            (frame, keys)
            for frame, keys in queued
            if not (keys <= carries and withdraw(quic, frame)) and _waiting(quic, frame)
        ]
        h3.send_datagram(stream_id, payload)
        queued.append((quic._datagrams_pending[-1], carries))
        transmit()

    return send


def _waiting(quic: QuicConnection, frame: bytes) -> bool:
    return any(waiting is frame for waiting in quic._datagrams_pending)


def withdraw(quic: QuicConnection, frame: bytes) -> bool:
    """Take one DATAGRAM frame (by identity) out of aioquic's send queue, if it is still there;
    aioquic has no API for it. True if it was."""
    pending = quic._datagrams_pending
    for i, waiting in enumerate(pending):
        if waiting is frame:
            del pending[i]
            return True
    return False


def _carries(payload: bytes) -> frozenset[object]:
    """What a payload tells the peer: its entries, or (for an ACK) the receiver's state, which
    any later ACK tells too."""
    try:
        message = decode_message(payload)
    except EloquentFormatError:
        return frozenset({object()})  # never superseded
    if isinstance(message, Ack):
        return frozenset({"ack"})
    return frozenset((entry.position, entry.offset) for entry in message.entries)


class _Timed:
    """Keeps one call pending for an endpoint's `timer()`, and sends what `on_timer` returns."""

    def __init__(
        self,
        endpoint: EloquentSender | EloquentReceiver,
        send: Callable[[bytes], None],
        clock: Clock,
    ) -> None:
        self._endpoint = endpoint
        self._send = send
        self.clock = clock
        self._handle: Any = None
        self._due: float | None = None

    def send(self, payloads: list[bytes]) -> None:
        for payload in payloads:
            self._send(payload)

    def arm(self) -> None:
        due = self._endpoint.timer()
        if due == self._due:
            return
        self.disarm()
        if due is not None:
            self._due = due
            self._handle = self.clock.call_at(due, lambda: self._fire(due))

    def disarm(self) -> None:
        self._due = None
        if self._handle is not None and hasattr(self._handle, "cancel"):
            self._handle.cancel()
        self._handle = None

    def _fire(self, due: float) -> None:
        if due != self._due:
            return  # superseded: a clock without cancel() still calls it
        self._handle = self._due = None
        self.send(self._endpoint.on_timer(self.clock.time()))
        self.arm()


class SenderLane(_Timed):
    """The server's end: cuts the response body into events and sends each one's datagram.

    `rtt` reads the connection's smoothed RTT for the sender's repeat window (None: unknown).
    `on_done` runs once nothing will be sent again: everything acknowledged, given up, closed."""

    def __init__(
        self,
        sender: EloquentSender,
        send: Callable[[bytes], None],
        clock: Clock,
        rtt: Callable[[], float | None] = lambda: None,
        on_done: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(sender, send, clock)
        self.sender = sender
        self._rtt = rtt
        self._on_done = on_done
        self._events = SseEvents()
        self._closed = False

    def body(self, data: bytes, ended: bool) -> None:
        """The stream carried `data`; `ended`: it was the last."""
        if self._closed:
            return
        self.sender.rtt = self._rtt()
        now = self.clock.time()
        for event in self._events.feed(data):
            self.send(self.sender.on_event(event, now))
        if ended:
            self.sender.finish()
        self.arm()

    def datagram(self, payload: bytes) -> None:
        """An ACK from the client. A malformed one is counted by the sender and dropped."""
        if self._closed:
            return
        self.sender.rtt = self._rtt()
        try:
            self.sender.on_ack(payload, self.clock.time())
        except ValueError as exc:  # a confused or hostile client; the stream still delivers
            if self.sender.stats.bad_acks == 1:  # one line a lane: a flood must not flood the log
                logger.info("Eloquent ACK dropped (later ones only counted): %s", exc)
            return
        self.arm()

    def close(self) -> None:
        """The stream was reset or the connection closed: stop now."""
        if not self._closed:
            self.sender.close()
            self.arm()

    def arm(self) -> None:
        """Keep the sender's timer armed, or end the lane once nothing will be sent again."""
        sender = self.sender
        sender.rtt = self._rtt()
        if sender.done or (sender.finished and sender.timer() is None):
            self._closed = True
            self.disarm()
            if sender.stats.bad_acks > 1:
                logger.info("Eloquent lane ended with %d ACKs dropped", sender.stats.bad_acks)
            self._on_done()
        else:
            super().arm()


class ReceiverLane(_Timed):
    """The client's end: renders the response from the stream and the datagrams, whichever is
    first, and hands `deliver` the body's bytes in order: the stream's bytes exactly, sooner.

    Until `activate()` (the response said it carries Eloquent), rendered events wait."""

    def __init__(
        self,
        receiver: EloquentReceiver,
        send: Callable[[bytes], None],
        clock: Clock,
        deliver: Callable[[bytes], None],
    ) -> None:
        super().__init__(receiver, send, clock)
        self.receiver = receiver
        self._deliver = deliver
        self._events = SseEvents()
        self.active = False
        self.streamed = 0
        """Events the stream has delivered so far."""
        self._delivered = 0
        self._stream_digest = hashlib.sha256()
        self._body_digest = hashlib.sha256()

    def activate(self) -> None:
        self.active = True
        self._flush()

    def stream(self, data: bytes) -> None:
        self._stream_digest.update(data)
        now = self.clock.time()
        for event in self._events.feed(data):
            self.send(self.receiver.on_stream_event(self.streamed, event, now))
            self.streamed += 1
        self._flush()

    def datagram(self, payload: bytes) -> None:
        self.send(self.receiver.on_datagram(payload, self.clock.time()))
        self.arm()
        self._flush()

    def end(self) -> None:
        """The stream ended: what follows its last whole event goes out as it is."""
        self.disarm()
        if rest := self._events.rest():
            self._hand(rest)

    @property
    def matches_stream(self) -> bool:
        """The body handed out so far is the stream's, byte for byte (check after `end`)."""
        return self._stream_digest.digest() == self._body_digest.digest()

    def _flush(self) -> None:
        if not self.active:
            return
        while self._delivered < self.receiver.next_event:
            self._hand(self.receiver.event_of(self._delivered))
            self._delivered += 1

    def _hand(self, data: bytes) -> None:
        self._body_digest.update(data)
        self._deliver(data)
