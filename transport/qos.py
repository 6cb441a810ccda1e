"""Which QoS class a request gets, from its headers.

Sources, in order of trust:
1. the tier of the API key (`Authorization: Bearer <key>`), which bounds everything else; no key,
   or an unknown one, gets the anonymous tier if there is one;
2. the `x-qos-class` header, naming one of the classes the tier grants;
3. the RFC 9218 `priority` header (`u=0..7`), mapped to the granted class of nearest urgency (on a
   tie, the less urgent one).
Without either header the tier's default applies. A tier that does not grant a class can never
reach it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from config import Deployment, QosClass, Tier
from transport.schedulers import StreamSpec


class QosRejected(Exception):
    """The headers ask for something the key does not allow; `status` is 401 or 403."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Classification:
    qos_class: str
    tier: str


_URGENCY = re.compile(r"(?:^|,)\s*u\s*=\s*([0-7])\s*(?:,|;|$)")


class QosClassifier:
    def __init__(
        self,
        classes: Mapping[str, QosClass],
        tiers: Mapping[str, Tier],
        api_keys: Mapping[str, str],
        anonymous_tier: str | None,
    ) -> None:
        self.classes = dict(classes)
        self.tiers = dict(tiers)
        self.api_keys = dict(api_keys)
        self.anonymous_tier = anonymous_tier

    @classmethod
    def from_deployment(cls, deployment: Deployment) -> QosClassifier:
        return cls(
            deployment.qos_classes,
            deployment.tiers,
            deployment.api_keys,
            deployment.anonymous_tier,
        )

    def classify(self, headers: Mapping[str, str]) -> Classification:
        """`headers` with lower-case names."""
        tier_name = self._tier(headers.get("authorization"))
        tier = self.tiers[tier_name]
        wanted = headers.get("x-qos-class")
        if wanted is not None:
            wanted = wanted.strip()
            if wanted not in self.classes:
                raise QosRejected(
                    400, f"Unknown QoS class {wanted!r} (known: {', '.join(self.classes)})."
                )
            if wanted not in tier.classes:
                raise QosRejected(
                    403,
                    f"QoS class {wanted!r} needs an API key whose tier grants it; "
                    f"tier {tier_name!r} grants {', '.join(tier.classes)}.",
                )
            return Classification(wanted, tier_name)
        urgency = _urgency(headers.get("priority"))
        if urgency is not None:
            nearest = min(
                tier.classes,
                key=lambda c: (abs(self.classes[c].urgency - urgency), -self.classes[c].urgency),
            )
            return Classification(nearest, tier_name)
        return Classification(tier.default, tier_name)

    def stream_spec(
        self, headers: Mapping[str, str], now: float, soft_deadlines: bool = True
    ) -> StreamSpec:
        """The scheduling tag of a stream carrying a request with these headers. A request the
        classifier refuses gets the untagged spec: it is answered with a 4xx at once anyway."""
        try:
            qos_class = self.classes[self.classify(headers).qos_class]
        except QosRejected:
            return StreamSpec()
        return StreamSpec(
            priority=7 - qos_class.urgency,
            deadline=now + qos_class.deadline_s,
            high=qos_class.level == "high",
            soft=soft_deadlines,
        )

    def _tier(self, authorization: str | None) -> str:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and key.strip() in self.api_keys:
            return self.api_keys[key.strip()]
        # An unknown key counts as none: OpenAI clients insist on sending some key, and like
        # `vllm serve` without --api-key, a server that admits anonymous requests accepts them.
        if self.anonymous_tier is None:
            raise QosRejected(401, "A valid API key is required (Authorization: Bearer <key>).")
        return self.anonymous_tier


def _urgency(priority: str | None) -> int | None:
    """The urgency of an RFC 9218 priority field value; None if absent or unreadable, as the RFC
    says a server must ignore what it cannot parse."""
    if not priority:
        return None
    match = _URGENCY.search(priority)
    return int(match.group(1)) if match else None
