"""Which QoS class a request gets, from its headers.

Sources, in order of trust:
1. the tier of the API key (`Authorization: Bearer <key>`), which bounds everything else; no key,
   or an unknown one, gets the anonymous tier if there is one;
2. the `x-qos-class` header, naming one of the classes the tier grants;
3. the RFC 9218 `priority` header (`u=0..7`), mapped to the granted class of nearest urgency (on a
   tie, the less urgent one).
Without either header the tier's default applies. A tier that does not grant a class can never
reach it.

A request is classified once, where it reaches the server, and its arrival time taken there: the
HTTP/3 server does it when a stream's HEADERS arrive, `TagRequests` for HTTP/1.1 (with the time the
server began to parse the request). The result, a `RequestTag`, reaches the app through the ASGI
scope, so the app's deadline, TTFT and SLO all run from the real arrival, and nothing classifies
again. Behind an edge front-end, the edge forwards its own tag in `x-edge-*` headers; the back-end
keeps it only when they come with the key of a `trusted_edge` tier.

What the server measured of the client's network path (`config.paths.PathEstimate`) reaches the
app beside the tag, in `scope["extensions"][PATH]`: the QUIC connection's recovery state for
HTTP/3, the socket's `TCP_INFO` for HTTP/1.1 and HTTP/2. Behind an edge, the edge's own
measurement of its client's path comes in `x-edge-path`, kept only with the edge's key as the
rest of its tag. Never a client's word: `path_of` reads the one to route on.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from config import Deployment, QosClass, Tier
from config.paths import PathEstimate
from transport.schedulers import StreamSpec

TAG = "qos"
"""The key of the request's `RequestTag` in `scope["extensions"]`."""
ARRIVAL = "arrival"
"""The key under which an HTTP server may stamp, in `scope["extensions"]`, the time.monotonic() at
which it began to read a request, when that is earlier than the app sees it."""

PATH = "qos.path"
"""The key, in `scope["extensions"]`, of the `PathEstimate` the server measured of the request's
client as the request arrived (absent where it could not)."""
DEADLINE = "qos.deadline"
"""The key, in `scope["extensions"]`, of a callable that moves the response stream's scheduling
deadline (`StreamDeadline`), where the server schedules streams (HTTP/3)."""

EDGE_KEY = "x-edge-key"
"""The edge's own key (a key of a `trusted_edge` tier), beside the client's Authorization."""
EDGE_AGE = "x-edge-age"
"""Seconds since the request reached the edge, when the edge sent it on: an age, not a timestamp,
so no two machines' clocks need to agree. The hop's own transit is not in it."""
EDGE_CLASS = "x-edge-qos-class"
EDGE_TIER = "x-edge-tier"
EDGE_REQUEST_ID = "x-edge-request-id"
"""The edge's name for the request, kept by the back-end, so both log it under one id."""
EDGE_PATH = "x-edge-path"
"""The edge's measurement of its client's path: `rtt=S; rttvar=S; loss=F[; rate=BPS]`."""
EDGE_HEADERS = (EDGE_KEY, EDGE_AGE, EDGE_CLASS, EDGE_TIER, EDGE_REQUEST_ID, EDGE_PATH)
_MAX_EDGE_AGE_S = 3600.0
_REQUEST_ID = re.compile(r"[0-9a-f]{32}")
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class QosRejected(Exception):
    """The headers ask for something the key does not allow: `status` is 401 or 403, or 400
    for a class that does not exist."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Classification:
    qos_class: str
    tier: str
    api_key: str | None = field(default=None, repr=False)
    """The known API key the request came with; None for an anonymous request."""


@dataclass(frozen=True)
class RequestTag:
    """What the transport learned about a request as it arrived: made once, read by the app."""

    arrival: float
    """time.monotonic() when the request reached this server, or the edge that forwarded it."""
    qos_class: str | None
    """None when the request was refused (`rejected`)."""
    tier: str | None
    spec: StreamSpec
    """The stream's scheduling tag (HTTP/3)."""
    rejected: QosRejected | None = None
    """Why the headers cannot have a class: the app answers with its status."""
    via_edge: bool = False
    """The arrival and class came from a trusted edge front-end."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Names the request in logs and in the `x-request-id` response header: the client's own
    `x-request-id` when it sends a well-formed one, else a fresh one."""
    api_key: str | None = field(default=None, repr=False)
    """The known API key the request came with (limits are per key); None: anonymous."""
    path: PathEstimate | None = None
    """The client's path as a trusted edge measured it (`via_edge` only)."""

    def forwarded(
        self, now: float, edge_key: str, path: PathEstimate | None = None
    ) -> dict[str, str]:
        """The headers that carry this tag, and `path` (what this edge measured of the client's
        path), to a back-end, as an edge sends them at `now`."""
        headers = {
            EDGE_KEY: edge_key,
            EDGE_AGE: f"{max(0.0, now - self.arrival):.6f}",
            EDGE_REQUEST_ID: self.request_id,
        }
        if self.qos_class is not None and self.tier is not None:
            headers[EDGE_CLASS], headers[EDGE_TIER] = self.qos_class, self.tier
        if path is not None:
            headers[EDGE_PATH] = format_path(path)
        return headers


def tag_of(scope: Mapping[str, Any]) -> RequestTag | None:
    return (scope.get("extensions") or {}).get(TAG)


def path_of(scope: Mapping[str, Any]) -> PathEstimate | None:
    """The client's path to route on: a trusted edge's measurement of it, else this server's
    own; clamped to sane ranges whoever measured it."""
    tag = tag_of(scope)
    if tag is not None and tag.via_edge and tag.path is not None:
        return tag.path.clamped()
    own = (scope.get("extensions") or {}).get(PATH)
    return own.clamped() if isinstance(own, PathEstimate) else None


def format_path(path: PathEstimate) -> str:
    parts = [f"rtt={path.rtt_s:.6f}", f"rttvar={path.rttvar_s:.6f}", f"loss={path.loss:.6f}"]
    if path.rate_bps is not None:
        parts.append(f"rate={path.rate_bps:.0f}")
    return "; ".join(parts)


def parse_path(value: str | None) -> PathEstimate | None:
    """`format_path`'s form back, clamped; None unless it names at least the RTT as a number."""
    fields: dict[str, float] = {}
    for part in (value or "").split(";"):
        name, _, number = part.partition("=")
        try:
            fields[name.strip()] = float(number)
        except ValueError:
            continue
    if "rtt" not in fields:
        return None
    return PathEstimate(
        fields["rtt"], fields.get("rttvar", 0.0), fields.get("loss", 0.0), fields.get("rate")
    ).clamped()


Tagger = Callable[[Mapping[str, str], float], RequestTag]
"""Headers (lower-case names) and the arrival time (time.monotonic()) -> the request's tag."""


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
        api_key = self._known_key(headers.get("authorization"))
        tier_name = self.api_keys[api_key] if api_key is not None else self.anonymous_tier
        if tier_name is None:
            raise QosRejected(401, "A valid API key is required (Authorization: Bearer <key>).")
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
            return Classification(wanted, tier_name, api_key)
        urgency = urgency_of(headers.get("priority"))
        if urgency is not None:
            nearest = min(
                tier.classes,
                key=lambda c: (abs(self.classes[c].urgency - urgency), -self.classes[c].urgency),
            )
            return Classification(nearest, tier_name, api_key)
        return Classification(tier.default, tier_name, api_key)

    def tag(
        self, headers: Mapping[str, str], now: float, soft_deadlines: bool = True
    ) -> RequestTag:
        """The tag of a request with these headers that arrived at `now`. A request the
        classifier refuses gets the untagged stream spec: it is answered with a 4xx at once."""
        via_edge = self._from_trusted_edge(headers)
        arrival, named = now, dict[str, Any]()
        # A client may name its request (x-request-id, as vLLM's server allows); a trusted edge
        # passes on its own name for it.
        if _CLIENT_REQUEST_ID.fullmatch(client_id := headers.get("x-request-id", "")):
            named["request_id"] = client_id
        if via_edge:
            arrival = now - _age(headers.get(EDGE_AGE))
            if _REQUEST_ID.fullmatch(edge_id := headers.get(EDGE_REQUEST_ID, "")):
                named["request_id"] = edge_id
            named["path"] = parse_path(headers.get(EDGE_PATH))
            qos_class, tier = headers.get(EDGE_CLASS), headers.get(EDGE_TIER)
            if qos_class in self.classes and tier in self.tiers:
                spec = self._spec(qos_class, arrival, soft_deadlines)
                api_key = self._known_key(headers.get("authorization"))
                return RequestTag(
                    arrival, qos_class, tier, spec, via_edge=True, api_key=api_key, **named
                )
        try:
            found = self.classify(headers)
        except QosRejected as exc:
            return RequestTag(arrival, None, None, StreamSpec(), exc, via_edge, **named)
        spec = self._spec(found.qos_class, arrival, soft_deadlines)
        return RequestTag(
            arrival, found.qos_class, found.tier, spec, None, via_edge,
            api_key=found.api_key, **named,
        )  # fmt: skip

    def edge_key(self) -> str | None:
        """A key of a trusted_edge tier, for an edge to forward its tags with; None if none."""
        return next(
            (key for key, tier in self.api_keys.items() if self.tiers[tier].trusted_edge), None
        )

    def _from_trusted_edge(self, headers: Mapping[str, str]) -> bool:
        tier = self.api_keys.get((headers.get(EDGE_KEY) or "").strip())
        return tier is not None and self.tiers[tier].trusted_edge

    def _spec(self, name: str, arrival: float, soft_deadlines: bool) -> StreamSpec:
        return stream_spec(self.classes[name], arrival, soft_deadlines)

    def _known_key(self, authorization: str | None) -> str | None:
        """The request's API key if this server knows it. An unknown key counts as none: OpenAI
        clients insist on sending some key, and like `vllm serve` without --api-key, a server
        that admits anonymous requests accepts them."""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        return key if scheme.lower() == "bearer" and key in self.api_keys else None


class StreamDeadline:
    """Moves one response stream's scheduling deadline: what the server hands the app in
    `scope["extensions"][DEADLINE]`. The app gives it the time by which the answer's last token
    must be written for the client to have it within the SLO (the router's budget, after the
    client's path has had its share), and the stream is scheduled by that from then on.

    Never earlier than the class's own deadline: the budget comes from the client's measured
    path, and a client that delays its ACKs, so that its RTT looks longer and its budget
    shorter, would otherwise jump the queue. The path may tighten the choice of model (the
    router's); it never raises a stream's priority."""

    def __init__(self, spec: StreamSpec, apply: Callable[[StreamSpec], None]) -> None:
        """`spec`: the stream's tag from its class; `apply` re-tags the stream."""
        self.spec = spec
        self._floor = spec.deadline
        self._apply = apply

    def __call__(self, deadline: float) -> None:
        if not math.isfinite(deadline) or self._floor is None:
            return  # a stream of no class has no deadline to move
        moved = max(deadline, self._floor)
        if moved != self.spec.deadline:
            self.spec = replace(self.spec, deadline=moved)
            self._apply(self.spec)


def stream_spec(qos_class: QosClass, arrival: float, soft_deadlines: bool = True) -> StreamSpec:
    """How a stream of this class is scheduled: by the server for its response, and by a client
    that schedules its uploads the same way."""
    return StreamSpec(
        priority=7 - qos_class.urgency,
        deadline=arrival + qos_class.deadline_s,
        high=qos_class.level == "high",
        soft=soft_deadlines,
    )


def _age(value: str | None) -> float:
    try:
        age = float(value or 0)
    except ValueError:
        return 0.0
    return min(age, _MAX_EDGE_AGE_S) if math.isfinite(age) and age > 0 else 0.0


class TagRequests:
    """ASGI middleware: tags every HTTP request that its server has not tagged already (HTTP/3
    tags at HEADERS), with the arrival the server stamped (`ARRIVAL`) or else the time now, and
    names the request in an `x-request-id` header on its response, unless the app already did
    (an edge relays its back-end's)."""

    def __init__(self, app: Any, tag: Tagger) -> None:
        self.app = app
        self.tag = tag

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extensions = scope.setdefault("extensions", {})
        request_tag = extensions.get(TAG)
        if request_tag is None:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            arrival = extensions.get(ARRIVAL) or time.monotonic()
            request_tag = extensions[TAG] = self.tag(headers, arrival)
        request_id = request_tag.request_id.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", request_id))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def urgency_of(priority: str | None) -> int | None:
    """The urgency of an RFC 9218 priority field value; None if absent or unreadable, as the RFC
    says a server must ignore what it cannot parse."""
    if not priority:
        return None
    match = _URGENCY.search(priority)
    return int(match.group(1)) if match else None
