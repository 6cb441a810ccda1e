"""Two aioquic connections driven against each other in virtual time, over a simulated link.

aioquic is sans-IO: every call takes `now`. This drives a client and a server connection in one
process through a link with a rate (serialisation delay and a FIFO queue), a one-way propagation
delay and random loss, all in virtual time under a seed. The same seed gives the same packets,
losses and timings, so scheduler behaviour can be tested exactly and fast: seconds of link time
take milliseconds. The link itself is `netsim.link`'s model, which the UDP relay drives too.
The development VM's kernel has no netem (`sch_netem`); the real-network emulator is for the
live system, this is for tests and simulations.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent

from netsim.link import LinkConfig, LinkDirection

CLIENT_ADDR = ("10.0.0.1", 4433)
SERVER_ADDR = ("10.0.0.2", 443)

DEFAULT_LINK = LinkConfig()

EventHandler = Callable[[QuicConnection, QuicEvent, float], None]
"""(the connection that produced it, the event, now)."""


class SimulatedPath:
    """Carries datagrams between client and server connections; handlers see every event.

    It starts with one pair, `client` and `server`. `connect` adds more pairs over the same link,
    as a browser opens a TCP connection per request: they share its queues, rate and losses.
    Only the connections that something happened to are polled, so a link with thousands of
    pairs, most of them idle or finished, costs what its busy ones do."""

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
        self._ends: dict[int, _End] = {}
        self._speaking: set[int] = set()  # a server has no path to send on until it hears one
        self._dirty: dict[int, QuicConnection] = {}  # to poll, in order (a dict as ordered set)
        self._timers: list[tuple[float, int, QuicConnection]] = []  # may hold stale entries
        self._armed: dict[int, float] = {}  # each connection's live entry in _timers
        self.connect(client, server)

    def connect(self, client: QuicConnection, server: QuicConnection) -> None:
        """Start `client`'s handshake with `server` over this link, now."""
        address = (CLIENT_ADDR[0], CLIENT_ADDR[1] + len(self._ends) // 2)
        self._ends[id(client)] = _End(server, self._up, address)
        self._ends[id(server)] = _End(client, self._down, SERVER_ADDR)
        self._speaking.add(id(client))
        client.connect(SERVER_ADDR, now=self.now)
        self.touch(client)

    def disconnect(self, *connections: QuicConnection) -> None:
        """Forget connections that are done: what is still in flight to them is dropped."""
        for connection in connections:
            self._ends.pop(id(connection), None)
            self._speaking.discard(id(connection))
            self._dirty.pop(id(connection), None)
            self._armed.pop(id(connection), None)

    def touch(self, connection: QuicConnection) -> None:
        """`connection` may have something to send: a callback that writes to a connection
        other than the first pair's says so."""
        self._dirty[id(connection)] = connection

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
        # The caller may have written to the first pair since the last run, without a touch.
        self.touch(self.client)
        self.touch(self.server)
        self._settle()
        while not until():
            wake = [self._timers[0][0]] if self._timers else []
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
                if id(destination) in self._ends:
                    destination.receive_datagram(data, source, now=self.now)
                    self._speaking.add(id(destination))
                    self.touch(destination)
            while self._timers and self._timers[0][0] <= self.now:
                due, _, connection = heapq.heappop(self._timers)
                if self._armed.get(id(connection)) != due:
                    continue  # superseded by a later entry, or its connection is gone
                del self._armed[id(connection)]
                timer = connection.get_timer()
                if timer is not None and timer <= self.now:
                    connection.handle_timer(now=self.now)
                self.touch(connection)  # polled again, so that its next timer is armed
            while self._calls and self._calls[0][0] <= self.now:
                _, _, callback = heapq.heappop(self._calls)
                callback(self.now)
                self.touch(self.client)
                self.touch(self.server)
            self._settle()
        return self.now

    def transmit(self) -> None:
        """Put on the link what the first pair has to send now. Called between sends, it keeps
        them in separate packets (aioquic would otherwise coalesce them into one)."""
        for connection in (self.client, self.server):
            self._transmit(connection)

    def _settle(self) -> None:
        """Deliver events and send what they cause, until the touched connections are quiet."""
        polled: dict[int, QuicConnection] = {}
        while self._dirty:
            batch = list(self._dirty.values())
            self._dirty.clear()
            busy = False
            for connection in batch:
                while (event := connection.next_event()) is not None:
                    busy = True
                    self.on_event(connection, event, self.now)
            for connection in batch:
                busy |= self._transmit(connection)
            polled.update((id(c), c) for c in batch)
            if busy:  # a handler may have written to them, or to the first pair
                for connection in (*batch, self.client, self.server):
                    self.touch(connection)
        for connection in polled.values():
            timer = connection.get_timer()
            key = id(connection)
            # One live entry a connection: pushing every poll's timer again piled up thousands
            # of stale entries, each a wake-up for nothing.
            if timer is not None and key in self._ends and self._armed.get(key) != timer:
                self._armed[key] = timer
                heapq.heappush(self._timers, (timer, next(self._order), connection))

    def _transmit(self, connection: QuicConnection) -> bool:
        end = self._ends.get(id(connection))
        if end is None or id(connection) not in self._speaking:
            return False
        any_sent = False
        for data, _ in connection.datagrams_to_send(now=self.now):
            any_sent = True
            arrival = end.direction.admit(len(data), self.now)
            if arrival is not None:
                item = (arrival, next(self._order), end.peer, data, end.address)
                heapq.heappush(self._in_flight, item)
        return any_sent


@dataclass(frozen=True)
class _End:
    """One connection's end of the link: whom it talks to, which direction it sends on, and the
    address its datagrams come from."""

    peer: QuicConnection
    direction: LinkDirection
    address: tuple[str, int]
