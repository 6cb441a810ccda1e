"""Per-key limits: a request rate (token bucket) and a number of requests in flight.

Logic only: every call takes `now`, so it runs the same in tests on a virtual clock. The keys
it tracks are the configured ones plus one shared anonymous bucket, so its state is bounded.
With several workers, the accounts live in a file every worker maps (`SharedAccounts`).
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from config import Deployment, Limits

RATE = "rate"
CONCURRENT = "concurrent"


class OverLimit(Exception):
    """The key is over one of its limits; `retry_after_s` says when to try again."""

    def __init__(self, limit: str, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.message = message


class _Accounts(Protocol):
    """Where the limiter keeps each key's bucket and its requests in flight."""

    def locked(self) -> AbstractContextManager[object]:
        """Held across one admission's read and write."""
        ...

    def bucket(self, key: str | None) -> tuple[float, float] | None:
        """The key's tokens and when they were counted; None for a key not seen yet."""
        ...

    def set_bucket(self, key: str | None, tokens: float, stamp: float) -> None: ...

    def in_flight(self, key: str | None) -> int: ...

    def hold(self, key: str | None, change: int) -> None:
        """Count one more (or one fewer) request of the key in flight."""
        ...


class _LocalAccounts:
    """One process's accounts: the keys it has seen, in a dict."""

    def __init__(self) -> None:
        self._buckets: dict[str | None, tuple[float, float]] = {}
        self._in_flight: dict[str | None, int] = {}

    def locked(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()

    def bucket(self, key: str | None) -> tuple[float, float] | None:
        return self._buckets.get(key)

    def set_bucket(self, key: str | None, tokens: float, stamp: float) -> None:
        self._buckets[key] = (tokens, stamp)

    def in_flight(self, key: str | None) -> int:
        return self._in_flight.get(key, 0)

    def hold(self, key: str | None, change: int) -> None:
        self._in_flight[key] = max(0, self._in_flight.get(key, 0) + change)


def key_slots(deployment: Deployment) -> list[str]:
    """The configured keys in the order of their shared accounts (the anonymous one after)."""
    return sorted(deployment.key_limits)


_HEAD = 2
"""A shared account: its tokens and their time, then one in-flight count per worker."""


class SharedAccounts:
    """The accounts of every worker of one server (`--workers N`), in a file each maps: limits
    hold for the whole server, not per worker.

    A key's bucket is one value that every worker reads and writes, so an admission holds an
    exclusive `flock` on the file across its read and write: two workers never both take the
    last token. The kernel drops the lock of a process that dies, so a killed worker never
    leaves it held. Each worker counts its own requests in flight in a cell of its own, written
    by it alone (a release takes no lock); an admission sums every worker's cells under the
    lock. No key can go over its rate or its concurrency on one host, then, by even one
    request. The supervisor zeroes a dead worker's cells: its requests ended with it."""

    def __init__(self, path: Path, keys: list[str], workers: int, create: bool) -> None:
        self.workers = workers
        self.index = 0
        """This worker's cell of each account (`for_worker`)."""
        self._slot = {key: i for i, key in enumerate(keys)}
        self._width = _HEAD + workers
        size = 8 * self._width * (len(keys) + 1)  # + the anonymous requests' one account
        self._file = open(path, "w+b" if create else "r+b")  # noqa: SIM115 (held while mapped)
        if create:
            self._file.truncate(size)
        self._block = mmap.mmap(self._file.fileno(), size)
        self._counts = memoryview(self._block).cast("q")
        self._values = memoryview(self._block).cast("d")

    def for_worker(self, index: int) -> SharedAccounts:
        self.index = index
        return self

    def _at(self, key: str | None) -> int:
        return self._width * (len(self._slot) if key is None else self._slot[key])

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    def bucket(self, key: str | None) -> tuple[float, float] | None:
        at = self._at(key)
        tokens, stamp = self._values[at], self._values[at + 1]
        return None if stamp == 0.0 else (tokens, stamp)

    def set_bucket(self, key: str | None, tokens: float, stamp: float) -> None:
        at = self._at(key)
        self._values[at], self._values[at + 1] = tokens, stamp

    def in_flight(self, key: str | None) -> int:
        at = self._at(key) + _HEAD
        return sum(self._counts[at : at + self.workers])

    def hold(self, key: str | None, change: int) -> None:
        cell = self._at(key) + _HEAD + self.index
        self._counts[cell] = max(0, self._counts[cell] + change)

    def clear(self, index: int) -> None:
        """Zero worker `index`'s in-flight counts (it died)."""
        for slot in range(len(self._slot) + 1):
            self._counts[self._width * slot + _HEAD + index] = 0

    def close(self) -> None:
        self._counts.release()
        self._values.release()
        self._block.close()
        self._file.close()


def share(limits: Limits, hosts: int) -> Limits:
    """One front-end host's share of a key's limits, where `hosts` hosts admit its requests
    apart (docs/multi-host.md): the rate divided evenly, the burst and the concurrency rounded
    up, so that no host's share is 0. Over any span of T seconds the hosts together admit at
    most burst + hosts - 1 + rate x T requests of the key, and hold at most concurrent +
    hosts - 1 in flight; a key whose requests all land on one host gets only its share."""
    if hosts <= 1:
        return limits
    rate, burst = limits.requests_per_s, limits.burst
    if rate is not None and burst is None:
        burst = max(1, math.ceil(rate))  # the whole key's default burst, then shared
    return Limits(
        requests_per_s=None if rate is None else rate / hosts,
        burst=None if burst is None else math.ceil(burst / hosts),
        concurrent=None if limits.concurrent is None else math.ceil(limits.concurrent / hosts),
    )


class KeyLimiter:
    def __init__(
        self, limits_of: Callable[[str | None], Limits], accounts: _Accounts | None = None
    ) -> None:
        """`limits_of(key)`: the limits of a key; None is the anonymous requests' one key.
        `accounts`: where the counts are kept (default: in this process alone)."""
        self._limits_of = limits_of
        self._limits: dict[str | None, Limits] = {}
        self._accounts = accounts if accounts is not None else _LocalAccounts()
        self.hosts = 1
        """The front-end hosts that admit the keys' requests apart, each to its share."""

    def set_hosts(self, hosts: int) -> None:
        """From now on, admit this host's share of each key's limits among `hosts`."""
        if hosts != self.hosts:
            self.hosts = max(1, hosts)
            self._limits.clear()

    def acquire(self, key: str | None, now: float) -> None:
        """Admit one request of `key` at `now`, or raise OverLimit. Each admitted request must
        be released exactly once, when it ends."""
        limits = self._limits.get(key)
        if limits is None:
            limits = self._limits[key] = share(self._limits_of(key), self.hosts)
        if limits.concurrent is None and limits.requests_per_s is None:
            self._accounts.hold(key, 1)  # nothing to check, nothing to lock
            return
        with self._accounts.locked():
            in_flight = self._accounts.in_flight(key)
            if limits.concurrent is not None and in_flight >= limits.concurrent:
                raise OverLimit(
                    CONCURRENT,
                    1,  # when a request of the key ends is unknown; a second is a fair wait
                    f"This key has {in_flight} requests in flight, its limit{self._here()}. "
                    "Retry when one has finished.",
                )
            if limits.requests_per_s is not None:
                rate = limits.requests_per_s
                burst = float(limits.burst or max(1, math.ceil(rate)))
                tokens, stamp = self._accounts.bucket(key) or (burst, now)
                tokens = min(burst, tokens + max(0.0, now - stamp) * rate)
                if tokens < 1.0:
                    self._accounts.set_bucket(key, tokens, now)
                    wait = (1.0 - tokens) / rate
                    raise OverLimit(
                        RATE,
                        max(1, math.ceil(wait)),
                        f"This key may send {rate:g} requests per second "
                        f"(bursts of {burst:g}){self._here()}. Retry in {wait:.1f} s.",
                    )
                self._accounts.set_bucket(key, tokens - 1.0, now)
            self._accounts.hold(key, 1)

    def release(self, key: str | None) -> None:
        self._accounts.hold(key, -1)

    def _here(self) -> str:
        """Where the limit said is a share: so that a client is not told its key's is less."""
        return "" if self.hosts == 1 else f" here, one of {self.hosts} front-end hosts"
