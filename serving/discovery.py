"""Engine hosts found through DNS, as a Kubernetes headless Service gives them: one address per
ready pod.

A placement entry with `engine_host: NAME:PORT` and `hosts: N` puts its replicas on N slots
(`HostSlot`), each a place of its own in the router's view. The view keeps all N places whether
or not a host fills them (an empty one is down), because a trained policy reads a state of a
fixed size. Every RESOLVE_S, and at once when a link is lost, the front-end resolves NAME:

- an address that is new takes the first free slot, and is connected to;
- a slot whose address left is freed, so it takes no new request, while its link stays open
  until the requests on it have ended: a host removed from DNS while it serves (a pod that is
  terminating, a scale-down) finishes them. A host whose link still answers is freed only once
  two answers in a row leave it out (MISSED_ANSWERS), so that one spurious "no such name" (a
  DNS server restarting) does not take the fleet out; one whose link is lost, at once;
- an answer that fails (a timeout, a server that is down) changes nothing: a DNS outage is not a
  fleet outage.

Every worker of a front-end host keeps its own slots, filled in the order it saw the hosts, so
two workers may hold one host in different slots: the workers' shared counts (by slot) are not
read for slotted replicas, whose engine hosts report every front-end's requests anyway
(`serving.replicas.ReplicaSet`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable

from serving.engines.base import EngineUnavailable
from serving.engines.engine_link import EngineLink, HostSlot, link_address

log = logging.getLogger(__name__)

RESOLVE_S = 2.0
"""How often the names are resolved again: with Kubernetes' DNS (CoreDNS answers with a TTL of
5 s), a host that became ready is routed to within about 7 s."""
RESOLVE_TIMEOUT_S = 2.0
MISSED_ANSWERS = 2
"""Answers in a row that must leave out a host whose link still answers before it is let go."""

Resolve = Callable[[str], Awaitable[list[str] | None]]
"""A name's addresses, sorted; None where the answer failed (and says nothing of the hosts)."""


def dns_resolver(server: str | None = None) -> Resolve:
    """Resolve with the system's DNS configuration (a pod's: the cluster's DNS and its search
    domains), or with the server at `server` (HOST:PORT) alone."""
    # dnspython rather than getaddrinfo: it names a server and port of its own (tests run a
    # real dnsmasq on a free port), asks no cache, and tells "no such host" from a failure.
    import dns.asyncresolver
    import dns.exception
    import dns.resolver

    resolver = dns.asyncresolver.Resolver(configure=server is None)
    if server is not None:
        where = link_address(server)
        if isinstance(where, str):
            raise ValueError(f"a DNS server is HOST:PORT, got {server!r}")
        resolver.nameservers, resolver.port = [where[0]], where[1]
    said: set[str] = set()

    async def resolve(name: str) -> list[str] | None:
        with contextlib.suppress(ValueError):
            return [str(ipaddress.ip_address(name))]
        for kind in ("A", "AAAA"):  # IPv6 where the name has no IPv4 address (a v6 cluster)
            try:
                answer = await resolver.resolve(name, kind, search=True, lifetime=RESOLVE_TIMEOUT_S)
            except dns.resolver.NXDOMAIN:
                return []
            except dns.resolver.NoAnswer:
                continue
            except dns.exception.DNSException as exc:
                problem = f"{type(exc).__name__}: {exc}"
                if problem not in said:  # once per reason: DNS away for an hour logs once
                    said.add(problem)
                    log.warning("resolving %s failed (%s): the engine hosts stay as they are",
                                name, problem)  # fmt: skip
                return None
            return sorted({record.address for record in answer})
        return []

    return resolve


class Discovery:
    """Keeps `slots` filled with the engine hosts behind `address` (NAME:PORT)."""

    def __init__(
        self,
        address: str,
        slots: list[HostSlot],
        token: str | None,
        resolve: Resolve,
        period_s: float = RESOLVE_S,
    ) -> None:
        where = link_address(address)
        if isinstance(where, str):
            raise ValueError(f"an engine host found through DNS is NAME:PORT, got {address!r}")
        self.address = address
        self.name, self.port = where
        self.slots = slots
        self.token = token
        self.resolve = resolve
        self.period_s = period_s
        self._held: dict[str, HostSlot] = {}
        self._missed: dict[str, int] = {}
        self._draining: list[EngineLink] = []
        self._connecting: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._full_said = False
        self._empty_said = False

    @property
    def hosts(self) -> list[str]:
        """The addresses (HOST:PORT) holding a slot, in slot order."""
        return [slot.link.path for slot in self.slots if slot.link is not None]

    @property
    def draining(self) -> list[str]:
        """The addresses that left, with requests still in flight."""
        return [link.path for link in self._draining]

    async def run(self) -> None:
        """Resolve every `period_s`, and when a link is lost, until cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.period_s):
                    await self._wake.wait()
            self._wake.clear()
            await self.refresh(wait=False)

    async def refresh(self, wait: bool = True) -> None:
        """Resolve once; fill and free the slots by the answer; connect to the newcomers (and,
        with `wait`, wait for them: at start, so that the server starts with its hosts)."""
        answer = await self.resolve(self.name)
        if answer is not None:
            if not answer and not self._empty_said:  # once, until an address comes back
                log.warning("DNS has no address for %s: no engine host behind it", self.name)
            self._empty_said = not answer
        joined = [] if answer is None else self.update(answer)
        # `connected` first: a host that left DNS and then went silent is found lost here too.
        for link in [link for link in self._draining if not link.connected or not link.in_flight]:
            link.retire()
            self._draining.remove(link)
        connects = [asyncio.create_task(self._connect(link)) for link in joined]
        if wait:
            await asyncio.gather(*connects)
        else:  # a host that does not answer must not hold up the next resolve
            self._connecting.update(connects)
            for task in connects:
                task.add_done_callback(self._connecting.discard)

    @staticmethod
    async def _connect(link: EngineLink) -> None:
        with contextlib.suppress(EngineUnavailable):  # the supervisor tries again
            await link.connect()

    def update(self, found: list[str]) -> list[EngineLink]:
        """Take `found`, the name's addresses, as the hosts; the links of those that joined."""
        addresses = [f"[{a}]:{self.port}" if ":" in a else f"{a}:{self.port}"
                     for a in sorted(found)]  # fmt: skip
        for address in list(self._held):
            if address in addresses:
                self._missed.pop(address, None)
                continue
            missed = self._missed[address] = self._missed.get(address, 0) + 1
            link = self._held[address].link
            if missed < MISSED_ANSWERS and link is not None and link.connected:
                continue
            self._missed.pop(address, None)
            slot = self._held.pop(address)
            assert slot.link is not None
            log.info("engine host %s left %s (slot %d): it finishes its %d requests in flight",
                     address, self.address, self.slots.index(slot),
                     slot.link.in_flight)  # fmt: skip
            self._draining.append(slot.link)
            slot.link = None
        joined: list[EngineLink] = []
        free = [slot for slot in self.slots if slot.link is None]
        for address in [a for a in addresses if a not in self._held]:
            if not free:
                if not self._full_said:
                    self._full_said = True
                    log.warning("%s has more engine hosts than its %d slots (hosts:): %s and "
                                "any more go unused", self.address, len(self.slots),
                                address)  # fmt: skip
                break
            slot = free.pop(0)
            slot.link = EngineLink(address, self.token, on_lost=self._wake.set)
            self._held[address] = slot
            joined.append(slot.link)
            log.info("engine host %s found behind %s (slot %d)", address, self.address,
                     self.slots.index(slot))  # fmt: skip
        return joined

    def close(self) -> None:
        """Close the links of the hosts that left (the slots' close with their engines)."""
        for task in self._connecting:
            task.cancel()
        for link in self._draining:
            link.retire()
        self._draining.clear()


class HostCount:
    """How many hosts a DNS name has behind it (the front-ends' own headless Service), for
    `on_count` to share per-key limits among: at each `refresh`, and every RESOLVE_S in `run`.
    A failed or empty answer keeps the last count (this host is one, whatever DNS says)."""

    def __init__(
        self, name: str, resolve: Resolve, on_count: Callable[[int], None],
        period_s: float = RESOLVE_S,
    ) -> None:  # fmt: skip
        self.name = name
        self.resolve = resolve
        self.on_count = on_count
        self.period_s = period_s
        self.count = 1

    async def refresh(self) -> None:
        found = await self.resolve(self.name)
        if found and len(found) != self.count:
            log.info("%d front-end hosts behind %s: each admits 1/%d of each key's limits",
                     len(found), self.name, len(found))  # fmt: skip
            self.count = len(found)
            self.on_count(self.count)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.refresh()
