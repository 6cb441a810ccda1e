"""Eloquent token streaming, sans-IO: redundant HTTP/3 datagrams beside the reliable stream.

Seed 002 (Eloquent, NAIC '24; seed 000 is the same design under the name Chatterbox), §3: every
outgoing packet carries the newly generated tokens plus the earlier tokens not yet acknowledged,
so any packet that arrives can be rendered on its own and one lost packet does not hold back the
tokens behind it. Here the HTTP/3 response stream still carries every content delta, reliably
and in order; the datagrams are a fast path beside it. The receiver renders the longest
contiguous prefix from whichever copy of each position arrives first (Algorithm 2), so a lost
datagram costs nothing and a stalled stream costs only until a datagram carries the position.

A position is the index of a batch of tokens in the response, 0-based: position n is the n-th
content delta on the stream, so both paths name the same text by the same number.

Wire format: the HTTP/3 datagram payload after the quarter-stream-id, which
`H3Connection.send_datagram` prepends itself. Every integer is a QUIC varint (RFC 9000 §16).

    message = kind body                  kind: 0x01 TOKENS, 0x02 ACK
    TOKENS  = count entry{count}         count >= 1; entries by non-decreasing position
    entry   = step head [offset total] data
      step    position minus the previous entry's position (the first entry: the position)
      head    len(data) << 1 | fragment bit
      offset, total
              only with the fragment bit: data is bytes [offset, offset + len) of a batch of
              `total` bytes, 0 < len and offset + len <= total
      data    UTF-8; a whole batch must decode, a fragment may split a character
    ACK     = below count gap{count}     count <= MAX_ACK_POSITIONS
      below   the receiver holds every position < below, and not `below` itself
      gap     the held positions above `below`, ascending: p1 = below + 1 + gap1,
              p(i) = p(i-1) + 1 + gap(i)

A whole entry of under 32 bytes near the previous one costs 2 bytes of framing (the paper's §3.3
asks to "reuse the meta-data" to fit more tokens per packet: one header per message, positions
as steps), and an ACK of a clean prefix is 3-6 bytes.

Nothing here touches a socket or a clock: every method that needs the time takes `now` (seconds,
never decreasing), in the manner of aioquic's QuicConnection, so the logic runs in virtual time.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from aioquic.buffer import Buffer, BufferReadError, size_uint_var

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "KIND_ACK",
    "KIND_TOKENS",
    "MAX_ACK_POSITIONS",
    "Ack",
    "EloquentFormatError",
    "EloquentReceiver",
    "EloquentSender",
    "ReceiverStats",
    "RenderEvent",
    "SenderStats",
    "SseEvents",
    "TokenEntry",
    "Tokens",
    "decode_message",
    "late_share",
    "redundancy_rate",
    "stall_ratio",
]

KIND_TOKENS = 0x01
KIND_ACK = 0x02

MAX_VARINT = (1 << 62) - 1

MAX_ACK_POSITIONS = 64
"""Held positions above the cumulative point that one ACK lists at most. 64 steps of at most 8
bytes each keep an ACK under 530 bytes, so it always fits a datagram. The receiver lists the
lowest ones: the sender repeats oldest first, so those are the ones it would waste room on."""

DEFAULT_MAX_PAYLOAD = 1150
"""Largest payload the sender builds, in bytes. aioquic 1.7.2 fits at most 1170 bytes of DATAGRAM
frame data in a 1200-byte packet with its 8-byte connection IDs (FACTS: max_datagram_size - 30),
and a larger one is never sent and blocks every datagram queued behind it, so this must hold
always, not on average. From 1170 we keep 8 bytes for the quarter-stream-id that
H3Connection.send_datagram prepends (a varint: 1-2 bytes below stream id 65536, 8 at most) and
12 for a peer connection ID of up to RFC 9000's 20 bytes instead of aioquic's 8."""

_MIN_PAYLOAD = 64
"""Below this a fragment would carry little but framing; refuse such configurations."""


class EloquentFormatError(ValueError):
    """A datagram payload that is not a well-formed Eloquent message, or one of the wrong kind."""


# --------------------------------------------------------------------------------------------
# Wire format


@dataclass(frozen=True)
class TokenEntry:
    """One batch of tokens, or one fragment of a batch too large for a datagram."""

    position: int
    """Index of the batch in the response, 0-based; the same index as its delta on the stream."""
    data: bytes
    """UTF-8: the whole batch, or bytes [offset, offset + len(data)) of it."""
    offset: int = 0
    """Where `data` starts in the batch; 0 for a whole batch."""
    total: int | None = None
    """Length of the whole batch if this is a fragment; None for a whole batch."""

    @property
    def is_fragment(self) -> bool:
        return self.total is not None

    def wire_size(self, previous_position: int | None) -> int:
        """Encoded size of this entry after one at `previous_position` (None: the first)."""
        step = self.position if previous_position is None else self.position - previous_position
        head = len(self.data) << 1 | self.is_fragment
        size = size_uint_var(step) + size_uint_var(head) + len(self.data)
        if self.total is not None:
            size += size_uint_var(self.offset) + size_uint_var(self.total)
        return size


@dataclass(frozen=True)
class Tokens:
    """A TOKENS message: batches (or fragments) by non-decreasing position."""

    entries: tuple[TokenEntry, ...]
    """At least one; oldest first."""

    def wire_size(self) -> int:
        size = size_uint_var(KIND_TOKENS) + size_uint_var(len(self.entries))
        previous: int | None = None
        for entry in self.entries:
            size += entry.wire_size(previous)
            previous = entry.position
        return size

    def encode(self) -> bytes:
        if not self.entries:
            raise ValueError("a TOKENS message needs at least one entry")
        buf = Buffer(capacity=self.wire_size())
        buf.push_uint_var(KIND_TOKENS)
        buf.push_uint_var(len(self.entries))
        previous: int | None = None
        for entry in self.entries:
            if previous is not None and entry.position < previous:
                raise ValueError("TOKENS entries must be in non-decreasing position order")
            buf.push_uint_var(entry.position if previous is None else entry.position - previous)
            buf.push_uint_var(len(entry.data) << 1 | entry.is_fragment)
            if entry.total is not None:
                buf.push_uint_var(entry.offset)
                buf.push_uint_var(entry.total)
            buf.push_bytes(entry.data)
            previous = entry.position
        return buf.data


@dataclass(frozen=True)
class Ack:
    """An ACK message: which positions the receiver holds, from either path."""

    below: int
    """Every position below this is held; this one is not."""
    held: tuple[int, ...] = ()
    """Held positions above `below`, ascending, at most MAX_ACK_POSITIONS."""

    def encode(self) -> bytes:
        if len(self.held) > MAX_ACK_POSITIONS:
            raise ValueError(f"an ACK lists at most {MAX_ACK_POSITIONS} positions")
        gaps: list[int] = []
        previous = self.below
        for position in self.held:
            if position <= previous:
                raise ValueError("ACK positions must be ascending and above `below`")
            gaps.append(position - previous - 1)
            previous = position
        buf = Buffer(
            capacity=size_uint_var(KIND_ACK)
            + size_uint_var(self.below)
            + size_uint_var(len(gaps))
            + sum(size_uint_var(gap) for gap in gaps)
        )
        buf.push_uint_var(KIND_ACK)
        buf.push_uint_var(self.below)
        buf.push_uint_var(len(gaps))
        for gap in gaps:
            buf.push_uint_var(gap)
        return buf.data


def decode_message(payload: bytes) -> Tokens | Ack:
    """Parse one datagram payload. Anything malformed raises EloquentFormatError."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
    buf = Buffer(data=bytes(payload))
    try:
        kind = buf.pull_uint_var()
        if kind == KIND_TOKENS:
            message: Tokens | Ack = _pull_tokens(buf)
        elif kind == KIND_ACK:
            message = _pull_ack(buf)
        else:
            raise EloquentFormatError(f"unknown message kind {kind:#x}")
    except BufferReadError as exc:
        raise EloquentFormatError("truncated message") from exc
    if not buf.eof():
        raise EloquentFormatError(f"{buf.capacity - buf.tell()} trailing bytes")
    return message


def _remaining(buf: Buffer) -> int:
    return buf.capacity - buf.tell()


def _pull_tokens(buf: Buffer) -> Tokens:
    count = buf.pull_uint_var()
    # Every entry takes at least two bytes (step, head); checking up front keeps a forged count
    # from costing a long loop before the truncation shows.
    if count == 0 or count > _remaining(buf) // 2:
        raise EloquentFormatError(f"TOKENS count {count} does not fit the payload")
    entries: list[TokenEntry] = []
    position = 0
    for index in range(count):
        step = buf.pull_uint_var()
        position = step if index == 0 else position + step
        if position > MAX_VARINT:
            raise EloquentFormatError("position out of range")
        head = buf.pull_uint_var()
        length, fragment = head >> 1, head & 1
        offset, total = 0, None
        if fragment:
            offset = buf.pull_uint_var()
            total = buf.pull_uint_var()
            if length == 0 or offset + length > total:
                raise EloquentFormatError(
                    f"fragment [{offset}, {offset + length}) does not lie in a batch of {total}"
                )
        if length > _remaining(buf):
            raise EloquentFormatError("entry data runs past the payload")
        data = buf.pull_bytes(length)
        if not fragment:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise EloquentFormatError(f"position {position} is not UTF-8") from exc
        entries.append(TokenEntry(position, data, offset, total))
    return Tokens(tuple(entries))


def _pull_ack(buf: Buffer) -> Ack:
    below = buf.pull_uint_var()
    count = buf.pull_uint_var()
    if count > MAX_ACK_POSITIONS:
        raise EloquentFormatError(f"ACK lists {count} positions, at most {MAX_ACK_POSITIONS}")
    held: list[int] = []
    position = below
    for _ in range(count):
        position += 1 + buf.pull_uint_var()
        if position > MAX_VARINT:
            raise EloquentFormatError("position out of range")
        held.append(position)
    return Ack(below, tuple(held))


# --------------------------------------------------------------------------------------------
# Sender (Algorithm 1)


@dataclass
class SenderStats:
    """What the sender handed out, for the redundancy metric (seed 002 §4.1)."""

    batches: int = 0
    token_bytes: int = 0
    """UTF-8 bytes of the batches themselves, each counted once: the useful data."""
    datagrams: int = 0
    payload_bytes: int = 0
    """Every datagram payload byte handed out: framing, repeats and timer re-sends included."""
    timer_datagrams: int = 0
    """Datagrams sent by `on_timer` (re-sends with no new batch)."""
    acks: int = 0


class EloquentSender:
    """Builds the datagram payloads for one response; the caller sends them and feeds back ACKs.

    Every new batch goes out at once, together with as many earlier unacknowledged entries as
    fit, oldest first (§3.2). When no new batch has been sent for `resend_after`, `on_timer`
    re-sends the unacknowledged ones without a new batch (Algorithm 1's "slept for 200ms").

    Choices where the paper leaves room:
    - Room: an earlier entry that does not fit beside the new one is skipped and the next older
      one tried, rather than stopping there as Algorithm 1's inner loop does. For batches of
      similar size the two are the same; with one large unacknowledged batch, stopping would
      keep every other repeat out of the packet until it is acknowledged.
    - Cap: at most `max_repeats` earlier entries per datagram, the paper's limit of 10 tokens a
      packet (§3.3, §4.1). The paper counts the new token inside its T; here the new batch comes
      on top, so the paper's T = 10 is max_repeats = 9. A timer datagram has no new batch and
      carries at most `max_repeats` entries. max_repeats = 0 sends every batch once.
    - Oversize batches: a batch whose entry alone would exceed `max_payload` is cut into
      fragments of the same position, each in its own datagram (with repeats where room is
      left). The receiver reassembles the bytes before decoding, so a cut may fall inside a
      UTF-8 character. Positions stay one per stream delta, and the position is acknowledged
      only whole, so a lost fragment makes the sender repeat all of the batch's fragments.
    - Ending: Algorithm 1 runs "while EOS token not acked". `finish()` says no batch will
      follow; the sender then re-sends on the timer until everything is acknowledged, after
      which `timer()` is None and nothing is sent again. Since the stream delivers everything
      anyway, re-sending also stops after `give_up_after` seconds without an ACK or a new batch
      (a client that ignores datagrams, or a dead path, is not fed forever); `close()` stops at
      once, for a response whose stream has ended or been reset.
    """

    def __init__(
        self,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        max_repeats: int = 10,
        resend_after: float = 0.2,
        give_up_after: float | None = 5.0,
    ) -> None:
        if max_payload < _MIN_PAYLOAD:
            raise ValueError(f"max_payload must be at least {_MIN_PAYLOAD} bytes")
        if max_repeats < 0:
            raise ValueError("max_repeats must be >= 0")
        if resend_after <= 0:
            raise ValueError("resend_after must be > 0")
        self.max_payload = max_payload
        self.max_repeats = max_repeats
        self.resend_after = resend_after
        self.give_up_after = give_up_after
        self.stats = SenderStats()
        # Unacknowledged entries keyed (position, offset). Entries are only ever added at higher
        # keys, so insertion order is oldest first and iteration needs no sort.
        self._unacked: dict[tuple[int, int], TokenEntry] = {}
        self._next_position = 0
        self._last_send: float | None = None
        self._last_heard: float | None = None  # last new batch or ACK: the path is alive
        self._finished = False
        self._closed = False

    @property
    def next_position(self) -> int:
        """The position the next batch will get."""
        return self._next_position

    @property
    def unacked_positions(self) -> list[int]:
        """Positions sent and not yet acknowledged, ascending."""
        return sorted({position for position, _ in self._unacked})

    @property
    def finished(self) -> bool:
        """`finish()` was called: no batch follows."""
        return self._finished

    @property
    def done(self) -> bool:
        """Finished and everything acknowledged, or closed: nothing will be sent again."""
        return self._closed or (self._finished and not self._unacked)

    def on_tokens(self, text: bytes | str, now: float) -> list[bytes]:
        """Take the next batch; return the payloads to send now (one, or one per fragment)."""
        if self._finished or self._closed:
            raise RuntimeError("on_tokens after finish() or close()")
        if isinstance(text, str):
            data = text.encode("utf-8")
        else:
            data = bytes(text)
            data.decode("utf-8")  # raises UnicodeDecodeError (a ValueError) before any state
        position = self._next_position
        self._next_position += 1
        self.stats.batches += 1
        self.stats.token_bytes += len(data)
        chunks = self._split(position, data)
        # Pack before adding the new chunks, so a fragmented batch does not repeat its own
        # fragments in the datagrams of the same call.
        payloads = [self._pack(chunk) for chunk in chunks]
        for chunk in chunks:
            self._unacked[(position, chunk.offset)] = chunk
        self._last_send = self._last_heard = now
        return self._emit(payloads)

    def on_ack(self, payload: bytes, now: float) -> None:
        """Forget every entry of the positions the receiver says it holds."""
        message = decode_message(payload)
        if not isinstance(message, Ack):
            raise EloquentFormatError("the sender expects ACK messages, got TOKENS")
        self.stats.acks += 1
        self._last_heard = now if self._last_heard is None else max(self._last_heard, now)
        held = set(message.held)
        for key in [k for k in self._unacked if k[0] < message.below or k[0] in held]:
            del self._unacked[key]

    def timer(self) -> float | None:
        """When `on_timer` should next be called; None while there is nothing to re-send."""
        if self._closed or not self._unacked or self.max_repeats == 0:
            return None
        assert self._last_send is not None and self._last_heard is not None
        deadline = self._last_send + self.resend_after
        if self.give_up_after is not None and deadline - self._last_heard > self.give_up_after:
            return None
        return deadline

    def on_timer(self, now: float) -> list[bytes]:
        """Re-send the oldest unacknowledged entries if `resend_after` passed with no new batch."""
        deadline = self.timer()
        if deadline is None or now < deadline:
            return []
        self._last_send = now
        self.stats.timer_datagrams += 1
        return self._emit([self._pack(None)])

    def finish(self) -> None:
        """No batch follows; keep re-sending until everything is acknowledged."""
        self._finished = True

    def close(self) -> None:
        """Stop now: forget what is unacknowledged and never send again."""
        self._closed = True
        self._unacked.clear()

    def _split(self, position: int, data: bytes) -> list[TokenEntry]:
        whole = TokenEntry(position, data)
        if Tokens((whole,)).wire_size() <= self.max_payload:
            return [whole]
        total = len(data)
        # Framing of a message holding one fragment, with every varint at its largest possible
        # size for this batch, so each fragment fits whatever its offset.
        framing = (
            size_uint_var(KIND_TOKENS)
            + size_uint_var(1)
            + size_uint_var(position)
            + size_uint_var(self.max_payload << 1 | 1)
            + 2 * size_uint_var(total)
        )
        piece = self.max_payload - framing
        return [
            TokenEntry(position, data[offset : offset + piece], offset, total)
            for offset in range(0, total, piece)
        ]

    def _pack(self, new: TokenEntry | None) -> bytes:
        """One TOKENS payload: `new` (if any) after the oldest unacknowledged entries that fit."""
        tail = [new] if new is not None else []
        chosen: list[TokenEntry] = []
        for entry in self._unacked.values():
            if len(chosen) >= self.max_repeats:
                break
            if Tokens((*chosen, entry, *tail)).wire_size() <= self.max_payload:
                chosen.append(entry)
        return Tokens((*chosen, *tail)).encode()

    def _emit(self, payloads: list[bytes]) -> list[bytes]:
        for payload in payloads:
            # A payload over the limit would not just be lost: aioquic would wedge every datagram
            # behind it (FACTS), so this is an invariant, not a hope.
            assert len(payload) <= self.max_payload, (len(payload), self.max_payload)
            self.stats.datagrams += 1
            self.stats.payload_bytes += len(payload)
        return payloads


# --------------------------------------------------------------------------------------------
# Receiver (Algorithm 2)

SOURCE_DATAGRAM = "datagram"
SOURCE_STREAM = "stream"


@dataclass(frozen=True)
class RenderEvent:
    """One position becoming renderable."""

    position: int
    time: float
    """`now` of the call that made it renderable."""
    source: str
    """Which path delivered it first: "datagram" or "stream"."""


@dataclass
class ReceiverStats:
    datagrams: int = 0
    entries: int = 0
    duplicate_entries: int = 0
    """Datagram entries for positions already held (by either path)."""
    mismatches: int = 0
    """Positions whose datagram and stream copies differed; the stream's copy was kept."""
    invalid_batches: int = 0
    """Reassembled fragments that were not UTF-8; dropped, the stream will deliver them."""
    acks: int = 0
    ack_bytes: int = 0


@dataclass
class _Reassembly:
    total: int
    pieces: dict[int, bytes] = field(default_factory=dict)  # offset -> bytes


class EloquentReceiver:
    """Renders the longest contiguous prefix of positions from datagrams and the stream.

    Each position renders once, from whichever path delivers it first, and only after every
    position before it: no duplicates and no gaps (Algorithm 2, "render new tokens according to
    acked_list"). The stream is the authority: if its copy of a position differs from the
    datagram's, the stream's text is kept (replacing the rendered one) and `stats.mismatches`
    counts it.
    """

    def __init__(self) -> None:
        self.events: list[RenderEvent] = []
        """Every position as it became renderable, in position order."""
        self.stats = ReceiverStats()
        self._texts: list[str] = []  # the rendered prefix, by position
        self._held: dict[
            int, tuple[str, str]
        ] = {}  # complete, past a gap: position -> (text, source)
        self._partial: dict[int, _Reassembly] = {}
        self._stream_next = 0

    @property
    def next_position(self) -> int:
        """The first position not yet renderable."""
        return len(self._texts)

    def rendered(self) -> str:
        """The text renderable now."""
        return "".join(self._texts)

    def render_times(self) -> list[float]:
        """When each position became renderable, by position."""
        return [event.time for event in self.events]

    def text_of(self, position: int) -> str:
        """The rendered text of one position (below `next_position`)."""
        return self._texts[position]

    def on_datagram(self, payload: bytes, now: float) -> bytes:
        """Take a TOKENS payload; return the ACK payload to send back.

        Every datagram is acknowledged, duplicates too (Algorithm 2, "send ACK for packet"):
        the ACK carries the full state, so a later one repairs a lost one. Malformed input
        raises EloquentFormatError with the receiver unchanged.
        """
        message = decode_message(payload)
        if not isinstance(message, Tokens):
            raise EloquentFormatError("the receiver expects TOKENS messages, got an ACK")
        self.stats.datagrams += 1
        for entry in message.entries:
            self.stats.entries += 1
            known = self._known(entry.position)
            if known is not None:
                self.stats.duplicate_entries += 1
                if (
                    not entry.is_fragment
                    and entry.position < self._stream_next
                    and entry.data.decode("utf-8") != known
                ):
                    self.stats.mismatches += 1  # the stream's copy stays
                continue
            text = entry.data.decode("utf-8") if not entry.is_fragment else self._reassemble(entry)
            if text is not None:
                self._held[entry.position] = (text, SOURCE_DATAGRAM)
                self._partial.pop(entry.position, None)
        self._render(now)
        return self._ack()

    def on_stream_delta(self, position: int, text: str | bytes, now: float) -> bytes | None:
        """Take the stream's next content delta, which must be `position` (the stream is in order).

        Returns an ACK payload when the stream delivered a position that no datagram had, since
        the sender is then likely still repeating it; None otherwise. Sending it is optional.
        """
        if position != self._stream_next:
            raise ValueError(f"stream delta {position} out of order: expected {self._stream_next}")
        if not isinstance(text, str):
            text = bytes(text).decode("utf-8")
        self._stream_next += 1
        known = self._known(position)
        if known is None:
            self._held[position] = (text, SOURCE_STREAM)
            self._partial.pop(position, None)
            self._render(now)
            return self._ack()
        if known != text:
            self.stats.mismatches += 1
            if position < len(self._texts):
                self._texts[position] = text
            else:
                self._held[position] = (text, self._held[position][1])
        return None

    def _known(self, position: int) -> str | None:
        if position < len(self._texts):
            return self._texts[position]
        held = self._held.get(position)
        return held[0] if held is not None else None

    def _reassemble(self, entry: TokenEntry) -> str | None:
        """Add a fragment; return the batch's text once all its bytes are here."""
        assert entry.total is not None
        partial = self._partial.get(entry.position)
        if partial is None or partial.total != entry.total:
            # A different total means a different cut of the batch; start over with this one.
            partial = self._partial[entry.position] = _Reassembly(entry.total)
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
            return data.decode("utf-8")
        except UnicodeDecodeError:
            self.stats.invalid_batches += 1
            return None

    def _render(self, now: float) -> None:
        while (position := len(self._texts)) in self._held:
            text, source = self._held.pop(position)
            self._texts.append(text)
            self.events.append(RenderEvent(position, now, source))

    def _ack(self) -> bytes:
        held = tuple(heapq.nsmallest(MAX_ACK_POSITIONS, self._held))
        payload = Ack(len(self._texts), held).encode()
        self.stats.acks += 1
        self.stats.ack_bytes += len(payload)
        return payload


class SseEvents:
    """Cuts a text/event-stream body into whole events, each with its blank-line terminator.

    Both ends of an HTTP/3 response cut its body here, so position n names the same bytes on
    the server's datagrams and in the client's copy of the stream, however QUIC split the
    stream into frames."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        return [event + b"\n\n" for event in events]

    def rest(self) -> bytes:
        """What follows the last whole event (empty for a well-formed stream)."""
        return self._pending


# --------------------------------------------------------------------------------------------
# Metrics (seed 002 §4.1, §4.3)


def stall_ratio(
    render_times: Sequence[float],
    session_end: float,
    threshold: float = 0.2,
    session_start: float | None = None,
) -> float:
    """Share of the session spent waiting in stalls: gaps between consecutive renders > threshold.

    Seed 002 §4.1 defines the stall ratio as "the amount of time that client side is waiting for
    tokens to render when stall is longer than 200ms" (footnote 1: "proportion of token wait
    time when inter-token gap exceeds 200ms"). A gap longer than `threshold` therefore counts
    whole, not only its part beyond the threshold, and shorter gaps count nothing; a gap of
    exactly `threshold` is not a stall. Only gaps between two renders count: the wait for the
    first token (prefill, not transport) and the time after the last are not inter-token gaps.
    The session runs from `session_start` (default: the first render) to `session_end`.
    `render_times` are per position, non-decreasing; several positions rendered at one instant
    make gaps of zero.
    """
    times = list(render_times)
    if any(later < earlier for earlier, later in zip(times, times[1:], strict=False)):
        raise ValueError("render_times must be non-decreasing")
    if not times:
        return 0.0
    start = times[0] if session_start is None else session_start
    if start > times[0] or session_end < times[-1]:
        raise ValueError("the session must span every render time")
    duration = session_end - start
    if duration <= 0:
        return 0.0
    stalled = sum(
        later - earlier
        for earlier, later in zip(times, times[1:], strict=False)
        if later - earlier > threshold
    )
    return stalled / duration


def redundancy_rate(total_bytes: int, token_bytes: int) -> float:
    """Extra bytes sent beyond the tokens themselves, per token byte (seed 002 §4.1).

    `total_bytes` is everything sent toward the client for the tokens (retransmissions and
    repeats included), `token_bytes` the tokens once each; 0.5 means 50% more than the text.
    """
    if token_bytes <= 0:
        raise ValueError("token_bytes must be positive")
    if total_bytes < token_bytes:
        raise ValueError("total_bytes includes the tokens, so it cannot be below token_bytes")
    return (total_bytes - token_bytes) / token_bytes


def late_share(
    generated_times: Sequence[float],
    rendered_times: Sequence[float | None],
    threshold: float = 0.4,
) -> float:
    """Share of tokens rendered more than `threshold` after generation (seed 002 §4.3, "late
    tokens (delay since generation over 400ms)"). A token never rendered (None) is late; a delay
    of exactly `threshold` is not."""
    if len(generated_times) != len(rendered_times):
        raise ValueError("one render time per generated token")
    if not generated_times:
        return 0.0
    late = sum(
        1
        for generated, rendered in zip(generated_times, rendered_times, strict=True)
        if rendered is None or rendered - generated > threshold
    )
    return late / len(generated_times)
