"""Eloquent's wire format: the HTTP/3 datagram payloads, after the quarter-stream-id that
`H3Connection.send_datagram` prepends itself. Every integer is a QUIC varint (RFC 9000 §16).

    message  = kind body                      kind: 0x01 TOKENS, 0x02 ACK
    TOKENS   = flags envelope_ref [envelope] count entry{count}
      flags         bit 0: the envelope's bytes are in this message
      envelope_ref  0, or 1 + the position of the envelope that this message's TEXT entries
                    are rebuilt with (an envelope is named by the event that defined it)
      envelope      head_len head tail_len tail: an event is head + text + tail
      count         >= 1; entries by non-decreasing position
    entry    = step head [offset total] data
      step    position minus the previous entry's position (the first entry: the position)
      head    len(data) << 3 | kind << 1 | fragment bit
              kind 0 TEXT: data is the event's text; the event is envelope.head + data + tail
              kind 1 EVENT: data is the whole event
              kind 2 TEXT_ONLY: data is the event's text; the event itself comes by the stream
      offset, total
              only with the fragment bit: data is bytes [offset, offset + len) of an entry of
              `total` bytes, 0 < len and offset + len <= total
      data    UTF-8; a whole entry must decode, a fragment may split a character
    ACK      = below envelope count gap{count}     count <= MAX_ACK_POSITIONS
      below     the receiver holds every position < below, and not `below` itself
      envelope  0, or 1 + the position of the newest envelope the receiver holds
      gap       the held positions above `below`, ascending: p1 = below + 1 + gap1,
                p(i) = p(i-1) + 1 + gap(i)

A position is the index of an event in the response's event stream, 0-based, so both paths name
the same event by the same number. An event's text is the JSON string literal that `sse` cuts
out of it, as it stands in the event (escapes and all), so rebuilding is concatenation and
exact. A word-sized TEXT entry near the previous one costs 2 bytes of framing beside its text
(the paper's §3.3 asks to "reuse the meta-data" to fit more tokens per packet: one envelope per
response, one header per message, positions as steps), and an ACK of a clean prefix 4-7 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioquic.buffer import Buffer, BufferReadError, size_uint_var

KIND_TOKENS = 0x01
KIND_ACK = 0x02

TEXT = 0
EVENT = 1
TEXT_ONLY = 2
_ENTRY_KINDS = (TEXT, EVENT, TEXT_ONLY)

MAX_VARINT = (1 << 62) - 1

MAX_ACK_POSITIONS = 64
"""Held positions above the cumulative point that one ACK lists at most. 64 steps of at most 8
bytes each keep an ACK under 540 bytes, so it always fits a datagram. The receiver lists the
lowest ones: the sender repeats oldest first, so those are the ones it would waste room on."""

DEFAULT_MAX_PAYLOAD = 1150
"""Largest payload the sender builds, in bytes. aioquic 1.7.2 fits at most 1170 bytes of DATAGRAM
frame data in a 1200-byte packet with its 8-byte connection IDs (`max_datagram_size - 30`), and
a larger one is never sent and blocks every datagram queued behind it (both checked on the
development VM), so this must hold always, not on average. From 1170 we keep 8 bytes for the
quarter-stream-id that H3Connection.send_datagram prepends (a varint: 1-2 bytes below stream id
65536, 8 at most) and 12 for a peer connection ID of up to RFC 9000's 20 bytes instead of
aioquic's 8."""


class EloquentFormatError(ValueError):
    """A datagram payload that is not a well-formed Eloquent message, or one of the wrong kind."""


@dataclass(frozen=True)
class Envelope:
    """What every event of a run of events shares around its text: id, model, replica, framing."""

    position: int
    """The event that defined it; a TEXT entry names it by this."""
    head: bytes
    tail: bytes

    def wrap(self, text: bytes) -> bytes:
        return self.head + text + self.tail

    def wire_size(self) -> int:
        return (
            size_uint_var(len(self.head))
            + len(self.head)
            + size_uint_var(len(self.tail))
            + len(self.tail)
        )


@dataclass(frozen=True)
class TokenEntry:
    """One event's text (or the whole event), or one fragment of an entry too large to fit."""

    position: int
    data: bytes
    """UTF-8: the whole entry, or bytes [offset, offset + len(data)) of it."""
    kind: int = TEXT
    offset: int = 0
    """Where `data` starts in the entry; 0 for a whole one."""
    total: int | None = None
    """Length of the whole entry if this is a fragment; None for a whole one."""

    @property
    def is_fragment(self) -> bool:
        return self.total is not None

    def wire_size(self, previous_position: int | None) -> int:
        """Encoded size of this entry after one at `previous_position` (None: the first)."""
        step = self.position if previous_position is None else self.position - previous_position
        size = size_uint_var(step) + size_uint_var(self._head()) + len(self.data)
        if self.total is not None:
            size += size_uint_var(self.offset) + size_uint_var(self.total)
        return size

    def _head(self) -> int:
        return len(self.data) << 3 | self.kind << 1 | self.is_fragment


@dataclass(frozen=True)
class Tokens:
    """A TOKENS message: entries by non-decreasing position, and the envelope TEXT ones use."""

    entries: tuple[TokenEntry, ...]
    """At least one; oldest first."""
    envelope_ref: int | None = None
    """The position of the envelope TEXT entries are rebuilt with; None: no TEXT entries."""
    envelope: Envelope | None = None
    """That envelope's bytes, when the receiver may not hold them yet."""

    def wire_size(self) -> int:
        size = size_uint_var(KIND_TOKENS) + 1 + size_uint_var(_ref(self.envelope_ref))
        size += self.envelope.wire_size() if self.envelope is not None else 0
        size += size_uint_var(len(self.entries))
        previous: int | None = None
        for entry in self.entries:
            size += entry.wire_size(previous)
            previous = entry.position
        return size

    def encode(self) -> bytes:
        if not self.entries:
            raise ValueError("a TOKENS message needs at least one entry")
        if self.envelope is not None and self.envelope.position != self.envelope_ref:
            raise ValueError("the envelope carried must be the one referenced")
        if self.envelope_ref is None and any(e.kind == TEXT for e in self.entries):
            raise ValueError("TEXT entries need an envelope reference")
        buf = Buffer(capacity=self.wire_size())
        buf.push_uint_var(KIND_TOKENS)
        buf.push_uint_var(int(self.envelope is not None))
        buf.push_uint_var(_ref(self.envelope_ref))
        if self.envelope is not None:
            for part in (self.envelope.head, self.envelope.tail):
                buf.push_uint_var(len(part))
                buf.push_bytes(part)
        buf.push_uint_var(len(self.entries))
        previous: int | None = None
        for entry in self.entries:
            if previous is not None and entry.position < previous:
                raise ValueError("TOKENS entries must be in non-decreasing position order")
            buf.push_uint_var(entry.position if previous is None else entry.position - previous)
            buf.push_uint_var(entry._head())
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
    envelope: int | None = None
    """The position of the newest envelope the receiver holds; None: none."""

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
        fields = [KIND_ACK, self.below, _ref(self.envelope), len(gaps), *gaps]
        buf = Buffer(capacity=sum(size_uint_var(f) for f in fields))
        for value in fields:
            buf.push_uint_var(value)
        return buf.data


def _ref(position: int | None) -> int:
    return 0 if position is None else position + 1


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


def _pull_data(buf: Buffer, length: int, what: str) -> bytes:
    if length > _remaining(buf):
        raise EloquentFormatError(f"{what} runs past the payload")
    return buf.pull_bytes(length)


def _pull_position(buf: Buffer, base: int = 0) -> int:
    position = base + buf.pull_uint_var()
    if position > MAX_VARINT:
        raise EloquentFormatError("position out of range")
    return position


def _utf8(data: bytes, what: str) -> None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EloquentFormatError(f"{what} is not UTF-8") from exc


def _pull_tokens(buf: Buffer) -> Tokens:
    flags = buf.pull_uint_var()
    if flags > 1:
        raise EloquentFormatError(f"unknown TOKENS flags {flags:#x}")
    reference = buf.pull_uint_var()
    envelope_ref = reference - 1 if reference else None
    envelope = None
    if flags:
        if envelope_ref is None:
            raise EloquentFormatError("an envelope with no position")
        parts = [_pull_data(buf, buf.pull_uint_var(), "envelope") for _ in range(2)]
        for part in parts:
            _utf8(part, "the envelope")
        envelope = Envelope(envelope_ref, *parts)
    count = buf.pull_uint_var()
    # Every entry takes at least two bytes (step, head); checking up front keeps a forged count
    # from costing a long loop before the truncation shows.
    if count == 0 or count > _remaining(buf) // 2:
        raise EloquentFormatError(f"TOKENS count {count} does not fit the payload")
    entries: list[TokenEntry] = []
    position = 0
    for index in range(count):
        position = _pull_position(buf, 0 if index == 0 else position)
        head = buf.pull_uint_var()
        length, kind, fragment = head >> 3, head >> 1 & 3, head & 1
        if kind not in _ENTRY_KINDS:
            raise EloquentFormatError(f"unknown entry kind {kind}")
        if kind == TEXT and envelope_ref is None:
            raise EloquentFormatError(f"TEXT entry at {position} with no envelope")
        offset, total = 0, None
        if fragment:
            offset = buf.pull_uint_var()
            total = buf.pull_uint_var()
            if length == 0 or offset + length > total:
                raise EloquentFormatError(
                    f"fragment [{offset}, {offset + length}) does not lie in an entry of {total}"
                )
        data = _pull_data(buf, length, "entry data")
        if not fragment:
            _utf8(data, f"position {position}")
        entries.append(TokenEntry(position, data, kind, offset, total))
    return Tokens(tuple(entries), envelope_ref, envelope)


def _pull_ack(buf: Buffer) -> Ack:
    below = _pull_position(buf)
    reference = buf.pull_uint_var()
    count = buf.pull_uint_var()
    if count > MAX_ACK_POSITIONS:
        raise EloquentFormatError(f"ACK lists {count} positions, at most {MAX_ACK_POSITIONS}")
    held: list[int] = []
    position = below
    for _ in range(count):
        position = _pull_position(buf, position + 1)
        held.append(position)
    return Ack(below, tuple(held), reference - 1 if reference else None)
