"""Stateless reset (RFC 9000 10.3), sans IO: one key for every front-end process, so that any
of them can tell a client that a connection it does not know is gone.

A QUIC server that loses a connection's state (a worker killed, a host restarted) drops the
client's packets, and the client learns nothing until its idle timeout, a minute with ours. RFC
9000's answer is the stateless reset: a packet ending in a 16-byte token that the server gave
the client for the connection ID in use, and that only the server can make again. Here every
token is HMAC-SHA256(key, connection ID), cut to 16 bytes (the construction RFC 9000 10.3.2
suggests), so a process with the same key makes the same tokens: a restarted worker, the
supervisor standing in for a dead one (`transport.workers`), or, with a shared secret, another
host (a Kubernetes Secret; `--reset-key-file`).

aioquic does none of this (1.7.2): it draws tokens with `os.urandom`, its server drops packets
for unknown connection IDs, and its client stores the token it is given but never checks one.
`transport.connection` fits these pieces into aioquic: tokens from the key
(`ScheduledQuicConnection`), resets sent (`ResettingQuicServer`) and honoured (the connection's
`receive_datagram`). Upstream aioquic would need a token callback in `QuicConfiguration`, a
hook for datagrams with unknown connection IDs in `QuicServer`, and a check of the trailing 16
bytes of every datagram it cannot decrypt.

A dead worker's stand-in also refuses new connections (an Initial closed with
CONNECTION_REFUSED), so that their clients connect again at once, onto a worker that runs.
"""

from __future__ import annotations

import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from aioquic.buffer import Buffer
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE
from aioquic.quic.connection import TRANSPORT_CLOSE_FRAME_CAPACITY
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import (
    QuicErrorCode,
    QuicFrameType,
    QuicPacketType,
    pull_quic_header,
)
from aioquic.quic.packet_builder import QuicPacketBuilder

KEY_ENV = "QOS_STATELESS_RESET_KEY"
"""How a supervisor hands its key to its workers: the key in hex. The environment, not the
command line, which any user of the machine can read."""
TOKEN_SIZE = 16
MIN_RESET = 21
"""Bytes: a first byte, 4 more unpredictable ones (RFC 9000 10.3 asks for 38 unpredictable
bits) and the token. Never sent in answer to a packet this size or smaller: a reset must be
smaller than what triggered it (10.3.3), or two endpoints that both lost their state would
reset each other forever."""
MAX_RESET = 43
"""A reset answers a packet of 44 bytes or more with 43: RFC 9000 10.3 wants one byte less than
a trigger up to 43 bytes, and any size that looks like a short packet beyond."""
RESET_RATE = 1000.0
"""Resets (and refusals) a second, past a burst as large (RFC 9000 10.3 asks for a bound). A
client needs one, so a worker that held a thousand connections has them all told within a
second, and a flood of packets for unknown connections costs at most that: an HMAC and a
small send each, about 1% of a core."""
MIN_KEY_BYTES = 16
PLACEHOLDER = b"replace-me"
"""How deploy/kubernetes/secrets.yaml's values begin: refused, so that no fleet runs on them."""
REFUSED_REASON = b"worker restarting: connect again"


@dataclass(frozen=True)
class ResetKey:
    """The secret every token derives from."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise ValueError(
                f"a stateless-reset key needs at least {MIN_KEY_BYTES} bytes, "
                f"got {len(self.secret)}"
            )
        if self.secret.startswith(PLACEHOLDER):
            raise ValueError("the stateless-reset key is still the manifests' placeholder")

    def token(self, cid: bytes) -> bytes:
        return hmac.digest(self.secret, cid, "sha256")[:TOKEN_SIZE]

    @classmethod
    def generate(cls) -> ResetKey:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_file(cls, path: str | Path) -> ResetKey:
        """The file's bytes, less surrounding whitespace, are the secret: a mounted Kubernetes
        Secret, or `openssl rand -hex 32 > key`."""
        return cls(Path(path).read_bytes().strip())

    @classmethod
    def from_env(cls) -> ResetKey | None:
        given = os.environ.get(KEY_ENV)
        return cls(bytes.fromhex(given)) if given else None

    def env(self) -> dict[str, str]:
        return {KEY_ENV: self.secret.hex()}


def is_reset(data: bytes, token: bytes) -> bool:
    """Whether a datagram is a stateless reset carrying `token` (RFC 9000 10.3.1): a short
    header, at least MIN_RESET bytes, ending in the token. A wrong token is ignored."""
    return (
        bool(token)
        and len(data) >= MIN_RESET
        and not data[0] & 0x80
        and hmac.compare_digest(data[-TOKEN_SIZE:], token)
    )


def is_short_header(data: bytes) -> bool:
    return bool(data) and not data[0] & 0x80


class ResetResponder:
    """Answers the datagrams that no connection here claims: a reset for a short-header packet
    (a connection this process does not know), a refusal for a new connection's Initial where
    the caller cannot serve it. Both within RESET_RATE."""

    def __init__(self, key: ResetKey, cid_length: int, rate: float = RESET_RATE) -> None:
        self.key = key
        self.cid_length = cid_length
        self.rate = rate
        self._allowance = rate
        self._last = float("-inf")
        self.resets = 0
        self.refusals = 0
        self.limited = 0
        """Answers the rate limit held back."""

    def _allowed(self, now: float) -> bool:
        self._allowance = min(self.rate, self._allowance + (now - self._last) * self.rate)
        self._last = now
        if self._allowance < 1:
            self.limited += 1
            return False
        self._allowance -= 1
        return True

    def reset(self, data: bytes, now: float) -> bytes | None:
        """The reset for a short-header packet, or None where none may be sent."""
        size = min(len(data) - 1, MAX_RESET)
        if not is_short_header(data) or size < MIN_RESET or len(data) < 1 + self.cid_length:
            return None
        if not self._allowed(now):
            return None
        self.resets += 1
        token = self.key.token(data[1 : 1 + self.cid_length])
        filler = os.urandom(size - TOKEN_SIZE)
        # First byte: the short header's form (0) and fixed (1) bits, the rest unpredictable.
        return bytes([0x40 | filler[0] & 0x3F]) + filler[1:] + token

    def refuse(self, data: bytes, now: float) -> bytes | None:
        """A server Initial closing the client's new connection with CONNECTION_REFUSED, or
        None where the datagram is no client's first Initial (those are padded to 1,200 bytes:
        the answer, far smaller, cannot amplify) or the rate limit holds it back."""
        if is_short_header(data) or len(data) < SMALLEST_MAX_DATAGRAM_SIZE:
            return None
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self.cid_length)
        except ValueError:
            return None
        if header.packet_type != QuicPacketType.INITIAL or header.version is None:
            return None
        if not self._allowed(now):
            return None
        self.refusals += 1
        return refusal(header.version, header.destination_cid, header.source_cid)

    def respond(self, data: bytes, now: float) -> bytes | None:
        """What a stand-in for a process that is gone says to any datagram."""
        return self.reset(data, now) if is_short_header(data) else self.refuse(data, now)


def refusal(version: int, client_dcid: bytes, client_scid: bytes) -> bytes:
    """A server Initial carrying CONNECTION_CLOSE(CONNECTION_REFUSED), protected with the
    Initial keys of the client's chosen destination ID, as aioquic's server builds its own
    INVALID_TOKEN close (asyncio/server.py, private there)."""
    crypto = CryptoPair()
    crypto.setup_initial(cid=client_dcid, is_client=False, version=version)
    builder = QuicPacketBuilder(
        host_cid=client_dcid,
        is_client=False,
        max_datagram_size=SMALLEST_MAX_DATAGRAM_SIZE,
        peer_cid=client_scid,
        version=version,
    )
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    buf = builder.start_frame(
        QuicFrameType.TRANSPORT_CLOSE,
        capacity=TRANSPORT_CLOSE_FRAME_CAPACITY + len(REFUSED_REASON),
    )
    buf.push_uint_var(QuicErrorCode.CONNECTION_REFUSED)
    buf.push_uint_var(QuicFrameType.PADDING)
    buf.push_uint_var(len(REFUSED_REASON))
    buf.push_bytes(REFUSED_REASON)
    datagrams, _ = builder.flush()
    return datagrams[0]
