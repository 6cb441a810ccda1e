"""Per-key limits: a request rate (token bucket) and a number of requests in flight.

Logic only: every call takes `now`, so it runs the same in tests on a virtual clock. The keys
it tracks are the configured ones plus one shared anonymous bucket, so its state is bounded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from config import Limits

RATE = "rate"
CONCURRENT = "concurrent"


class OverLimit(Exception):
    """The key is over one of its limits; `retry_after_s` says when to try again."""

    def __init__(self, limit: str, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.message = message


@dataclass
class _Account:
    limits: Limits
    tokens: float
    stamp: float
    in_flight: int = 0

    @property
    def burst(self) -> float:
        rate = self.limits.requests_per_s or 0.0
        return float(self.limits.burst or max(1, math.ceil(rate)))


class KeyLimiter:
    def __init__(self, limits_of: Callable[[str | None], Limits]) -> None:
        """`limits_of(key)`: the limits of a key; None is the anonymous requests' one key."""
        self._limits_of = limits_of
        self._accounts: dict[str | None, _Account] = {}

    def acquire(self, key: str | None, now: float) -> None:
        """Admit one request of `key` at `now`, or raise OverLimit. Each admitted request must
        be released exactly once, when it ends."""
        account = self._account(key, now)
        limits = account.limits
        if limits.concurrent is not None and account.in_flight >= limits.concurrent:
            raise OverLimit(
                CONCURRENT,
                1,  # when a request of the key ends is unknown; a second is a fair wait
                f"This key has {account.in_flight} requests in flight, its limit. "
                "Retry when one has finished.",
            )
        if limits.requests_per_s is not None:
            rate = limits.requests_per_s
            account.tokens = min(account.burst, account.tokens + (now - account.stamp) * rate)
            account.stamp = now
            if account.tokens < 1.0:
                wait = (1.0 - account.tokens) / rate
                raise OverLimit(
                    RATE,
                    max(1, math.ceil(wait)),
                    f"This key may send {rate:g} requests per second "
                    f"(bursts of {account.burst:g}). Retry in {wait:.1f} s.",
                )
            account.tokens -= 1.0
        account.in_flight += 1

    def release(self, key: str | None) -> None:
        account = self._accounts.get(key)
        if account is not None and account.in_flight > 0:
            account.in_flight -= 1

    def _account(self, key: str | None, now: float) -> _Account:
        account = self._accounts.get(key)
        if account is None:
            limits = self._limits_of(key)
            account = self._accounts[key] = _Account(limits, 0.0, now)
            account.tokens = account.burst
        return account
