"""How each request ended: Prometheus metrics (in a registry of their own, one per app) and one
JSON log line per request, written together by `Metrics.finish` so that the two always agree.

Every clock runs from the request's arrival at the server (`transport.qos.RequestTag`), so a
request that waited before the handler saw it shows that wait: as `serving_queue_seconds` and in
its TTFT. TTFT = queue + route + engine TTFT, each a histogram and a field of the log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from serving.outcomes import (
    CANCELLED,
    CLIENTS_OWN,
    OK,
    SHED,
    STOPPED,
    WORKER_DIED,
    RequestRecord,
)
from serving.recent import Recent
from serving.replicas import ReplicaSet
from transport.process_tree import tree_use

if TYPE_CHECKING:
    from serving.shared_view import SharedView

# The *_created series double the exposition and nobody here reads them.
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.0, 4.0, 8.0, 16.0)
_QUEUE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 1.0, 4.0, 16.0)
_ROUTE_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 1e-3)
_COUNT_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.05)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0)

REQUESTS = (
    "serving_requests",
    "Requests by QoS class, model and outcome.",
    ["qos_class", "model", "outcome"],
)

request_log = logging.getLogger("serving.requests")
"""One JSON line per request; `python -m serving --request-log` says where it goes."""


class Metrics:
    def __init__(
        self, replicas: ReplicaSet, worker: int | None = None, shared: SharedView | None = None
    ) -> None:
        """`shared`: with several workers, what they share: its prometheus_client multiprocess
        folder, which PROMETHEUS_MULTIPROC_DIR names (the supervisor sets it before this
        process started, as the library must know it before its first metric), and this
        worker's row, where it counts the requests it holds open."""
        self.worker = worker
        self._open: Callable[[int, int], None] | None = None
        self._classes: dict[str, int] = {}
        """This process's index among `--workers` (None: the only one), for the request log."""
        own = CollectorRegistry()
        """Where the metrics below live. Alone, the one /metrics reads. With several workers,
        their values go to files of this process's own in `shared` instead, and /metrics
        reads every worker's files merged: one set of numbers for the whole server, whichever
        worker answers, and still counting what a worker served before it died."""
        self.registry = own
        if shared is not None:
            folder = str(shared.metrics)
            assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == folder, folder
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry, path=folder)
            self._open = partial(shared.rows.add_open, worker or 0)
            self._classes = {name: i for i, name in enumerate(shared.classes)}
        self.requests = Counter(*REQUESTS, registry=own)
        self.limited = Counter(
            "serving_limited",
            "Requests refused with 429 because their API key was over a limit, by the key's "
            "tier and the limit (rate or concurrent). Also counted in serving_requests_total "
            "with outcome limited.",
            ["tier", "limit"],
            registry=own,
        )
        self.retries = Counter(
            "serving_retries",
            "Requests routed again because their replica failed them before their first token, "
            "by why: engine_unavailable (it could not take them), engine_error (it failed "
            "after taking them), upstream_lost (the connection to its server was lost).",
            ["reason"],
            registry=own,
        )
        self.ttft = Histogram(
            "serving_ttft_seconds",
            "Time from arrival at the server to the first token.",
            ["qos_class", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.queue = Histogram(
            "serving_queue_seconds",
            "Time from arrival at the server until the handler took the request up: reading and "
            "parsing it, and waiting for the event loop. Every request that reached the handler.",
            ["qos_class"],
            buckets=_QUEUE_BUCKETS,
            registry=own,
        )
        self.engine_ttft = Histogram(
            "serving_engine_ttft_seconds",
            "Time from dispatch to a replica until its first token: engine queue and prefill.",
            ["qos_class", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.loop_lag = Histogram(
            "serving_event_loop_lag_seconds",
            "How late the server's event loop ran a timer: time a request's bytes may wait "
            "unread before its arrival is stamped.",
            buckets=_QUEUE_BUCKETS,
            registry=own,
        )
        self.tpot = Histogram(
            "serving_tpot_seconds",
            "Mean time per output token after the first, per request.",
            ["qos_class", "model"],
            buckets=_TPOT_BUCKETS,
            registry=own,
        )
        self.e2e = Histogram(
            "serving_e2e_seconds",
            "Time from arrival to the last token.",
            ["qos_class", "model"],
            buckets=_LATENCY_BUCKETS,
            registry=own,
        )
        self.slo_met = Counter(
            "serving_slo_met",
            "Completed requests whose time per output token met the SLO.",
            ["qos_class", "model"],
            registry=own,
        )
        self.tokens = Counter(
            "serving_generated_tokens",
            "Output tokens streamed to clients.",
            ["model"],
            registry=own,
        )
        self.arrival_rate = Gauge(
            "serving_router_arrival_rate",
            "The router's arrival-rate estimate (req/s), as the latest request saw it.",
            registry=own,
            # Every worker's estimate is the whole server's (`serving.shared_view`).
            multiprocess_mode="livemostrecent",
        )
        self.client_rtt = Histogram(
            "serving_client_rtt_seconds",
            "The smoothed RTT of each request's client path, as the server measured it (QUIC's "
            "recovery state, TCP_INFO) or a trusted edge forwarded it.",
            ["protocol"],
            buckets=_QUEUE_BUCKETS,
            registry=own,
        )
        self.route = Histogram(
            "serving_route_seconds",
            "Time the router took to choose a replica: live view, features and policy.",
            buckets=_ROUTE_BUCKETS,
            registry=own,
        )
        self.prompt_count = Histogram(
            "serving_prompt_count_seconds",
            "Time the gateway took to count a prompt's tokens and hash its blocks, before routing.",
            buckets=_COUNT_BUCKETS,
            registry=own,
        )
        self.registry.register(_ReplicaCollector(replicas))
        if shared is None:
            # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds: the
            # front-end process's own (engines run in processes of their own).
            ProcessCollector(registry=self.registry)
        else:
            # The same names for the whole server: its supervisor (this worker's parent) and
            # everything under it.
            self.registry.register(_TreeCollector(os.getppid()))
        self.recent = Recent(CLIENTS_OWN, SHED)
        """The last decisions and outcomes, and each class's last minute, for the dashboard."""
        self._cut: set[str] = set()
        """Requests the server cut as it stopped: they end as stopped, not cancelled."""

    def cut(self, request_id: str) -> None:
        """The server is cutting this request as it stops (`transport.drain`): the gateway will
        see its client leave and close it, and it counts as stopped."""
        self._cut.add(request_id)

    def opened(self, record: RequestRecord) -> None:
        """The gateway takes the request up. Until `finish`, it counts in this worker's shared
        row, from which the supervisor counts it as ended with the worker if the worker dies
        (`count_lost`): so that, even then, every request is counted once."""
        if (
            self._open is not None
            and (cell := self._classes.get(record.qos_class or "")) is not None
        ):
            record.open_as = cell
            self._open(cell, 1)

    def rejected(self, outcome: str, record: RequestRecord) -> None:
        """Count a request refused before the gateway saw it (bad input, a refused key)."""
        self.finish(record, outcome, slo_met=False)

    def finish(self, record: RequestRecord, outcome: str, slo_met: bool) -> None:
        """Count how one request ended, and log it: exactly once per request."""
        if outcome == CANCELLED and record.request_id in self._cut:
            outcome = STOPPED
        if record.open_as is not None and self._open is not None:
            self._open(record.open_as, -1)
            record.open_as = None
        self.recent.finished(record, outcome, slo_met)
        cls, model = record.qos_class or "none", record.model or "none"
        self.requests.labels(cls, model, outcome).inc()
        if record.received is not None:
            self.queue.labels(cls).observe(record.received - record.arrival)
        if record.routed is not None and record.first_token is not None:
            self.engine_ttft.labels(cls, model).observe(record.first_token - record.routed)
        if outcome == OK and record.first_token is not None and record.last_token is not None:
            self.ttft.labels(cls, model).observe(record.first_token - record.arrival)
            self.e2e.labels(cls, model).observe(record.last_token - record.arrival)
            self.tokens.labels(model).inc(record.tokens)
            if (tpot := record.tpot_s) is not None:
                self.tpot.labels(cls, model).observe(tpot)
            if slo_met:
                self.slo_met.labels(cls, model).inc()
        if record.client_rtt_s is not None:
            self.client_rtt.labels(record.protocol or "none").observe(record.client_rtt_s)
        if request_log.isEnabledFor(logging.INFO):
            request_log.info(record.line(outcome, slo_met, self.worker))

    async def watch_loop_lag(self, interval_s: float = 0.05) -> None:
        """Sample how late the event loop runs a timer, until cancelled."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                due = loop.time() + interval_s
                await asyncio.sleep(interval_s)
                self.loop_lag.observe(max(0.0, loop.time() - due))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def count_lost(folder: Path, pid: int, lost: dict[str, int]) -> None:
    """Count in /metrics, as ended with outcome worker_died, the requests of each class that
    worker `pid` held open when it died: in its own multiprocess file, which the merge reads
    as it reads the counts the worker made itself. (prometheus_client has no call to count for
    another process; its file format is what its collector reads.)"""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    name, documentation, labels = REQUESTS
    counts = MmapedDict(str(folder / f"counter_{pid}.db"))
    try:
        for qos_class, requests in lost.items():
            if requests:
                key = mmap_key(name, f"{name}_total", labels,
                               [qos_class, "none", WORKER_DIED], documentation)  # fmt: skip
                value, _ = counts.read_value(key)
                counts.write_value(key, value + requests, 0.0)
    finally:
        counts.close()


class _TreeCollector(Collector):
    """process_* for a process and everything under it (`transport.process_tree`)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def collect(self) -> Iterable[Metric]:
        use = tree_use(self.pid)
        yield CounterMetricFamily(
            "process_cpu_seconds",
            "User and system CPU of the server's processes (supervisor, workers, engine host, "
            "their children, and those that exited), in seconds.",
            value=use.cpu_s,
        )
        yield GaugeMetricFamily(
            "process_resident_memory_bytes",
            "Resident memory of the server's live processes, summed, in bytes.",
            value=use.rss_bytes,
        )
        yield GaugeMetricFamily(
            "process_open_fds", "Open file descriptors of the server's live processes.",
            value=use.open_fds,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "serving_processes", "The server's live processes.", value=use.processes
        )


_REPLICA_LABELS = ["replica", "model"]
M = TypeVar("M", GaugeMetricFamily, CounterMetricFamily)


class _ReplicaCollector(Collector):
    """Per-replica gauges, read from the live replica set at scrape time."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterable[Metric]:
        yield self._gauge(
            "serving_replica_in_flight",
            "Requests the gateway has dispatched to the replica and not finished (every worker's).",
            ((r, self.replicas.totals(i)[0]) for i, r in enumerate(self.replicas)),
        )
        yield self._gauge(
            "serving_engine_unfinished",
            "Requests the replica's engine itself still holds.",
            ((r, r.engine.unfinished()) for r in self.replicas),
        )
        yield self._gauge(
            "serving_replica_healthy",
            "1 if the replica accepts requests, 0 while its engine is down or restarting.",
            ((r, int(r.engine.healthy())) for r in self.replicas),
        )
        yield from self._upstream_load()
        yield self._labelled(
            CounterMetricFamily(
                "serving_engine_restarts",
                "Times the replica's engine came back after it went down: a vLLM engine "
                "restarted, a remote server reachable again.",
                labels=_REPLICA_LABELS,
            ),
            ((r, r.restarts) for r in self.replicas),
        )

    def _upstream_load(self) -> Iterator[Metric]:
        """The load remote replicas' servers last reported (`UpstreamLoad`); only for those
        that report one."""
        now = time.monotonic()
        loads = [(r, load) for r in self.replicas if (load := r.engine.load()) is not None]
        series = [
            ("running", "Requests its server reports running.", lambda u: u.running),
            ("waiting", "Requests its server reports waiting.", lambda u: u.waiting),
            ("others", "Of those, the requests other clients sent.", lambda u: u.others),
            ("batch_cap", "The most it ran with others waiting.", lambda u: u.batch_cap),
            ("report_age_seconds", "Age of its server's last load report.", lambda u: now - u.at),
            ("stale", "1 while that report is too old to route on.", lambda u: int(u.stale)),
        ]
        for name, doc, value in series:
            yield self._gauge(f"serving_upstream_{name}", doc, ((r, value(u)) for r, u in loads))
        yield self._gauge(
            "serving_upstream_kv_usage",
            "Share of its server's KV cache in use, where it reports it.",
            ((r, u.kv_usage) for r, u in loads if u.kv_usage is not None),
        )

    @classmethod
    def _gauge(cls, name: str, doc: str, values: Iterator) -> GaugeMetricFamily:
        return cls._labelled(GaugeMetricFamily(name, doc, labels=_REPLICA_LABELS), values)

    @staticmethod
    def _labelled(family: M, values: Iterator) -> M:
        for replica, value in values:
            family.add_metric([replica.name, replica.model], value)
        return family
