"""Eloquent's sender and receiver for one response, sans-IO (Chatterbox's Algorithms 1 and 2).

Nothing here touches a socket or a clock: every method that needs the time takes `now` (seconds,
never decreasing), in the manner of aioquic's QuicConnection, so the same logic runs on the
event loop and in virtual time. Both own their timers the same way: `timer()` says when
`on_timer(now)` wants calling, and every call returns the datagram payloads to send now.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

from aioquic.buffer import size_uint_var

from transport.eloquent.sse import decode_text, split_text
from transport.eloquent.wire import (
    DEFAULT_MAX_PAYLOAD,
    EVENT,
    MAX_ACK_POSITIONS,
    TEXT,
    TEXT_ONLY,
    Ack,
    EloquentFormatError,
    Envelope,
    TokenEntry,
    Tokens,
    decode_message,
)

MAX_ENVELOPES = 4
"""Envelopes one response opens at most: a chat stream needs three (the first chunk names the
role, the middle ones differ only in their text, the last names its finish reason). An event
whose surroundings change every time (one carrying logprobs) would otherwise cost an envelope
each; past this it travels as its text only, and its whole event by the stream."""

_MIN_PAYLOAD = 64
"""Below this a fragment would carry little but framing; refuse such configurations."""

_L_HISTORY_S = 10.0
"""How far back the sender looks for the longest silence between ACKs (its estimate of L)."""


@dataclass
class SenderStats:
    """What the sender handed out."""

    entries: list[int] = field(default_factory=list)
    """Entries in each datagram, in order: the tokens a packet carried."""
    timer_datagrams: int = 0
    """Datagrams sent by `on_timer` (re-sends with no new event)."""
    bad_acks: int = 0
    """ACKs dropped: malformed, or naming positions never sent."""


@dataclass
class _Pending:
    """One unacknowledged entry (or fragment), with what it takes to send it another way."""

    entry: TokenEntry
    envelope: Envelope | None
    """The envelope a TEXT entry is rebuilt with."""
    event: bytes
    generated: float


class EloquentSender:
    """Builds the datagram payloads for one response; the caller sends them and feeds back ACKs.

    Each event of the response goes out at once, as its text (the envelope around it travels
    until the receiver reports holding it), together with as many earlier unacknowledged
    entries as fit, oldest first (§3.2). Choices where the paper leaves room:
    - Room, not a count: with token-sized entries a datagram holds a hundred, so by default
      (`max_repeats=None`) only the payload limit caps the repeats. `max_repeats=9` is the
      paper's 10 tokens a packet, the new one included.
    - Window: with the path's RTT known (`rtt`), only entries generated within the last
      2·RTT + L are repeated, L being the longest silence between ACKs over the last 10 s, or
      the present one if longer. That is §3.3's condition read the other way: an older
      entry's stream copy has been retransmitted by now, so repeating it costs room and helps
      nothing.
    - Tail re-sends (`tail_resend`): while ACKs are missing (the oldest unacknowledged entry
      is older than 1.25·RTT + `tail_interval`), the unacknowledged entries go again every
      `tail_interval`, even while new events flow. In a lossy burst each packet is one more
      draw against the loss; a new event comes only once per token. Without it, as Algorithm
      1, only `resend_after` with no new event at all re-sends them.
    - Coalescing (`min_gap`): an event that comes sooner than `min_gap` (or a sixth of the RTT, if
      longer) after the last datagram with a new event waits for the timer, and goes with the
      ones that come meanwhile.
      An engine that streams a hundred tokens a second would otherwise send a hundred
      datagrams, each repeating everything unacknowledged, where the paper's ten a second
      was the premise.
    - `envelopes`: how many envelopes a response may open (MAX_ENVELOPES); 0 sends whole
      events, as the first sender did.
    - Oversize entries are cut into fragments of the same position, each in its own datagram;
      the position is acknowledged only whole, so a lost fragment repeats all of them.
    - Ending: `finish()` says no event follows; re-sending goes on until everything is
      acknowledged, but stops after `give_up_after` seconds without an ACK or a new event (a
      client that ignores datagrams is not fed forever); `close()` stops at once.
    """

    def __init__(
        self,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_repeats: int | None = None,
        resend_after: float = 0.2,
        give_up_after: float | None = 5.0,
        window: bool = True,
        tail_resend: bool = True,
        tail_interval: float = 0.05,
        min_gap: float = 0.05,
        envelopes: int = MAX_ENVELOPES,
    ) -> None:
        if max_payload < _MIN_PAYLOAD:
            raise ValueError(f"max_payload must be at least {_MIN_PAYLOAD} bytes")
        if max_repeats is not None and max_repeats < 0:
            raise ValueError("max_repeats must be >= 0 or None")
        if resend_after <= 0:
            raise ValueError("resend_after must be > 0")
        self.max_payload = max_payload
        self.max_repeats = max_repeats
        self.resend_after = resend_after
        self.give_up_after = give_up_after
        self.window = window
        self.tail_resend = tail_resend
        self.tail_interval = tail_interval
        self.min_gap = min_gap
        self.max_envelopes = envelopes
        self.rtt: float | None = None
        """The path's smoothed RTT, kept current by whoever drives this; None: unknown."""
        self.stats = SenderStats()
        # Unacknowledged entries keyed (position, offset). Entries are only ever added at higher
        # keys, so insertion order is oldest first and iteration needs no sort.
        self._unacked: dict[tuple[int, int], _Pending] = {}
        self._envelopes: list[Envelope] = []
        self._peer_envelope: int | None = None
        self._next_position = 0
        self._first_send: float | None = None
        self._last_send: float | None = None
        self._last_tail = float("-inf")
        self._last_send_new = float("-inf")  # the last datagram with a new event
        self._waiting: _Pending | None = None  # the newest event, held for `min_gap`
        self._last_heard: float | None = None  # last new event or ACK: the path is alive
        self._last_ack: float | None = None
        # The gaps between ACKs that began within _L_HISTORY_S, as (start, length), each
        # longer than every later one: the first is the longest (a sliding-window maximum).
        self._gaps: deque[tuple[float, float]] = deque()
        self._finished = False
        self._closed = False

    @property
    def next_position(self) -> int:
        return self._next_position

    @property
    def unacked_positions(self) -> list[int]:
        """Positions sent and not yet acknowledged, ascending."""
        return sorted({position for position, _ in self._unacked})

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def done(self) -> bool:
        """Finished and everything acknowledged, or closed: nothing will be sent again."""
        return self._closed or (self._finished and not self._unacked)

    def repeat_window(self, now: float) -> float | None:
        """How far back repeats reach now, in seconds: 2·RTT + L; None: no limit."""
        if not self.window or self.rtt is None:
            return None
        heard = self._last_ack if self._last_ack is not None else self._first_send
        present = now - heard if heard is not None else 0.0
        self._forget_gaps(now)
        longest = self._gaps[0][1] if self._gaps else 0.0
        return 2 * self.rtt + max(longest, present)

    def _forget_gaps(self, now: float) -> None:
        while self._gaps and self._gaps[0][0] < now - _L_HISTORY_S:
            self._gaps.popleft()

    def on_event(self, event: bytes, now: float) -> list[bytes]:
        """Take the response's next event; return the payloads to send now."""
        if self._finished or self._closed:
            raise RuntimeError("on_event after finish() or close()")
        event = bytes(event)
        event.decode("utf-8")  # raises UnicodeDecodeError (a ValueError) before any state
        position = self._next_position
        self._next_position += 1
        kind, data, envelope = self._entry_of(position, event)
        pieces = [
            _Pending(piece, envelope, event, now)
            for piece in self._split(TokenEntry(position, data, kind), envelope)
        ]
        if self._first_send is None:
            self._first_send = now
        self._last_heard = now
        if len(pieces) == 1 and now < self._last_send_new + self._gap():
            # Too soon after the last: it goes with the next datagram, on the timer at most
            # `min_gap` from the last one, together with whatever else comes meanwhile.
            self._unacked[(position, 0)] = self._waiting = pieces[0]
            return []
        # Pack before adding the new pieces, so a fragmented entry does not repeat its own
        # fragments in the datagrams of the same call.
        messages = [self._pack_new(piece, now) for piece in pieces]
        for piece in pieces:
            self._unacked[(position, piece.entry.offset)] = piece
        self._last_send = self._last_send_new = now
        return self._emit(messages)

    def on_ack(self, payload: bytes, now: float) -> None:
        """Forget every entry of the positions the receiver says it holds. A malformed ACK, or
        one naming positions never sent, raises EloquentFormatError and changes nothing."""
        try:
            message = decode_message(payload)
            if not isinstance(message, Ack):
                raise EloquentFormatError("the sender expects ACK messages, got TOKENS")
            top = max((message.below - 1, *message.held))
            if top >= self._next_position:
                raise EloquentFormatError(f"an ACK for position {top}, never sent")
            if message.envelope is not None and all(
                e.position != message.envelope for e in self._envelopes
            ):
                raise EloquentFormatError(f"an ACK for envelope {message.envelope}, never sent")
        except EloquentFormatError:
            self.stats.bad_acks += 1
            raise
        if self._last_ack is not None:
            gap = now - self._last_ack
            while self._gaps and self._gaps[-1][1] <= gap:
                self._gaps.pop()
            self._gaps.append((self._last_ack, gap))
            self._forget_gaps(now)
        self._last_ack = now
        self._last_heard = now if self._last_heard is None else max(self._last_heard, now)
        if message.envelope is not None:
            self._peer_envelope = max(self._peer_envelope or 0, message.envelope)
        held = set(message.held)
        for key in [k for k in self._unacked if k[0] < message.below or k[0] in held]:
            del self._unacked[key]

    def timer(self) -> float | None:
        """When `on_timer` should next be called; None while there is nothing to re-send."""
        if self._closed or not self._unacked or self.max_repeats == 0:
            return None
        assert self._last_send is not None and self._last_heard is not None
        if self._waiting is not None:
            return self._last_send_new + self._gap()
        deadline = self._last_send + self.resend_after
        if self.tail_resend and self.rtt is not None:
            # Overdue: the oldest entry has had time for its ACK to come back and then some.
            oldest = next(iter(self._unacked.values())).generated
            overdue = oldest + 1.25 * self.rtt + self.tail_interval
            deadline = min(deadline, max(overdue, self._last_tail + self.tail_interval))
        if self.give_up_after is not None and deadline - self._last_heard > self.give_up_after:
            return None
        return deadline

    def on_timer(self, now: float) -> list[bytes]:
        """Re-send the oldest unacknowledged entries if their time came."""
        deadline = self.timer()
        if deadline is None or now < deadline:
            return []
        if (waiting := self._waiting) is not None:
            self._waiting = None
            del self._unacked[(waiting.entry.position, 0)]  # packed as the new one, not a repeat
            message = self._pack_new(waiting, now)
            self._unacked[(waiting.entry.position, 0)] = waiting
            self._last_send = self._last_send_new = now
            return self._emit([message])
        self._last_send = self._last_tail = now
        repeat = self._pack(None, now) if self._eligible(now) else None
        if repeat is None:
            return []
        self.stats.timer_datagrams += 1
        return self._emit([repeat])

    def finish(self) -> None:
        """No event follows; keep re-sending until everything is acknowledged."""
        self._finished = True

    def close(self) -> None:
        """Stop now: forget what is unacknowledged and never send again."""
        self._closed = True
        self._unacked.clear()

    def _gap(self) -> float:
        """The least time between datagrams with new events: `min_gap`, or a sixth of the RTT."""
        return max(self.min_gap, self.rtt / 6 if self.rtt is not None else 0.0)

    def _entry_of(self, position: int, event: bytes) -> tuple[int, bytes, Envelope | None]:
        cut = split_text(event) if self.max_envelopes > 0 else None
        if cut is None:
            return EVENT, event, None
        head, text, tail = cut
        current = self._envelopes[-1] if self._envelopes else None
        if current is not None and (current.head, current.tail) == (head, tail):
            return TEXT, text, current
        if len(self._envelopes) < self.max_envelopes:
            self._envelopes.append(Envelope(position, head, tail))
            return TEXT, text, self._envelopes[-1]
        return TEXT_ONLY, text, None

    def _split(self, whole: TokenEntry, envelope: Envelope | None) -> list[TokenEntry]:
        carried = envelope if self._needs(envelope) else None
        ref = envelope.position if envelope is not None else None
        if Tokens((whole,), ref, carried).wire_size() <= self.max_payload:
            return [whole]
        total = len(whole.data)
        # Framing of a message holding one fragment, every varint at its largest possible size
        # for this entry, so each fragment fits whatever its offset.
        framing = (
            Tokens((TokenEntry(whole.position, b"", whole.kind),), ref, carried).wire_size()
            + size_uint_var(self.max_payload << 3 | 7)
            + 2 * size_uint_var(total)
        )
        piece = self.max_payload - framing
        if piece < _MIN_PAYLOAD // 2 and envelope is not None:
            # The envelope leaves no room: the whole event goes, without it.
            return self._split(TokenEntry(whole.position, envelope.wrap(whole.data), EVENT), None)
        return [
            TokenEntry(whole.position, whole.data[at : at + piece], whole.kind, at, total)
            for at in range(0, total, piece)
        ]

    def _needs(self, envelope: Envelope | None) -> bool:
        """The receiver may not hold this envelope yet."""
        return envelope is not None and (
            self._peer_envelope is None or self._peer_envelope < envelope.position
        )

    def _eligible(self, now: float) -> list[_Pending]:
        window = self.repeat_window(now)
        return [
            pending
            for pending in self._unacked.values()
            if window is None or pending.generated >= now - window
        ]

    def _pack_new(self, new: _Pending, now: float) -> Tokens:
        message = self._pack(new, now)
        assert message is not None, "a new entry always fits its own datagram"
        return message

    def _pack(self, new: _Pending | None, now: float) -> Tokens | None:
        """One TOKENS message: `new` (if any) after the oldest repeatable entries that fit.

        A message names one envelope; its TEXT entries under another go whole. The envelope is
        the one most of them use, so that a new one (the last chunk's, which names its finish
        reason) costs one whole event, not every repeat beside it."""
        eligible = self._eligible(now)
        if new is not None and new.entry.is_fragment:
            envelope = new.envelope  # a fragment was cut to fit beside its own envelope
        else:
            used = Counter(
                p.envelope.position
                for p in (*eligible, *([new] if new is not None else []))
                if p.entry.kind == TEXT and p.envelope is not None
            )
            top = max(used.values(), default=0)
            newest = new.envelope.position if new is not None and new.envelope else None
            best = newest if newest is not None and used.get(newest) == top else max(
                (e for e, n in used.items() if n == top), default=None
            )  # fmt: skip
            envelope = next((e for e in self._envelopes if e.position == best), None)
        ref = envelope.position if envelope is not None else None
        carried = envelope if self._needs(envelope) else None
        tail: list[TokenEntry] = []
        if new is not None:
            entry = self._carried_as(new, envelope)
            assert entry is not None, "a fragment names its own envelope"
            tail.append(entry)
        chosen: list[TokenEntry] = []
        # Sizes kept as they grow (Tokens.wire_size's terms), not recomputed per candidate:
        # with a hundred unacknowledged tokens that was 5,000 entry sizes a datagram.
        header = Tokens((), ref, carried).wire_size() - size_uint_var(0)
        body, last = 0, None
        for pending in eligible:
            if self.max_repeats is not None and len(chosen) >= self.max_repeats:
                break
            repeat = self._carried_as(pending, envelope)
            if repeat is None:
                continue
            grown = body + repeat.wire_size(last)
            after = tail[0].wire_size(repeat.position) if tail else 0
            count = size_uint_var(len(chosen) + 1 + len(tail))
            if header + count + grown + after <= self.max_payload:
                chosen.append(repeat)
                body, last = grown, repeat.position
        if not chosen and not tail:
            return None  # nothing repeatable fits beside the envelope; the stream has it all
        entries = (*chosen, *tail)
        if ref is not None and not any(e.kind == TEXT for e in entries):
            ref = carried = None
        return Tokens(entries, ref, carried)

    def _carried_as(self, pending: _Pending, envelope: Envelope | None) -> TokenEntry | None:
        """The entry as a message under `envelope` can carry it; None: it cannot."""
        entry = pending.entry
        if entry.kind != TEXT or pending.envelope is envelope:
            return entry
        if entry.is_fragment:
            return None  # its envelope is another message's
        if len(self._envelopes) >= self.max_envelopes:
            # The envelopes churn (logprobs): its text only; its whole event comes by stream.
            return TokenEntry(entry.position, entry.data, TEXT_ONLY)
        return TokenEntry(entry.position, pending.event, EVENT)

    def _emit(self, messages: list[Tokens]) -> list[bytes]:
        payloads = [message.encode() for message in messages]
        for message, payload in zip(messages, payloads, strict=True):
            # A payload over the limit would not just be lost: aioquic 1.7.2 never sends it and
            # wedges every datagram behind it (checked on the development VM), so this is an
            # invariant, not a hope.
            assert len(payload) <= self.max_payload, (len(payload), self.max_payload)
            self.stats.entries.append(len(message.entries))
        return payloads


# --------------------------------------------------------------------------------------------
# Receiver

SOURCE_DATAGRAM = "datagram"
SOURCE_STREAM = "stream"

MAX_AHEAD = 1 << 16
"""Positions further than this past the rendered prefix are dropped: no response has a gap
that long, and holding them would let a hostile sender fill memory."""
MAX_ENTRY_BYTES = 1 << 20
"""A fragmented entry may claim at most this many bytes in all."""
MAX_ENVELOPES_HELD = 2 * MAX_ENVELOPES


@dataclass(frozen=True)
class RenderEvent:
    """One position's text becoming renderable."""

    position: int
    time: float
    source: str
    """Which path delivered it first: "datagram" or "stream"."""


@dataclass
class ReceiverStats:
    mismatches: int = 0
    """Positions whose datagram and stream copies differed; the stream's copy was kept."""
    dropped: int = 0
    """Datagrams or entries refused: malformed, an ACK, too far ahead, an entry not UTF-8."""
    text_only: int = 0
    """Positions a datagram gave the text of but not the event (no envelope for it)."""
    sizes: list[int] = field(default_factory=list)
    """Entries in each datagram taken: the tokens a packet carried."""
    with_envelope: int = 0
    """Datagrams that carried an envelope: the sender stops once an ACK says it arrived."""
    acks: int = 0

    @property
    def datagrams(self) -> int:
        """Datagrams taken (well-formed TOKENS messages)."""
        return len(self.sizes)


@dataclass
class _Held:
    text: str
    event: bytes | None
    source: str


@dataclass
class _Reassembly:
    kind: int
    total: int
    pieces: dict[int, bytes] = field(default_factory=dict)  # offset -> bytes


class EloquentReceiver:
    """Renders the longest contiguous prefix of positions from datagrams and the stream.

    Each position renders once, from whichever path delivers it first, and only after every
    position before it: no duplicates and no gaps (Algorithm 2). Two prefixes advance: the
    text (`next_position`, what a person sees) and whole events (`next_event`, what an OpenAI
    client reads), which differ only where a datagram could carry the text but not the event.
    The stream is the authority: if its copy differs from a datagram's, its copy is kept and
    `stats.mismatches` counts it. With `ack_delay`, datagrams that only fill the prefix in order
    are acknowledged together, at most `ack_delay` later; a gap, or a repeat of what the last ACK
    covered (so the sender missed it), is acknowledged at once. The default acknowledges every
    datagram at once, as Algorithm 2 does.
    """

    def __init__(self, ack_delay: float = 0.0) -> None:
        self.ack_delay = ack_delay
        self.events: list[RenderEvent] = []
        """Every position as its text became renderable, in position order."""
        self.stats = ReceiverStats()
        self._texts: list[str] = []
        self._events: list[bytes | None] = []  # by rendered position; None: text only so far
        self._next_event = 0
        self._held: dict[int, _Held] = {}  # complete, past a gap
        self._partial: dict[int, _Reassembly] = {}
        self._envelopes: dict[int, Envelope] = {}
        self._stream_next = 0
        self._ack_due: float | None = None
        self._acked_below = 0  # the last ACK's `below`

    @property
    def next_position(self) -> int:
        """The first position whose text is not yet renderable."""
        return len(self._texts)

    @property
    def next_event(self) -> int:
        """The first position whose whole event is not yet here."""
        return self._next_event

    def rendered(self) -> str:
        return "".join(self._texts)

    def render_times(self) -> list[float]:
        return [event.time for event in self.events]

    def text_of(self, position: int) -> str:
        return self._texts[position]

    def event_of(self, position: int) -> bytes:
        """The whole event at a position below `next_event`."""
        event = self._events[position]
        assert event is not None, position
        return event

    def on_datagram(self, payload: bytes, now: float) -> list[bytes]:
        """Take a TOKENS payload; return the ACK payloads to send now. Malformed or hostile
        input is dropped and counted (`stats.dropped`), and changes nothing."""
        try:
            message = decode_message(payload)
            if not isinstance(message, Tokens):
                raise EloquentFormatError("the receiver expects TOKENS messages, got an ACK")
        except EloquentFormatError:
            self.stats.dropped += 1
            return []
        self.stats.sizes.append(len(message.entries))
        self.stats.with_envelope += message.envelope is not None
        if message.envelope is not None and (
            message.envelope.position in self._envelopes
            or len(self._envelopes) < MAX_ENVELOPES_HELD
        ):
            self._envelopes[message.envelope.position] = message.envelope
        ref = message.envelope_ref
        envelope = self._envelopes.get(ref) if ref is not None else None
        before = len(self._texts)
        duplicate = False
        for entry in message.entries:
            if entry.position >= len(self._texts) + MAX_AHEAD:
                self.stats.dropped += 1
                continue
            held = self._known(entry.position)
            gives_event = entry.kind == EVENT or (entry.kind == TEXT and envelope is not None)
            if held is not None and (held.event is not None or not gives_event):
                # A repeat of what the last ACK already covered: that ACK was lost.
                duplicate |= entry.position < self._acked_below
                continue
            data = entry.data if not entry.is_fragment else self._reassemble(entry)
            if data is None:
                continue
            self._take(entry.position, entry.kind, data, envelope, held)
        self._render(now)
        in_order = not self._held and len(self._texts) > before
        if self.ack_delay > 0 and in_order and not duplicate:
            if self._ack_due is None:
                self._ack_due = now + self.ack_delay
            return []
        return [self._ack()]

    def on_stream_event(self, position: int, event: bytes, now: float) -> list[bytes]:
        """Take the stream's next event, which must be `position` (the stream is in order).

        Returns an ACK when the stream delivered a position that no datagram had, since the
        sender is then likely still repeating it."""
        if position != self._stream_next:
            raise ValueError(f"stream event {position} out of order: expected {self._stream_next}")
        event = bytes(event)
        self._stream_next += 1
        held = self._known(position)
        if held is None:
            self._held[position] = _Held(_text_of(event), event, SOURCE_STREAM)
            self._partial.pop(position, None)
            self._render(now)
            return [self._ack()]
        if held.event is not None and held.event != event:
            self.stats.mismatches += 1
        held.event, held.text = event, _text_of(event)
        if position < len(self._texts):
            self._texts[position] = held.text
            self._events[position] = event
            self._advance_events()
        return []

    def timer(self) -> float | None:
        return self._ack_due

    def on_timer(self, now: float) -> list[bytes]:
        if self._ack_due is None or now < self._ack_due:
            return []
        return [self._ack()]

    def _take(
        self, position: int, kind: int, data: bytes, envelope: Envelope | None, held: _Held | None
    ) -> None:
        if kind == EVENT:
            event: bytes | None = data
            text = _text_of(data)
        else:
            event = envelope.wrap(data) if kind == TEXT and envelope is not None else None
            text = decode_text(data)
            if event is None:
                self.stats.text_only += 1
        if held is not None:  # the text was here; now the event is too
            held.event = event
            if position < len(self._texts):
                self._events[position] = event
                self._advance_events()
            return
        self._held[position] = _Held(text, event, SOURCE_DATAGRAM)
        self._partial.pop(position, None)

    def _known(self, position: int) -> _Held | None:
        if position < len(self._texts):
            return _Held(self._texts[position], self._events[position], "")
        return self._held.get(position)

    def _reassemble(self, entry: TokenEntry) -> bytes | None:
        """Add a fragment; return the entry's bytes once all are here."""
        assert entry.total is not None
        if entry.total > MAX_ENTRY_BYTES:
            self.stats.dropped += 1
            return None
        partial = self._partial.get(entry.position)
        if partial is None or (partial.total, partial.kind) != (entry.total, entry.kind):
            # A different total means a different cut of the entry; start over with this one.
            partial = self._partial[entry.position] = _Reassembly(entry.kind, entry.total)
        partial.pieces.setdefault(entry.offset, entry.data)
        end = 0
        for offset in sorted(partial.pieces):
            if offset != end:
                return None  # a gap (or an overlap, which this sender never makes)
            end += len(partial.pieces[offset])
        if end != partial.total:
            return None
        data = b"".join(partial.pieces[offset] for offset in sorted(partial.pieces))
        del self._partial[entry.position]
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            self.stats.dropped += 1
            return None
        return data

    def _render(self, now: float) -> None:
        while (position := len(self._texts)) in self._held:
            held = self._held.pop(position)
            self._texts.append(held.text)
            self._events.append(held.event)
            self.events.append(RenderEvent(position, now, held.source))
        self._advance_events()

    def _advance_events(self) -> None:
        while self._next_event < len(self._events) and self._events[self._next_event] is not None:
            self._next_event += 1

    def _ack(self) -> bytes:
        self._ack_due = None
        self._acked_below = len(self._texts)
        held = tuple(heapq.nsmallest(MAX_ACK_POSITIONS, self._held))
        newest = max(self._envelopes, default=None)
        payload = Ack(len(self._texts), held, newest).encode()
        self.stats.acks += 1
        return payload


def _text_of(event: bytes) -> str:
    cut = split_text(event)
    return decode_text(cut[1]) if cut is not None else ""
