"""The recent past, for the dashboard (`serving.pages`): the router's last decisions, the last
requests that ended, and for each QoS class a sliding minute of how its requests ended.

It is fed where requests are routed (`Gateway.start`) and where they end (`Metrics.finish`),
once per request each, so it is built to cost next to nothing there: two bounded deques and a
few integer increments. The work of summing the window and shaping it for a page happens only
when someone looks (`Recent.window`), at the feed's pace, not the requests'.

Prometheus already counts all of this since the start; a live view wants the last minute, which
counters cannot give without a scraper that keeps history. This keeps that minute itself.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import astuple, dataclass
from typing import Any, NamedTuple

from serving.outcomes import RequestRecord


@dataclass(frozen=True, slots=True)
class Decision:
    """One request the gateway dispatched: what it was, where it went, and the load it found."""

    at: float
    """time.monotonic() when it was routed."""
    request_id: str
    qos_class: str
    task: str | None
    asked: str
    """The model the client asked for: `auto` (the router chose) or a model's name."""
    model: str
    replica: str
    in_flight: int
    """Requests in flight over every replica when it was routed, itself not counted."""
    at_replica: int
    """Of those, the ones at the replica it went to."""
    rate: float
    """The router's arrival-rate estimate (req/s) as it arrived."""


@dataclass(frozen=True, slots=True)
class Ended:
    """One request that ended, however it ended."""

    at: float
    request_id: str | None
    qos_class: str | None
    protocol: str | None
    """The HTTP version it came over: "1.1", "2" or "3"."""
    model: str | None
    replica: str | None
    outcome: str
    slo_met: bool
    counted: bool
    """Whether it counts for the SLO: not of the client's own doing."""
    ttft_s: float | None
    tokens: int


@dataclass(frozen=True, slots=True)
class ClassMinute:
    """How one class's requests ended within the window."""

    ended: int
    """Every request of the class that ended, whatever the outcome."""
    counted: int
    """Those that count for the SLO: all but the client's own doing (`Recent`'s `not_counted`)."""
    slo_met: int
    shed: int

    @property
    def attainment(self) -> float | None:
        """The share of counted requests that met the SLO; None when none was counted."""
        return self.slo_met / self.counted if self.counted else None

    @property
    def shed_rate(self) -> float | None:
        """The share of counted requests shed at the door (429 overloaded)."""
        return self.shed / self.counted if self.counted else None


class Merged(NamedTuple):
    """Several workers' recent past as one (`Recent.merged`)."""

    decisions: list[Decision]
    """Oldest first."""
    ended: list[Ended]
    minutes: dict[str, ClassMinute]
    workers: int
    """How many workers' records it holds."""


class _Slot:
    """One second of one class's outcomes."""

    __slots__ = ("second", "ended", "counted", "slo_met", "shed")

    def __init__(self) -> None:
        self.second = -1
        self.ended = self.counted = self.slo_met = self.shed = 0


class Recent:
    def __init__(
        self,
        not_counted: Collection[str],
        shed: str,
        keep: int = 32,
        window_s: int = 60,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`not_counted`: outcomes of the client's own making (a bad request, a refused key, a
        client that left), which say nothing of the server and count neither for nor against
        its SLO attainment; `shed`: the outcome of a request admission control turned away.
        `keep`: how many decisions and ended requests to remember; `window_s`: the window."""
        self.not_counted = frozenset(not_counted)
        self.shed = shed
        self.window_s = window_s
        self.clock = clock
        self.decisions: deque[Decision] = deque(maxlen=keep)
        self.ended: deque[Ended] = deque(maxlen=keep)
        # One ring of one-second slots per class, rather than every request of the minute: its
        # size does not grow with the rate, and a slot is reused once its second has left the
        # window (`_slot`).
        self._slots: dict[str, list[_Slot]] = {}

    def routed(self, decision: Decision) -> None:
        self.decisions.append(decision)

    def finished(self, record: RequestRecord, outcome: str, slo_met: bool) -> None:
        now = self.clock()
        ttft = None if record.first_token is None else record.first_token - record.arrival
        counted = outcome not in self.not_counted
        self.ended.append(
            Ended(
                at=now,
                request_id=record.request_id,
                qos_class=record.qos_class,
                protocol=record.protocol,
                model=record.model,
                replica=record.replica,
                outcome=outcome,
                slo_met=slo_met,
                counted=counted,
                ttft_s=ttft,
                tokens=record.tokens,
            )
        )
        if record.qos_class is None:
            return  # refused before it had a class: no class's minute to count it in
        slot = self._slot(record.qos_class, int(now))
        slot.ended += 1
        if counted:
            slot.counted += 1
            slot.slo_met += slo_met
            slot.shed += outcome == self.shed

    def _slot(self, qos_class: str, second: int) -> _Slot:
        ring = self._slots.get(qos_class)
        if ring is None:
            ring = self._slots[qos_class] = [_Slot() for _ in range(self.window_s)]
        slot = ring[second % self.window_s]
        if slot.second != second:
            slot.second = second
            slot.ended = slot.counted = slot.slo_met = slot.shed = 0
        return slot

    def window(self, now: float | None = None) -> dict[str, ClassMinute]:
        """Each class's outcomes over the last `window_s` seconds up to `now`."""
        current = int(self.clock() if now is None else now)
        oldest = current - self.window_s + 1
        minutes: dict[str, ClassMinute] = {}
        for qos_class, ring in self._slots.items():
            live = [s for s in ring if oldest <= s.second <= current]
            minutes[qos_class] = ClassMinute(
                sum(s.ended for s in live),
                sum(s.counted for s in live),
                sum(s.slo_met for s in live),
                sum(s.shed for s in live),
            )
        return minutes

    def export(self) -> dict[str, Any]:
        """The decisions, ended requests and minutes as plain data, for another worker's
        dashboard (`serving.peers`). Their times are `time.monotonic()`, one clock for every
        process of the host."""
        return {
            "decisions": [astuple(d) for d in self.decisions],
            "ended": [astuple(e) for e in self.ended],
            "minutes": {name: astuple(m) for name, m in self.window().items()},
        }

    def merged(self, exports: Collection[dict[str, Any]] = ()) -> Merged:
        """This recorder's records with other workers' (their `export`): the newest `keep` of
        each kind, and each class's minute summed."""
        keep = self.decisions.maxlen
        decisions = [*self.decisions, *(Decision(*d) for e in exports for d in e["decisions"])]
        ended = [*self.ended, *(Ended(*x) for e in exports for x in e["ended"])]
        minutes = self.window()
        for export in exports:
            for name, counts in export["minutes"].items():
                mine = minutes.get(name, ClassMinute(0, 0, 0, 0))
                minutes[name] = ClassMinute(
                    *(a + b for a, b in zip(astuple(mine), counts, strict=True))
                )
        if exports:
            decisions = sorted(decisions, key=lambda d: d.at)[-keep:] if keep else decisions
            ended = sorted(ended, key=lambda e: e.at)[-keep:] if keep else ended
        return Merged(decisions, ended, minutes, 1 + len(exports))
