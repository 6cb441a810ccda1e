"""The link model: what one direction of a link does to the datagrams offered to it.

Sans-IO, like aioquic: every call takes `now`, and nothing here touches a socket or a clock. A rate
(serialisation delay behind a drop-tail FIFO queue), a one-way propagation delay, and loss, i.i.d.
or bursty (Gilbert-Elliott), under a seeded generator. The virtual-time link (`simlink.py`) and the
UDP relay (`relay.py`) both drive it, so a test in virtual time and a live run see one model.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GilbertElliott:
    """Bursty loss: a two-state Markov chain stepped in fixed slots (seed 002 §4.1).

    Parameters are mean durations, not the seed's p and q, whose text and figures disagree on
    what p means. The defaults are its default case: good periods of 1,000 ms on average with
    no loss, lossy periods of 200 ms with 90% loss, in 100 ms slots; about 15% loss overall.
    """

    good_s: float = 1.0
    bad_s: float = 0.2
    bad_loss: float = 0.9
    good_loss: float = 0.0
    slot_s: float = 0.1

    @property
    def mean_loss(self) -> float:
        bad_share = self.bad_s / (self.good_s + self.bad_s)
        return bad_share * self.bad_loss + (1 - bad_share) * self.good_loss


@dataclass(frozen=True)
class LinkConfig:
    rate_bps: float = 5e6
    delay_s: float = 0.025
    """One way."""
    loss: float = 0.0
    """Probability that a datagram is dropped, each direction independently."""
    bursts: GilbertElliott | None = None
    """Bursty loss instead of `loss`, one chain per direction."""
    queue_bytes: int = 64 * 1024
    """Drop-tail buffer in front of the link, each direction."""
    seed: int = 0


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

    def _lost(self, now: float) -> bool:
        bursts = self.config.bursts
        if bursts is None:
            return self.rng.random() < self.config.loss
        slot = int(now / bursts.slot_s)
        if self.slot is None:  # live clocks start anywhere
            self.slot = slot
        for _ in range(slot - self.slot):  # one transition per slot boundary crossed
            leave = bursts.slot_s / (bursts.bad_s if self.bad else bursts.good_s)
            if self.rng.random() < leave:
                self.bad = not self.bad
        self.slot = max(self.slot, slot)
        return self.rng.random() < (bursts.bad_loss if self.bad else bursts.good_loss)

    def admit(self, size: int, now: float) -> float | None:
        """The arrival time of a datagram offered now, or None if it is lost."""
        # Departures are in the order of admission (the link is FIFO), so the queue is a deque
        # and its bytes a running sum: O(1) a packet where summing it was O(queue).
        while self.queued and self.queued[0][0] <= now:
            self.queued_bytes -= self.queued.popleft()[1]
        if self.queued_bytes + size > self.config.queue_bytes:
            self.dropped += 1
            return None
        start = max(now, self.busy_until)
        self.busy_until = start + size * 8 / self.config.rate_bps
        self.queued.append((self.busy_until, size))
        self.queued_bytes += size
        self.sent += 1
        self.bytes_sent += size
        if self._lost(start):
            self.dropped += 1
            return None
        return self.busy_until + self.config.delay_s
