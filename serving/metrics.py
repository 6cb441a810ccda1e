"""Prometheus metrics of the gateway, in a registry of their own (one per app, not global)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.replicas import ReplicaSet

# Outcomes of a request. Every request the API accepts ends in exactly one of them.
OK = "ok"
INVALID = "invalid"  # 4xx: the request itself was wrong
REFUSED = "refused"  # 401/403: no key, or a class the key does not grant
UNAVAILABLE = "unavailable"  # 503: no healthy replica could take it
DEADLINE = "deadline"  # no first token within the class's deadline
ENGINE_ERROR = "engine_error"  # the engine failed after accepting it
CANCELLED = "cancelled"  # the client went away first

# The *_created series double the exposition and nobody here reads them.
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.0, 4.0, 8.0, 16.0)
_ROUTE_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 1e-3)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0)


class Metrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "serving_requests",
            "Requests by QoS class, model and outcome.",
            ["qos_class", "model", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "serving_ttft_seconds",
            "Time from arrival to the first token.",
            ["qos_class", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "serving_tpot_seconds",
            "Mean time per output token after the first, per request.",
            ["qos_class", "model"],
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "serving_e2e_seconds",
            "Time from arrival to the last token.",
            ["qos_class", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.slo_met = Counter(
            "serving_slo_met",
            "Completed requests whose time per output token met the SLO.",
            ["qos_class", "model"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "serving_generated_tokens",
            "Output tokens streamed to clients.",
            ["model"],
            registry=self.registry,
        )
        self.arrival_rate = Gauge(
            "serving_router_arrival_rate",
            "The router's arrival-rate estimate (req/s), as the latest request saw it.",
            registry=self.registry,
        )
        self.route = Histogram(
            "serving_route_seconds",
            "Time the router took to choose a replica: live view, features and policy.",
            buckets=_ROUTE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_ReplicaCollector(replicas))

    def rejected(self, outcome: str) -> None:
        """Count a request refused before it had a class or a model."""
        self.requests.labels("none", "none", outcome).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _ReplicaCollector(Collector):
    """Per-replica gauges, read from the live replica set at scrape time."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterable[Metric]:
        yield self._gauge(
            "serving_replica_in_flight",
            "Requests the gateway has dispatched to the replica and not finished.",
            ((r, r.running) for r in self.replicas),
        )
        yield self._gauge(
            "serving_engine_unfinished",
            "Requests the replica's engine itself still holds.",
            ((r, r.engine.unfinished()) for r in self.replicas),
        )
        yield self._gauge(
            "serving_replica_healthy",
            "1 if the replica accepts requests.",
            ((r, int(r.engine.healthy())) for r in self.replicas),
        )

    @staticmethod
    def _gauge(name: str, doc: str, values: Iterator) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, doc, labels=["replica", "model"])
        for replica, value in values:
            gauge.add_metric([replica.name, replica.model], value)
        return gauge
