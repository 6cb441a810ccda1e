"""The TUN forwarder: copies IP packets between TUN devices through `netsim.link`'s model.

`netsim.netem` opens one TUN device for each end of each link, moves them into its network
namespaces, and starts this as a child process with their file descriptors, so that real kernel
TCP and UDP cross the emulated link. It runs in its own process so that the emulated link keeps
its timing whatever the processes at either end are doing, and so that it dies with its parent:
it exits when its stdin (a pipe from the parent) closes, even after a SIGKILL of the parent.

`python -m netsim.forwarder` reads its `Spec` pickled on stdin; it is not for people to run.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import os
import pickle
import select
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from netsim.link import LinkConfig, LinkDirection

NETWORK = bytes([10, 77])
"""The /16 that the emulator's namespaces live in; a packet addressed elsewhere is dropped, so
traffic only ever goes to addresses inside the namespaces it made."""

BATCH = 64
"""Packets read from one device before the others get a turn."""


@dataclass(frozen=True)
class LinkFds:
    client_side: int
    """The TUN device at the client end (file descriptor)."""
    server_side: int
    config: LinkConfig


@dataclass(frozen=True)
class Spec:
    links: tuple[LinkFds, ...]
    stats_path: str | None = None
    """Where to write what happened (JSON) on exit."""


@dataclass
class Lateness:
    """How much later than the model said a packet was written, in microseconds: a histogram in
    10 µs bins, so that it costs nothing a packet and its percentiles stay exact to the bin."""

    bins: dict[int, int] = field(default_factory=dict)
    count: int = 0

    def add(self, seconds: float) -> None:
        b = max(0, int(seconds * 1e5))
        self.bins[b] = self.bins.get(b, 0) + 1
        self.count += 1

    def percentile(self, q: float) -> float:
        """Microseconds (bin's upper edge) under which a share `q` of packets were written."""
        seen, need = 0, q * self.count
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen >= need:
                return (b + 1) * 10.0
        return 0.0


def _is_ours(packet: bytes) -> bool:
    return len(packet) >= 20 and packet[0] >> 4 == 4 and packet[16:18] == NETWORK


def forward(spec: Spec, stop_fd: int) -> dict[str, object]:
    """Forward until `stop_fd` is readable or closed; returns what happened."""
    routes: dict[int, tuple[LinkDirection, int]] = {}
    directions: list[tuple[str, LinkDirection]] = []
    for i, link in enumerate(spec.links):
        up, down = link.config.directions()
        routes[link.client_side] = (up, link.server_side)
        routes[link.server_side] = (down, link.client_side)
        directions += [(f"link {i} up", up), (f"link {i} down", down)]
        for fd in (link.client_side, link.server_side):
            os.set_blocking(fd, False)
    readable = [stop_fd, *routes]
    pending: list[tuple[float, int, int, bytes]] = []
    order = itertools.count()
    lateness = Lateness()
    foreign = 0
    while True:
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        ready, _, _ = select.select(readable, [], [], timeout)
        if stop_fd in ready:
            break
        now = time.monotonic()
        for fd in ready:
            direction, out = routes[fd]
            for _ in range(BATCH):
                try:
                    packet = os.read(fd, 65535)
                except BlockingIOError:
                    break
                except OSError:  # its namespace is being torn down
                    readable.remove(fd)
                    break
                if not _is_ours(packet):  # IPv6 neighbour chatter, or an address not ours
                    foreign += 1
                    continue
                arrival = direction.admit(len(packet), now)
                if arrival is not None:
                    heapq.heappush(pending, (arrival, next(order), out, packet))
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            due, _, out, packet = heapq.heappop(pending)
            lateness.add(now - due)
            with contextlib.suppress(OSError):  # the far end is gone or full: lost on the wire
                os.write(out, packet)
            now = time.monotonic()
    return {
        "directions": {
            name: {"sent": d.sent, "dropped": d.dropped, "bytes": d.bytes_sent}
            for name, d in directions
        },
        "foreign_packets": foreign,
        "lateness_us": {
            "packets": lateness.count,
            "p50": lateness.percentile(0.5),
            "p99": lateness.percentile(0.99),
            "p999": lateness.percentile(0.999),
            "max": lateness.percentile(1.0),
        },
    }


def main() -> None:
    spec: Spec = pickle.loads(sys.stdin.buffer.read(int(sys.stdin.buffer.readline())))
    stats = forward(spec, sys.stdin.fileno())
    if spec.stats_path is not None:
        Path(spec.stats_path).write_text(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
