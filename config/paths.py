"""What a server knows of a client's network path: plain numbers that the transport measures and
the router reads. It sits here, at the bottom, because both sides use it and neither may import
the other."""

from __future__ import annotations

import math
from typing import NamedTuple

RTT_RANGE_S = (0.0, 10.0)
RTTVAR_RANGE_S = (0.0, 10.0)
RATE_RANGE_BPS = (1e3, 1e12)


class PathEstimate(NamedTuple):
    """A client's path as measured: by the QUIC connection's recovery state, the TCP socket's
    `TCP_INFO`, or a trusted edge for the client behind it. A tuple: the gateway builds one per
    request."""

    rtt_s: float
    """Smoothed round-trip time."""
    rttvar_s: float = 0.0
    loss: float = 0.0
    """Share of the packets sent to the client that were lost, so far."""
    rate_bps: float | None = None
    """What the path delivers, where the transport knows (delivery rate, or window / RTT)."""

    def clamped(self) -> PathEstimate:
        """Within sane ranges, whatever produced it: NaN takes the range's low end (no
        knowledge is no penalty), an unknown rate (None or NaN) stays unknown."""
        rate = self.rate_bps
        return PathEstimate(
            _clamp(self.rtt_s, RTT_RANGE_S),
            _clamp(self.rttvar_s, RTTVAR_RANGE_S),
            _clamp(self.loss, (0.0, 1.0)),
            None if rate is None or math.isnan(rate) else _clamp(rate, RATE_RANGE_BPS),
        )


def _clamp(value: float, bounds: tuple[float, float]) -> float:
    if not isinstance(value, int | float) or math.isnan(value):
        return bounds[0]
    return min(max(float(value), bounds[0]), bounds[1])
