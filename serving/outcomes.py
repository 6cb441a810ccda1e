"""How a request ends, and its account: the outcome every accepted request ends in, exactly one,
and the record of its times that the metrics and the request log are written from."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

# Outcomes of a request. Every request the API accepts ends in exactly one of them.
OK = "ok"
INVALID = "invalid"  # 4xx: the request itself was wrong
REFUSED = "refused"  # 401/403: no key, or a class the key does not grant
UNAVAILABLE = "unavailable"  # 503: no healthy replica could take it
DEADLINE = "deadline"  # no first token within the class's deadline
ENGINE_ERROR = "engine_error"  # the engine failed after accepting it
CANCELLED = "cancelled"  # the client went away first
LIMITED = "limited"  # 429: its API key was over its rate or concurrency limit
SHED = "shed"  # 429: no replica could have given its first token in time (admission control)
DRAINING = "draining"  # 503 (HTTP/3: rejected after GOAWAY): it came while the server was stopping
STOPPED = "stopped"  # still running when the server's drain time ran out, and cut
WORKER_DIED = "worker_died"  # its worker died first (counted by the supervisor: `Metrics.lost`)
INTERNAL = "internal"  # 500: a fault of the server's own (a bug), logged with its traceback
CLIENTS_OWN = frozenset({INVALID, REFUSED, LIMITED, CANCELLED})
"""Outcomes of the client's own making, which say nothing of the server: the dashboard's SLO
attainment counts them neither for nor against it."""


@dataclass
class RequestRecord:
    """One request's account, filled in as it goes; times are time.monotonic()."""

    request_id: str | None
    qos_class: str | None
    arrival: float
    """When the request reached the server (or the trusted edge in front of it)."""
    tier: str | None = None
    via_edge: bool = False
    protocol: str | None = None
    """The HTTP version it came over."""
    received: float | None = None
    """When the handler took it up: after the body was read and parsed."""
    routed: float | None = None
    """When it was dispatched to its replica (the last one, if one was skipped)."""
    first_token: float | None = None
    last_token: float | None = None
    model: str | None = None
    replica: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    """Of the prompt's tokens, those its engine found cached, where the engine says."""
    tokens: int = 0
    client_rtt_s: float | None = None
    """The client's path as the router saw it (`transport.qos.path_of`): its smoothed RTT..."""
    client_loss: float | None = None
    """...and the share of packets lost to it so far."""
    retries: list[dict[str, str]] = field(default_factory=list)
    """Each replica that failed it before its first token, and why (`serving.gateway.retry`),
    in order; `replica` is the one that served it."""
    open_as: int | None = None
    """While the gateway holds it, its class's cell in this worker's shared row
    (`Metrics.opened`)."""

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first; None with fewer than two tokens."""
        if self.first_token is None or self.last_token is None or self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)

    def line(self, outcome: str, slo_met: bool, worker: int | None = None) -> str:
        def span(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else round(end - start, 6)

        wall_arrival = time.time() - (time.monotonic() - self.arrival)
        return json.dumps(
            {
                "request_id": self.request_id,
                "qos_class": self.qos_class,
                "tier": self.tier,
                "via_edge": self.via_edge,
                "protocol": self.protocol,
                "model": self.model,
                "replica": self.replica,
                "arrival": round(wall_arrival, 6),
                "queue_s": span(self.arrival, self.received),
                "route_s": span(self.received, self.routed),
                "engine_ttft_s": span(self.routed, self.first_token),
                "ttft_s": span(self.arrival, self.first_token),
                "e2e_s": span(self.arrival, self.last_token),
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "tokens": self.tokens,
                "client_rtt_s": self.client_rtt_s,
                "client_loss": self.client_loss,
                "retries": self.retries,
                "outcome": outcome,
                "slo_met": slo_met,
                "worker": worker,
            },
            separators=(",", ":"),
        )
