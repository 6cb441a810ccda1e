"""Two aioquic connections driven against each other in virtual time, over a simulated link.

aioquic is sans-IO: every call takes `now`. This drives a client and a server connection in one
process through a link with a rate (serialisation delay and a FIFO queue), a one-way propagation
delay and random loss, all in virtual time under a seed. The same seed gives the same packets,
losses and timings, so scheduler behaviour can be tested exactly and fast: seconds of link time
take milliseconds. The kernel here has no netem (FACTS); the real-network emulator is for the
live system, this is for tests and simulations.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent

CLIENT_ADDR = ("10.0.0.1", 4433)
SERVER_ADDR = ("10.0.0.2", 443)

EventHandler = Callable[[QuicConnection, QuicEvent, float], None]
"""(the connection that produced it, the event, now)."""


@dataclass(frozen=True)
class LinkConfig:
    rate_bps: float = 5e6
    delay_s: float = 0.025
    """One way."""
    loss: float = 0.0
    """Probability that a datagram is dropped, each direction independently."""
    queue_bytes: int = 64 * 1024
    """Drop-tail buffer in front of the link, each direction."""
    seed: int = 0


@dataclass
class _Direction:
    config: LinkConfig
    rng: random.Random
    busy_until: float = 0.0
    queued: list[tuple[float, int]] = field(default_factory=list)  # (departure, size) pending
    dropped: int = 0
    sent: int = 0

    def admit(self, size: int, now: float) -> float | None:
        """The arrival time of a datagram offered now, or None if it is lost."""
        while self.queued and self.queued[0][0] <= now:
            heapq.heappop(self.queued)
        if sum(s for _, s in self.queued) + size > self.config.queue_bytes:
            self.dropped += 1
            return None
        start = max(now, self.busy_until)
        self.busy_until = start + size * 8 / self.config.rate_bps
        heapq.heappush(self.queued, (self.busy_until, size))
        self.sent += 1
        if self.rng.random() < self.config.loss:
            self.dropped += 1
            return None
        return self.busy_until + self.config.delay_s


class SimulatedPath:
    """Carries datagrams between `client` and `server`; handlers see every event."""

    def __init__(
        self,
        client: QuicConnection,
        server: QuicConnection,
        config: LinkConfig = LinkConfig(),
        on_event: EventHandler = lambda connection, event, now: None,
    ) -> None:
        self.client, self.server = client, server
        self.config = config
        self.on_event = on_event
        rng = random.Random(config.seed)
        self._up = _Direction(config, random.Random(rng.random()))
        self._down = _Direction(config, random.Random(rng.random()))
        self._in_flight: list[tuple[float, int, QuicConnection, bytes, tuple[str, int]]] = []
        self._order = itertools.count()
        self.now = 0.0
        self._speaking = {id(client)}  # a server has no path to send on until it hears one
        self.client.connect(SERVER_ADDR, now=self.now)

    @property
    def losses(self) -> tuple[int, int]:
        """Datagrams dropped (client to server, server to client)."""
        return self._up.dropped, self._down.dropped

    def run(self, until: Callable[[], bool], timeout: float = 60.0) -> float:
        """Advance virtual time until `until()` holds; returns the time. TimeoutError past
        `timeout` virtual seconds."""
        self._settle()
        while not until():
            wake = [t for t in (self.client.get_timer(), self.server.get_timer()) if t is not None]
            if self._in_flight:
                wake.append(self._in_flight[0][0])
            if not wake:
                raise RuntimeError("the simulation has nothing left to do")
            self.now = max(self.now, min(wake))
            if self.now > timeout:
                raise TimeoutError(f"not done after {timeout} s of virtual time")
            while self._in_flight and self._in_flight[0][0] <= self.now:
                _, _, destination, data, source = heapq.heappop(self._in_flight)
                destination.receive_datagram(data, source, now=self.now)
                self._speaking.add(id(destination))
            for connection in (self.client, self.server):
                timer = connection.get_timer()
                if timer is not None and timer <= self.now:
                    connection.handle_timer(now=self.now)
            self._settle()
        return self.now

    def _settle(self) -> None:
        """Deliver events and send what they cause, until both sides are quiet for now."""
        busy = True
        while busy:
            busy = False
            for connection in (self.client, self.server):
                while (event := connection.next_event()) is not None:
                    busy = True
                    self.on_event(connection, event, self.now)
            busy |= self._transmit()

    def _transmit(self) -> bool:
        any_sent = False
        for connection, direction, destination, source in (
            (self.client, self._up, self.server, CLIENT_ADDR),
            (self.server, self._down, self.client, SERVER_ADDR),
        ):
            if id(connection) not in self._speaking:
                continue
            for data, _ in connection.datagrams_to_send(now=self.now):
                any_sent = True
                arrival = direction.admit(len(data), self.now)
                if arrival is not None:
                    item = (arrival, next(self._order), destination, data, source)
                    heapq.heappush(self._in_flight, item)
        return any_sent
