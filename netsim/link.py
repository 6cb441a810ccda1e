"""The link model: what one direction of a link does to the packets offered to it.

Sans-IO, like aioquic: every call takes `now`, and nothing here touches a socket or a clock. A rate
(serialisation delay behind a drop-tail FIFO queue) or a Mahimahi packet-delivery trace, a one-way
propagation delay, and loss, i.i.d. or bursty (Gilbert-Elliott), under a seeded generator. The
virtual-time link (`simlink.py`), the UDP relay (`relay.py`) and the TUN forwarder between network
namespaces (`netem.py`) all drive it, so a test in virtual time and a live run see one model.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MTU = 1500
"""Bytes a Mahimahi delivery opportunity carries."""


@dataclass(frozen=True)
class GilbertElliott:
    """Bursty loss: a two-state Markov chain stepped once a slot (Chatterbox §4.1).

    Its periods are stated as mean lengths in slots, not as Chatterbox's p and q, whose text and
    figures disagree on what p means: the chain leaves the good state with probability
    1 / `good_slots` at each slot boundary, and the bad state with 1 / `bad_slots`. The defaults
    are Chatterbox's default case: 100 ms slots, good periods of 10 slots (1,000 ms) on average
    with no loss, lossy periods of 2 slots (200 ms) with 90% loss; about 15% loss overall.
    """

    good_slots: float = 10.0
    bad_slots: float = 2.0
    bad_loss: float = 0.9
    good_loss: float = 0.0
    slot_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.good_slots >= 1 and self.bad_slots >= 1):
            raise ValueError("Gilbert-Elliott periods must last at least one slot on average")
        if not self.slot_s > 0:
            raise ValueError("a Gilbert-Elliott slot must be longer than 0 s")
        for name in ("bad_loss", "good_loss"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"Gilbert-Elliott {name} must be in [0, 1]")

    @property
    def mean_loss(self) -> float:
        bad_share = self.bad_slots / (self.good_slots + self.bad_slots)
        return bad_share * self.bad_loss + (1 - bad_share) * self.good_loss


@dataclass(frozen=True)
class DeliveryTrace:
    """A Mahimahi packet-delivery trace: each line a millisecond at which the link can deliver
    one MTU (1500 bytes); several lines may share a millisecond. The trace loops, with a period
    of its last timestamp, as in Mahimahi's `mm-link`."""

    opportunities_ms: tuple[int, ...]
    name: str = "trace"

    def __post_init__(self) -> None:
        ms = self.opportunities_ms
        if not ms:
            raise ValueError(f"{self.name}: a delivery trace needs at least one line")
        if any(b < a for a, b in zip(ms, ms[1:], strict=False)) or ms[0] < 0:
            raise ValueError(f"{self.name}: timestamps must be non-negative and never decrease")
        if ms[-1] <= 0:
            raise ValueError(f"{self.name}: the last timestamp (the loop's period) must be > 0 ms")

    @classmethod
    def read(cls, path: str | Path) -> DeliveryTrace:
        """Parse a trace file; ValueError (naming the file and line) if it cannot be used."""
        path = Path(path)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read the delivery trace {path}: {error}") from None
        ms: list[int] = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    ms.append(int(line))
                except ValueError:
                    raise ValueError(
                        f"{path}:{number}: expected a millisecond timestamp, got {line.strip()!r}"
                    ) from None
        return cls(tuple(ms), name=str(path))

    @property
    def period_ms(self) -> int:
        return self.opportunities_ms[-1]

    @property
    def mean_rate_bps(self) -> float:
        return len(self.opportunities_ms) * MTU * 8 / (self.period_ms / 1000)

    def at(self, index: int) -> float:
        """Seconds from the trace's start to its `index`-th opportunity, counting loops."""
        loops, i = divmod(index, len(self.opportunities_ms))
        return (loops * self.period_ms + self.opportunities_ms[i]) / 1000

    def first_at_or_after(self, t: float) -> int:
        """The index of the first opportunity at or after `t` seconds from the trace's start."""
        loops, within = divmod(t * 1000, self.period_ms)
        i = bisect.bisect_left(self.opportunities_ms, within)
        return int(loops) * len(self.opportunities_ms) + i


@dataclass(frozen=True)
class LinkConfig:
    """A link: the client-to-server direction's settings, and the other direction's, which are
    the same unless `downlink` says otherwise."""

    rate_bps: float = 5e6
    delay_s: float = 0.025
    """One way."""
    loss: float = 0.0
    """Probability that a packet is dropped, each direction independently."""
    bursts: GilbertElliott | None = None
    """Bursty loss instead of `loss`, one chain per direction."""
    trace: DeliveryTrace | None = None
    """Deliver at the trace's opportunities instead of at `rate_bps`."""
    queue_bytes: int = 64 * 1024
    """Drop-tail buffer in front of the link, each direction."""
    seed: int = 0
    downlink: LinkConfig | None = None
    """The server-to-client direction, where it differs (its own `seed` and `downlink` unused)."""

    def __post_init__(self) -> None:
        if not self.rate_bps > 0 or self.rate_bps == float("inf"):
            raise ValueError(f"the link rate must be a positive number, not {self.rate_bps}")
        if not 0 <= self.delay_s < float("inf"):
            raise ValueError(f"the delay must be a non-negative number, not {self.delay_s}")
        if not 0 <= self.loss <= 1:
            raise ValueError(f"the loss rate must be in [0, 1], not {self.loss}")
        if self.queue_bytes < MTU:
            raise ValueError(f"the queue must hold at least one {MTU}-byte packet")

    @property
    def down(self) -> LinkConfig:
        return self.downlink if self.downlink is not None else self

    def directions(self) -> tuple[LinkDirection, LinkDirection]:
        """(client to server, server to client), each with its own generator from the seed."""
        rng = random.Random(self.seed)
        return (
            LinkDirection(self, random.Random(rng.random())),
            LinkDirection(self.down, random.Random(rng.random())),
        )

    def replace(self, **changes: Any) -> LinkConfig:
        return dataclasses.replace(self, **changes)


@dataclass
class LinkDirection:
    config: LinkConfig
    rng: random.Random
    busy_until: float = 0.0
    queued: deque[tuple[float, int]] = field(default_factory=deque, init=False)
    """(departure, size) of the datagrams not yet sent on, in order."""
    queued_bytes: int = field(default=0, init=False)
    dropped: int = 0
    sent: int = 0
    bytes_sent: int = 0
    bad: bool = False
    slot: int | None = None
    """The Gilbert-Elliott chain's current slot; it starts good, at the first packet."""
    origin: float | None = None
    """When the delivery trace started: at the first packet, since live clocks start anywhere."""
    opportunity: int = -1
    """The trace's opportunity now being filled, and the bytes it has left."""
    opportunity_left: int = 0

    def _lost(self, now: float) -> bool:
        bursts = self.config.bursts
        if bursts is None:
            return self.config.loss > 0 and self.rng.random() < self.config.loss
        slot = int(now / bursts.slot_s)
        if self.slot is None:
            self.slot = slot
        for _ in range(slot - self.slot):  # one transition per slot boundary crossed
            if self.rng.random() < 1 / (bursts.bad_slots if self.bad else bursts.good_slots):
                self.bad = not self.bad
        self.slot = max(self.slot, slot)
        return self.rng.random() < (bursts.bad_loss if self.bad else bursts.good_loss)

    def _departure(self, start: float, size: int, idle: bool) -> float:
        """When a packet whose turn on the link comes at `start` has left it; `idle`: nothing
        was queued before it."""
        trace = self.config.trace
        if trace is None:
            return start + size * 8 / self.config.rate_bps
        if self.origin is None:
            self.origin = start
        # Mahimahi's rule: an opportunity carries up to an MTU of what is queued when it comes,
        # a packet can span opportunities, and what an opportunity cannot use is lost with it.
        # Behind a queue, the next packet simply takes up where the last left off: finding its
        # opportunity by time would let rounding skip an opportunity in the same millisecond.
        if idle:
            self.opportunity = max(
                self.opportunity, trace.first_at_or_after(start - self.origin) - 1
            )
            self.opportunity_left = 0
        while size > 0:
            if not self.opportunity_left:
                self.opportunity += 1
                self.opportunity_left = MTU
            used = min(size, self.opportunity_left)
            size -= used
            self.opportunity_left -= used
        return self.origin + trace.at(self.opportunity)

    def admit(self, size: int, now: float) -> float | None:
        """The arrival time of a packet offered now, or None if it is lost."""
        # Departures are in the order of admission (the link is FIFO), so the queue is a deque
        # and its bytes a running sum: O(1) a packet where summing it was O(queue).
        while self.queued and self.queued[0][0] <= now:
            self.queued_bytes -= self.queued.popleft()[1]
        if self.queued_bytes + size > self.config.queue_bytes:
            self.dropped += 1
            return None
        start = max(now, self.busy_until)
        self.busy_until = self._departure(start, size, idle=now > self.busy_until)
        self.queued.append((self.busy_until, size))
        self.queued_bytes += size
        self.sent += 1
        self.bytes_sent += size
        if self._lost(start):
            self.dropped += 1
            return None
        return self.busy_until + self.config.delay_s
