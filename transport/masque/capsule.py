"""The Capsule Protocol (RFC 9297 §3) and the UDP proxying payload (RFC 9298 §5), sans-IO.

    Capsule {                                  RFC 9297 §3.2
      Capsule Type (i),
      Capsule Length (i),
      Capsule Value (..),                      exactly Capsule Length bytes; may be empty
    }
    DATAGRAM Capsule {                         RFC 9297 §3.5
      Type (i) = 0x00,
      Length (i),
      HTTP Datagram Payload (..),
    }
    UDP Proxying HTTP Datagram Payload {       RFC 9298 §5
      Context ID (i),                          0: the rest is one whole UDP payload
      UDP Proxying Payload (..),               may be empty
    }

The same HTTP Datagram Payload travels either in a DATAGRAM capsule on the request stream or in
an HTTP/3 datagram (after the quarter stream ID that aioquic's `H3Connection.send_datagram`
prepends itself), so `udp_payload` serves both. Every integer is a QUIC variable-length integer
(RFC 9000 §16); we use aioquic's own `Buffer.push_uint_var`/`pull_uint_var`, `encode_uint_var`
and `size_uint_var` rather than a second hand-written codec, so the limits (62 bits) and errors
are the same as the QUIC layer's. QUIC does not require the shortest encoding, and neither does
RFC 9297, so a parser accepts a non-minimal varint.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioquic.buffer import UINT_VAR_MAX, Buffer, BufferReadError, encode_uint_var, size_uint_var

DATAGRAM = 0x00
"""The DATAGRAM capsule type (RFC 9297 §3.5)."""

UDP_CONTEXT_ID = 0
"""The context ID whose payload is one whole UDP payload (RFC 9298 §4: reserved for it)."""

MAX_UDP_PAYLOAD = 65_527
"""The largest UDP payload: UDP's 16-bit length field counts its own 8-byte header."""

DEFAULT_MAX_CAPSULE_LENGTH = MAX_UDP_PAYLOAD + 8
"""The largest Capsule Length a parser accepts unless told otherwise: a DATAGRAM capsule with the
largest UDP payload behind the longest (8-byte) context ID. RFC 9297 sets no limit, but a parser
must hold a capsule whole before handing it on, so without one a peer that announces a 2**62-byte
capsule makes it buffer without bound."""

_MAX_HEADER = 16
"""Capsule Type and Capsule Length are at most 8 bytes each."""


class CapsuleError(ValueError):
    """A capsule stream this side will not accept: truncated at its end, a capsule over the
    length limit, or more bytes fed after either. The stream it came on is unusable after it;
    RFC 9297 §3.3 has the receiver treat it as a malformed message (for HTTP/3, abort the
    stream with H3_MESSAGE_ERROR)."""


class CapsuleTooLarge(CapsuleError):
    """A capsule whose announced length is over the parser's limit, refused on its header
    alone, before any of its value is buffered."""

    def __init__(self, capsule_type: int, length: int, limit: int) -> None:
        super().__init__(
            f"capsule of type {capsule_type:#x} announces {length} bytes, over the limit of {limit}"
        )
        self.capsule_type = capsule_type
        self.length = length
        self.limit = limit


class DatagramPayloadError(ValueError):
    """An HTTP Datagram Payload too short to hold its context ID (it is empty)."""


@dataclass(frozen=True)
class Capsule:
    """One whole capsule, of any type; the value is opaque here."""

    type: int
    """The Capsule Type; `DATAGRAM` (0x00) or any other, known or not."""
    value: bytes
    """The Capsule Value, exactly as long as its Capsule Length said."""

    @property
    def is_datagram(self) -> bool:
        return self.type == DATAGRAM

    def encode(self) -> bytes:
        return encode_capsule(self.type, self.value)


def encode_capsule(capsule_type: int, value: bytes) -> bytes:
    """Type, Length, Value. Raises ValueError for a type outside 0..2**62-1."""
    if not 0 <= capsule_type <= UINT_VAR_MAX:
        raise ValueError(f"capsule type {capsule_type} is not a 62-bit varint")
    buf = Buffer(capacity=size_uint_var(capsule_type) + size_uint_var(len(value)) + len(value))
    buf.push_uint_var(capsule_type)
    buf.push_uint_var(len(value))
    buf.push_bytes(value)
    return buf.data


def encode_datagram_capsule(http_datagram_payload: bytes) -> bytes:
    """A DATAGRAM capsule carrying one HTTP Datagram Payload (for CONNECT-UDP: a `udp_payload`)."""
    return encode_capsule(DATAGRAM, http_datagram_payload)


def udp_payload(context_id: int, data: bytes) -> bytes:
    """The HTTP Datagram Payload for CONNECT-UDP: context ID, then `data` (for context 0, one UDP
    payload, which may be empty). Raises ValueError for a context ID outside 0..2**62-1."""
    if not 0 <= context_id <= UINT_VAR_MAX:
        raise ValueError(f"context ID {context_id} is not a 62-bit varint")
    return encode_uint_var(context_id) + data


def parse_udp_payload(http_datagram_payload: bytes) -> bytes | None:
    """The UDP payload an HTTP Datagram Payload carries, or None if it carries another context.

    RFC 9298 §4 defines only context ID 0 (a UDP payload) and leaves registering others to
    extensions; as we recall §5, a datagram with a context ID the receiver does not know SHALL be
    dropped silently or buffered briefly (on the order of a round trip) while its registration
    may still arrive. We register none, so nothing can arrive for one later: we drop, and the
    None says so without an error. An empty payload has no context ID at all; that is malformed,
    not merely unknown, and raises DatagramPayloadError so the caller can count it before it
    drops it too.
    """
    if not http_datagram_payload:
        raise DatagramPayloadError("HTTP datagram payload is empty: no context ID")
    buf = Buffer(data=http_datagram_payload)
    try:
        context_id = buf.pull_uint_var()
    except BufferReadError:
        raise DatagramPayloadError("HTTP datagram payload ends inside its context ID") from None
    if context_id != UDP_CONTEXT_ID:
        return None
    return http_datagram_payload[buf.tell() :]


def udp_capsule(data: bytes) -> bytes:
    """A DATAGRAM capsule carrying one UDP payload (context 0): what a tunnel writes per packet."""
    return encode_datagram_capsule(udp_payload(UDP_CONTEXT_ID, data))


class CapsuleParser:
    """Cuts a request stream's bytes into capsules, whatever the chunking.

    Feed it the stream's data as it arrives and call `close()` at the stream's end. It returns
    every whole capsule, of every type: unknown types come back opaque, and RFC 9297 §3.2 has the
    consumer skip them (`Capsule.is_datagram` picks out the ones CONNECT-UDP uses). A capsule
    over `max_length` raises CapsuleTooLarge as soon as its header is read, so the parser never
    holds more than one header plus `max_length` bytes between calls. A QUIC varint cannot be
    malformed, only cut short, and a short capsule may yet be completed by the next chunk, so
    truncation is only an error at the end of the stream, where `close()` raises it.
    """

    def __init__(self, max_length: int = DEFAULT_MAX_CAPSULE_LENGTH) -> None:
        if max_length < 0:
            raise ValueError("max_length must be >= 0")
        self.max_length = max_length
        self._buffer = bytearray()
        self._header: tuple[int, int, int] | None = None
        """(type, length, header size) of the capsule at the buffer's start, once read."""
        self._failed: CapsuleError | None = None
        self._closed = False

    @property
    def buffered(self) -> int:
        """Bytes held that belong to a capsule not yet complete."""
        return len(self._buffer)

    @property
    def at_eof(self) -> bool:
        """Whether `close()` has been called."""
        return self._closed

    def feed(self, data: bytes) -> list[Capsule]:
        """The capsules that `data` completes, in stream order. Raises CapsuleTooLarge instead
        if `data` reaches a capsule over the limit; capsules the same call completed before it
        are not returned, as the stream is to be aborted anyway."""
        self._check_open()
        self._buffer += data
        capsules: list[Capsule] = []
        start = 0
        try:
            while True:
                capsule, start = self._next(start)
                if capsule is None:
                    break
                capsules.append(capsule)
        finally:
            # One compaction per feed keeps a chunk of many small capsules linear in its size.
            del self._buffer[:start]
        return capsules

    def close(self) -> None:
        """The stream ended (FIN). Raises CapsuleError if it ended inside a capsule (RFC 9297
        §3.3: a truncated last capsule makes the message malformed)."""
        self._check_open()
        self._closed = True
        if self._buffer:
            if self._header is None:
                where = "its header"
            else:
                capsule_type, length, header = self._header
                got = len(self._buffer) - header
                where = f"a capsule of type {capsule_type:#x} ({got} of {length} bytes)"
            self._failed = CapsuleError(f"capsule stream ended inside {where}")
            raise self._failed

    def _check_open(self) -> None:
        if self._failed is not None:
            raise CapsuleError(f"capsule stream already failed: {self._failed}")
        if self._closed:
            raise CapsuleError("capsule stream already closed")

    def _next(self, start: int) -> tuple[Capsule | None, int]:
        """The capsule at `start` and where the next begins, or (None, start) if it is not whole."""
        if self._header is None:
            head = bytes(self._buffer[start : start + _MAX_HEADER])
            buf = Buffer(data=head)
            try:
                capsule_type = buf.pull_uint_var()
                length = buf.pull_uint_var()
            except BufferReadError:
                return None, start
            if length > self.max_length:
                self._failed = CapsuleTooLarge(capsule_type, length, self.max_length)
                raise self._failed
            self._header = (capsule_type, length, buf.tell())
        capsule_type, length, header = self._header
        end = start + header + length
        if len(self._buffer) < end:
            return None, start
        self._header = None
        return Capsule(capsule_type, bytes(self._buffer[start + header : end])), end
