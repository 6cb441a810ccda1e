"""Who may open which CONNECT-UDP tunnels, and how each tunnel is scheduled: `TunnelAccess`.

The proxy asks `grant(headers)` for every Extended CONNECT request, before it looks at the
target, so a caller without a key learns nothing about targets:

- no `authorization: Bearer <key>`, or a key this proxy does not know -> 401;
- an `x-qos-class` the key's tier does not grant -> 403 (unknown class: 400), as for requests:
  the same `QosRejected` that `transport.qos` raises for them;
- otherwise a `TunnelGrant`: the targets the key's tier may reach (`AllowList`; empty: 403 for
  every target) and the `StreamSpec` that orders the tunnel's stream among the others on the
  client-proxy connection.

A tunnel's priority is its CONNECT request's RFC 9218 `priority` header (urgency 0 is the most
urgent; `StreamSpec.priority = 7 - u`, as `transport.qos.stream_spec` maps a class), or else its
owner's class: `x-qos-class`, or the tier's default. The class also gives the multi-level
scheduler's level and EDF's deadline, counted from when the tunnel opened and soft (a tunnel is
long-lived: past its deadline it is demoted, never cut).

From models.yaml (`TunnelAccess.from_deployment`): the tiers' `tunnels:` lists and their keys.
Or plainly, keys to allow-lists (`TunnelAccess(keys)`), every tunnel at the default urgency.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, replace

from config import Deployment
from transport.masque.connect_udp import AllowList
from transport.qos import QosClassifier, QosRejected, stream_spec, urgency_of
from transport.schedulers import StreamSpec

DEFAULT_URGENCY = 3
"""RFC 9218 §4.1: a request without a priority header has urgency 3."""


@dataclass(frozen=True)
class TunnelGrant:
    allow: AllowList
    spec: StreamSpec


class TunnelAccess:
    def __init__(
        self, keys: Mapping[str, AllowList], classifier: QosClassifier | None = None
    ) -> None:
        self.keys = dict(keys)
        self.classifier = classifier

    @classmethod
    def from_deployment(cls, deployment: Deployment) -> TunnelAccess:
        """Every resolved key of models.yaml, with its tier's `tunnels:`. ValueError names a
        target the tier lists that `AllowList` cannot read."""
        allow = {}
        for name, tier in deployment.tiers.items():
            try:
                allow[name] = AllowList.parse(tier.tunnels)
            except ValueError as error:
                raise ValueError(f"tiers.{name}.tunnels: {error}") from None
        keys = {key: allow[tier] for key, tier in deployment.api_keys.items()}
        return cls(keys, QosClassifier.from_deployment(deployment))

    def grant(self, headers: Mapping[str, str], now: float) -> TunnelGrant:
        """`headers` with lower-case names; `now` on the clock of the scheduler's deadlines.
        `QosRejected` (400, 401 or 403) if the request may not open a tunnel."""
        key = self._known_key(headers.get("authorization"))
        if key is None:
            raise QosRejected(401, "a CONNECT-UDP tunnel needs a known key (Bearer)")
        urgency = urgency_of(headers.get("priority"))
        if self.classifier is None:
            spec = StreamSpec()
        else:
            found = self.classifier.classify(headers)
            qos_class = self.classifier.classes[found.qos_class]
            spec = stream_spec(qos_class, now, soft_deadlines=True)
            if urgency is None:
                urgency = qos_class.urgency
        urgency = DEFAULT_URGENCY if urgency is None else urgency
        return TunnelGrant(self.keys[key], replace(spec, priority=7 - urgency))

    def _known_key(self, authorization: str | None) -> str | None:
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        found = None
        for key in self.keys:  # compared against every key, in constant time
            if hmac.compare_digest(key.encode(), token.encode()):
                found = key
        return found
