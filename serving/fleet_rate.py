"""The arrival rate across front-end hosts: what each worker routes on is the whole fleet's, not
its own host's alone.

The estimator's level is a sum of decaying terms, one per arrival (`ArrivalRateEstimator`), so
levels add up across processes: within a host the workers already add theirs through shared
memory (`serving.shared_view.SharedArrivalRate`). Across hosts, every RATE_EXCHANGE_S each
worker sends its own level, decayed to the moment of sending, over its engine links; each
engine host passes it on to every other front-end connected to it (`serving.engine_host`). A
receiver stamps the level with its own clock as it hears it (no clock is compared across hosts;
the one-way delay on a cluster's network is well under the exchange's period) and decays it from
there. It hears each sender once per engine host: the latest word counts, once. A sender not
heard for HEARD_S has left, and no longer counts.

Why through the engine hosts: every front-end already holds a connection to each of them, and
nothing else connects the front-ends to each other.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable

from router.features import ArrivalRateEstimator
from serving.engines.engine_link import EngineLink

RATE_EXCHANGE_S = 0.1
"""How often each worker sends its level: a tenth of a second on a level whose horizon is
10 s."""
HEARD_S = 1.0
HOST_ID_ENV = "_QOS_FRONT_END_HOST"
"""Set by `python -m serving` for its workers: which front-end host a level comes from, so that
a worker leaves out its own host's (already in its shared view)."""


def front_end_host() -> str:
    """This front-end host's id: its workers' shared one, else a new one (set for them)."""
    return os.environ.setdefault(HOST_ID_ENV, secrets.token_hex(6))


class FleetArrivalRate(ArrivalRateEstimator):
    """`inner` (this worker's estimate, or its host's shared one), plus the levels the other
    front-end hosts' workers sent."""

    def __init__(
        self,
        inner: ArrivalRateEstimator,
        worker: int,
        host: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(inner.horizon_s)
        self.inner = inner
        self.host = host
        self.sender = f"{host}/{worker}"
        self.clock = clock
        self._heard: dict[str, tuple[float, float]] = {}
        """Sender -> its level, and when it was heard."""

    def observe(self, now: float) -> float:
        return self.inner.observe(now) + self.others(now)

    def value(self, now: float) -> float:
        return self.inner.value(now) + self.others(now)

    def level(self, now: float) -> float:
        """This worker's own level: what it sends."""
        return self.inner.level(now)

    def heard(self, sender: str, level: float) -> None:
        if not sender.startswith(f"{self.host}/"):  # this host's: in `inner` already
            self._heard[sender] = (level, self.clock())

    def others(self, now: float) -> float:
        """The other hosts' levels, each decayed from when it was heard to `now`."""
        total = 0.0
        for sender, (level, at) in list(self._heard.items()):
            if now - at > HEARD_S:
                del self._heard[sender]
                continue
            total += level * math.exp(-max(0.0, now - at) / self.horizon_s)
        return total


async def exchange(rate: FleetArrivalRate, links: Callable[[], Iterable[EngineLink]]) -> None:
    """Every RATE_EXCHANGE_S, send this worker's level over every engine link on TCP that
    `links` gives (the set changes as hosts are found), and hear the others' on them."""
    while True:
        await asyncio.sleep(RATE_EXCHANGE_S)
        level = rate.level(rate.clock())
        for link in links():
            if link.remote and link.connected:
                link.on_rate = rate.heard
                link.send(["rate", rate.sender, level])
