"""Pages for a browser: the playground (`/`) and the operator's dashboard (`/dashboard`).

Both are plain HTML, CSS and JavaScript shipped in the package (`serving/static/`), with no
build step and nothing fetched from elsewhere (their Content-Security-Policy allows only this
origin). They are routes of the same ASGI app as the API, so they come over HTTP/3 and HTTP/1.1
alike, through the same transport, tagging and drain as every request.

- The playground streams a chat completion with fetch() and shows, per answer, the model and
  replica that served it, its TTFT, its inter-token gaps and the protocol that carried it.
- The dashboard is fed by a server-sent-event stream (`/dashboard/events`) built from the
  gateway's own state: the replicas' live counts, the arrival-rate estimate and
  `Metrics.recent` (`serving.recent`), never by scraping /metrics. It answers only to a client
  on this machine (loopback) or to an API key of an `admin` tier, since it names requests,
  models and load that the operator may not want to show the world.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Scope

from serving.gateway import AUTO, Gateway
from serving.peers import Peers
from transport.drain import Drain
from transport.qos import tag_of

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}
_HEADERS = {
    # Everything the pages use comes from here; an injected script or a CDN gets nothing.
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    # Small files, shipped with the server: ask again each time rather than run stale code
    # against a newer server.
    "cache-control": "no-cache",
}
MIN_INTERVAL_S, MAX_INTERVAL_S, DEFAULT_INTERVAL_S = 0.25, 10.0, 1.0
"""How often the dashboard's feed sends a snapshot; a client may ask within these bounds."""
_FORWARDED = ("x-forwarded-for", "forwarded")
"""Headers a proxy adds: a request that carries one came from further than its socket says."""


def _static() -> dict[str, bytes]:
    """The shipped page files, read once: they are small and never change while serving."""
    folder = resources.files("serving") / "static"
    return {
        f.name: f.read_bytes()
        for f in folder.iterdir()
        if f.is_file() and any(f.name.endswith(ext) for ext in _TYPES)
    }


def _file(files: Mapping[str, bytes], name: str) -> Response:
    kind = _TYPES[name[name.rindex(".") :]]
    return Response(files[name], media_type=kind, headers=_HEADERS)


@dataclass
class FeedCost:
    """The CPU the dashboard's snapshots have taken in this process: the feed's own cost,
    which it reports in every snapshot (benchmarks.dashboard_feed reads it)."""

    cpu_s: float = 0.0
    snapshots: int = 0


def add_pages(
    app: FastAPI, gateway: Gateway, drain: Drain | None = None, peers: Peers | None = None
) -> None:
    """Add the playground and the dashboard to `app`. `drain`: the server's stop, at which
    the dashboard's feed ends, so that an open dashboard never holds a graceful stop up.
    `peers`: the other workers (`--workers`), whose recent past the dashboard shows too."""
    files = _static()
    deployment = gateway.deployment
    admin_tiers = frozenset(name for name, tier in deployment.tiers.items() if tier.admin)
    cost = FeedCost()

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return _file(files, "playground.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in files:
            return _error(404, f"No page file {name!r} here.", "not_found")
        return _file(files, name)

    @app.get("/playground/options", include_in_schema=False)
    async def options() -> dict[str, Any]:
        """What the playground offers: models, the deployment's classes (and which an
        anonymous request may use), and the quality table's tasks."""
        anonymous = deployment.tiers.get(deployment.anonymous_tier or "")
        return {
            "models": [AUTO, *deployment.models],
            "classes": [
                {
                    "name": name,
                    "urgency": c.urgency,
                    "deadline_s": c.deadline_s,
                    "needs_key": anonymous is None or name not in anonymous.classes,
                }
                for name, c in deployment.qos_classes.items()
            ],
            "default_class": anonymous.default if anonymous is not None else None,
            "tasks": list(deployment.quality),
            "slo_tpot_s": deployment.slo.tpot_s,
        }

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(raw: Request) -> Response:
        refused = _refusal(raw.scope, admin_tiers)
        return refused or _file(files, "dashboard.html")

    @app.get("/dashboard/state", include_in_schema=False)
    async def state(raw: Request) -> Response:
        """One snapshot as JSON: for scripts, and for a look without a browser."""
        refused = _refusal(raw.scope, admin_tiers)
        if refused is not None:
            return refused
        return Response(await snapshot(), media_type="application/json")

    async def snapshot() -> bytes:
        return _snapshot(gateway, cost, await peers.ask() if peers is not None else [])

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(raw: Request) -> Response:
        refused = _refusal(raw.scope, admin_tiers)
        if refused is not None:
            return refused
        every = _interval(raw.query_params.get("interval"))

        async def feed() -> AsyncIterator[bytes]:
            while drain is None or not drain.draining:
                yield b"data: " + await snapshot() + b"\n\n"
                await asyncio.sleep(every)

        return StreamingResponse(
            feed(),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )


def _interval(asked: str | None) -> float:
    """The feed's seconds between snapshots: what the client asked (`?interval=`), within
    bounds; the default for anything that is not a number. Read by hand, not as a typed query
    parameter, whose 422 the API would count as an invalid request for generation."""
    try:
        seconds = float(asked) if asked is not None else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S
    if not math.isfinite(seconds):
        return DEFAULT_INTERVAL_S
    return min(max(seconds, MIN_INTERVAL_S), MAX_INTERVAL_S)


def _refusal(scope: Scope, admin_tiers: frozenset[str]) -> JSONResponse | None:
    """None when the dashboard may answer this request; else the 403 that says why not."""
    tag = tag_of(scope)
    if tag is not None and tag.rejected is None and tag.tier in admin_tiers:
        return None
    host = (scope.get("client") or ("", 0))[0]
    headers = {name.lower() for name, _ in scope.get("headers", [])}
    proxied = (tag is not None and tag.via_edge) or any(h.encode() in headers for h in _FORWARDED)
    if _loopback(host) and not proxied:
        return None
    # A proxy or an edge on this machine would make every one of its clients look local.
    where = "through a proxy" if proxied else f"from {host or 'an unknown address'}"
    keys = ", ".join(sorted(admin_tiers)) or "none configured"
    return _error(
        403,
        "The dashboard answers only to clients on the server's own machine (loopback) or to "
        f"an API key of an admin tier (Authorization: Bearer <key>; admin tiers: {keys}). "
        f"This request came {where} without such a key.",
        "dashboard_forbidden",
    )


def _loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _error(status: int, message: str, code: str) -> JSONResponse:
    # OpenAI's error shape, as every other error of this server.
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return JSONResponse({"error": error}, status_code=status)


def _snapshot(gateway: Gateway, cost: FeedCost, others: list[dict[str, Any]]) -> bytes:
    """The dashboard's view of now, as JSON, with the other workers' records (`others`); its
    CPU in this process is counted in `cost`."""
    started = time.thread_time()
    cost.snapshots += 1  # this one included
    now = gateway.clock()
    recent = gateway.metrics.recent
    merged = recent.merged(others)
    deployment = gateway.deployment
    minutes = merged.minutes
    classes = []
    for name, qos_class in deployment.qos_classes.items():
        minute = minutes.get(name)
        classes.append(
            {
                "name": name,
                "deadline_s": qos_class.deadline_s,
                "ended": minute.ended if minute else 0,
                "counted": minute.counted if minute else 0,
                "slo_met": minute.slo_met if minute else 0,
                "shed": minute.shed if minute else 0,
                "attainment": minute.attainment if minute else None,
                "shed_rate": minute.shed_rate if minute else None,
            }
        )
    # Newest first, as the page lists them.
    decisions = [
        {
            "age_s": round(now - d.at, 3),
            "request_id": d.request_id,
            "qos_class": d.qos_class,
            "task": d.task,
            "asked": d.asked,
            "model": d.model,
            "replica": d.replica,
            "in_flight": d.in_flight,
            "at_replica": d.at_replica,
            "rate": round(d.rate, 3),
        }
        for d in reversed(merged.decisions)
    ]
    mono = recent.clock()
    ended = [
        {
            "age_s": round(mono - e.at, 3),
            "request_id": e.request_id,
            "qos_class": e.qos_class,
            "protocol": e.protocol,
            "model": e.model,
            "replica": e.replica,
            "outcome": e.outcome,
            "slo_met": e.slo_met,
            "counted": e.counted,
            "ttft_s": None if e.ttft_s is None else round(e.ttft_s, 4),
            "tokens": e.tokens,
        }
        for e in reversed(merged.ended)
    ]
    view = {
        "deployment": deployment.name,
        "time": time.time(),
        "rate": round(gateway.rate.value(now), 3),
        "window_s": recent.window_s,
        "slo_tpot_s": deployment.slo.tpot_s,
        "workers": merged.workers,
        "replicas": [
            {
                "name": r.name,
                "model": r.model,
                "healthy": r.engine.healthy(),
                "running": running - waiting,
                "waiting": waiting,
                "restarts": r.restarts,
            }
            for i, r in enumerate(gateway.replicas)
            for running, waiting in [gateway.replicas.totals(i)]
        ],
        "classes": classes,
        "decisions": decisions,
        "ended": ended,
        # The feed's own cost so far, beside the whole process's: the page shows the share.
        "feed": {"cpu_s": round(cost.cpu_s, 6), "snapshots": cost.snapshots},
        "process_cpu_s": round(time.process_time(), 6),
    }
    body = json.dumps(view, separators=(",", ":")).encode()
    cost.cpu_s += time.thread_time() - started
    return body
