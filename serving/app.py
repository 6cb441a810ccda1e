"""Assemble a deployment into a servable ASGI app: engines, replica set, policy, gateway, API."""

from __future__ import annotations

import asyncio
import functools
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from config import Deployment
from router.features import ArrivalRateEstimator
from router.policies import make_policy
from router.prefix import PrefixAffinity
from serving.api import create_app
from serving.engines.kv_events import Rehasher, subscribe
from serving.engines.prompts import gateway_counter
from serving.fleet_rate import FleetArrivalRate, exchange, front_end_host
from serving.gateway import Gateway
from serving.metrics import Metrics
from serving.middleware import ShedAtTheDoor, record_of, stopping_drain
from serving.outcomes import INVALID
from serving.pages import add_pages
from serving.peers import Peers
from serving.replicas import ReplicaSet
from serving.shared_view import SharedArrivalRate, SharedView
from transport.drain import Draining
from transport.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from transport.qos import QosClassifier, TagRequests


def build_app(
    deployment: Deployment,
    policy: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    worker: int | None = None,
    engine_host: str | None = None,
    shared_view: SharedView | None = None,
    link_token: str | None = None,
    dns_server: str | None = None,
    front_ends: str | None = None,
    rate_exchange: bool = True,
) -> FastAPI:
    """The app for `deployment`. Its engines start with the app's lifespan and stop with it.
    `app.state.drain` is its stop, for the server (`transport.server.DualServer`) to start.
    `worker`: this process's index among `--workers`, which its request log names;
    `engine_host`: where the engine link is, when the engines run in an engine host;
    `shared_view`: what the workers share (`serving.shared_view`), where this worker
    publishes its arrivals, its requests and its keys' counts, and reads the others';
    `link_token`: what engine hosts on other hosts ask of a front-end (`--link-token-file`);
    `dns_server`: where the engine hosts behind DNS names are looked up (`--dns-server`);
    `front_ends`: the DNS name of every front-end host, among which the keys' limits are
    shared (`--front-ends`); `rate_exchange`: with engine hosts on other hosts, route on the
    whole fleet's arrival rate (`serving.fleet_rate`), not this host's alone."""
    resolve = None
    if dns_server is not None or front_ends is not None:
        from serving.discovery import dns_resolver

        resolve = dns_resolver(dns_server)
    replicas = ReplicaSet.from_deployment(deployment, engine_host, link_token, resolve)
    index = worker or 0
    rate: ArrivalRateEstimator | None = None
    accounts = peers = None
    if shared_view is not None:
        replicas.share(shared_view.rows, index)
        rate = SharedArrivalRate(shared_view.rows, index)
        accounts = shared_view.keys.for_worker(index)
    fleet_rate = None
    if rate_exchange and deployment.engine_hosts:
        fleet_rate = FleetArrivalRate(rate or ArrivalRateEstimator(), index, front_end_host())
        rate = fleet_rate
    metrics = Metrics(replicas, worker, shared_view)
    if shared_view is not None:
        peers = Peers(shared_view, index, metrics.recent.export)
    policy_ = make_policy(deployment, policy)
    # The precise prefix index (alone, or choosing the replica after the DQN chose the model)
    # hears the engines' KV events: a twin's in this process, a vLLM's over ZMQ where its
    # placement says where it publishes them. Not yet over the engine host's link.
    precise = getattr(policy_, "replica_policy", policy_)
    hearings: list[tuple[str, Rehasher, str]] = []
    if isinstance(precise, PrefixAffinity) and precise.precise:
        for index_, replica in enumerate(replicas):
            hear = functools.partial(precise.event, index_)
            publish = getattr(replica.engine, "publish_kv_events", None)
            if replica.config.kv_events is not None:
                rehasher = Rehasher(deployment.hash_block, hear)
                hearings.append((replica.config.kv_events, rehasher, replica.name))
            elif publish is not None:
                publish(hear)
    gateway = Gateway(deployment, replicas, policy_, metrics, rate=rate, key_accounts=accounts)
    classifier = QosClassifier.from_deployment(deployment)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gateway.counter = await asyncio.to_thread(gateway_counter, deployment)
        listening = [asyncio.create_task(subscribe(*hearing)) for hearing in hearings]
        await replicas.start()
        counting: asyncio.Task[None] | None = None
        exchanging = None
        if fleet_rate is not None:
            exchanging = asyncio.create_task(exchange(fleet_rate, replicas.links))
        if front_ends is not None:
            assert resolve is not None
            from serving.discovery import HostCount

            hosts = HostCount(front_ends, resolve, gateway.limiter.set_hosts)
            await hosts.refresh()  # before the first request: its key gets this host's share
            counting = asyncio.create_task(hosts.run())
        # Everything built so far (the engines' clients, torch, transformers: hundreds of
        # thousands of objects) lives as long as the server. A full collection scanned it all
        # and stalled the event loop for 0.3-0.6 s at a time under load, holding up every
        # request's packets; frozen, the collector scans only what serving allocates (as vLLM's
        # own server does after start-up).
        gc.collect()
        gc.freeze()
        loop_lag = asyncio.create_task(gateway.metrics.watch_loop_lag())
        if peers is not None:
            await peers.start()
        try:
            yield
        finally:
            loop_lag.cancel()
            if counting is not None:
                counting.cancel()
            if exchanging is not None:
                exchanging.cancel()
            for task in listening:
                task.cancel()
            if peers is not None:
                await peers.close()
            await replicas.close()

    drain = stopping_drain(gateway.metrics)
    app = create_app(gateway, lifespan, drain)
    # The playground and the dashboard: routes of the same app, so every transport serves them.
    add_pages(app, gateway, drain, peers)
    # Before the handler parses the request: under overload most requests end here, and the
    # less a refusal costs, the sooner it is answered.
    app.add_middleware(ShedAtTheDoor, gateway=gateway)
    app.add_middleware(
        BodyLimit,
        max_bytes=max_body_bytes,
        on_refuse=lambda scope: gateway.metrics.rejected(INVALID, record_of(scope)),
    )
    # Inside the tagging, so that a request refused while the server stops is counted with its
    # tag; outside the rest, so that nothing starts for it.
    app.add_middleware(Draining, drain=drain)
    # Outermost, so that even a refused body is counted with its tag. Requests the HTTP/3 server
    # tagged at their HEADERS pass as they are; the others are tagged here, from the arrival the
    # HTTP/1.1 server stamped.
    app.add_middleware(TagRequests, tag=classifier.tag)
    app.state.gateway = gateway
    app.state.classifier = classifier
    app.state.drain = drain
    return app
