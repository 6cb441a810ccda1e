"""Two aioquic connections driven against each other in virtual time, over a simulated link.

aioquic is sans-IO: every call takes `now`. This drives a client and a server connection in one
process through a link with a rate (serialisation delay and a FIFO queue), a one-way propagation
delay and random loss, all in virtual time under a seed. The same seed gives the same packets,
losses and timings, so scheduler behaviour can be tested exactly and fast: seconds of link time
take milliseconds. The link itself is `transport.link`'s model, which the UDP relay drives too.
The kernel here has no netem (FACTS); the real-network emulator is for the live system, this
is for tests and simulations.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent

from transport.link import LinkConfig

CLIENT_ADDR = ("10.0.0.1", 4433)
SERVER_ADDR = ("10.0.0.2", 443)

DEFAULT_LINK = LinkConfig()

EventHandler = Callable[[QuicConnection, QuicEvent, float], None]
"""(the connection that produced it, the event, now)."""


class SimulatedPath:
    """Carries datagrams between `client` and `server`; handlers see every event."""

    def __init__(
        self,
        client: QuicConnection,
        server: QuicConnection,
        config: LinkConfig = DEFAULT_LINK,
        on_event: EventHandler = lambda connection, event, now: None,
    ) -> None:
        self.client, self.server = client, server
        self.config = config
        self.on_event = on_event
        self._up, self._down = config.directions()
        self._in_flight: list[tuple[float, int, QuicConnection, bytes, tuple[str, int]]] = []
        self._calls: list[tuple[float, int, Callable[[float], None]]] = []
        self._order = itertools.count()
        self.now = 0.0
        self._speaking = {id(client)}  # a server has no path to send on until it hears one
        self.client.connect(SERVER_ADDR, now=self.now)

    @property
    def losses(self) -> tuple[int, int]:
        """Datagrams dropped (client to server, server to client)."""
        return self._up.dropped, self._down.dropped

    @property
    def bytes_sent(self) -> tuple[int, int]:
        """UDP payload bytes put on the link (client to server, server to client), lost or not."""
        return self._up.bytes_sent, self._down.bytes_sent

    def call_at(self, when: float, callback: Callable[[float], None]) -> None:
        """Run `callback(now)` at virtual time `when`, as an application's timer would; what it
        makes the connections send goes out at once."""
        heapq.heappush(self._calls, (max(when, self.now), next(self._order), callback))

    def run(self, until: Callable[[], bool], timeout: float = 60.0) -> float:
        """Advance virtual time until `until()` holds; returns the time. TimeoutError past
        `timeout` virtual seconds."""
        self._settle()
        while not until():
            wake = [t for t in (self.client.get_timer(), self.server.get_timer()) if t is not None]
            if self._in_flight:
                wake.append(self._in_flight[0][0])
            if self._calls:
                wake.append(self._calls[0][0])
            if not wake:
                raise RuntimeError("the simulation has nothing left to do")
            # A nanosecond past the wake-up: aioquic compares its loss timer with sent_time +
            # delay recomputed as now - delay, and at exact equality rounding can leave a packet
            # not yet lost and the timer where it was, so virtual time would never move again.
            self.now = max(self.now, min(wake) + 1e-9)
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
            while self._calls and self._calls[0][0] <= self.now:
                _, _, callback = heapq.heappop(self._calls)
                callback(self.now)
            self._settle()
        return self.now

    def transmit(self) -> None:
        """Put on the link what the connections have to send now. Called between sends, it keeps
        them in separate packets (aioquic would otherwise coalesce them into one)."""
        self._transmit()

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
