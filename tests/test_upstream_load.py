"""The load a remote server reports of itself (`/metrics`, vLLM's names) in the router's view and
admission control's: parsed from vLLM's exposition, merged with the gateway's own count without
counting a request twice, marked stale when reports stop, and enough, with no latency profile,
to refuse at the door what a saturated upstream cannot start in time. Against the null upstream
(`workloads.null_server`, two requests at a time); tests/test_remote.py has one against a real
`vllm serve`."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx
import pytest

from serving.engines.base import EngineError, Sampling
from serving.engines.remote import QUIET_SCRAPES, RemoteEngine
from serving.gateway import retry_reason
from serving.launch import free_port
from serving.replicas import Replica, ReplicaSet
from tests.support.servers import PYTHON, Server, launch, serving_command, wait_until
from tests.support.servers import write_test_config as write_config
from tests.support.tiers import starts
from tests.test_remote_client import chat, replica

SLOTS = 2
EXPOSITION = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="up"} 3.0
vllm:num_requests_running{engine="1",model_name="up"} 4.0
vllm:num_requests_running{engine="0",model_name="other"} 50.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="up"} 0.0
vllm:num_requests_waiting{engine="1",model_name="up"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="up",reason="capacity"} 9.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="up"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="up"} 0.5
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="up"} 7.0
"""


def test_the_load_is_read_from_vllms_exposition_for_the_served_model_only() -> None:
    engine = RemoteEngine(replica("http://127.0.0.1:1/v1"))
    # Only those series are asked for: vLLM renders the rest (histograms, tens of KB) otherwise.
    assert engine._metrics_url == (
        "http://127.0.0.1:1/metrics?name[]=vllm:num_requests_running&name[]=vllm:"
        "num_requests_waiting&name[]=vllm:kv_cache_usage_perc&name[]=vllm:gpu_cache_usage_perc"
    )
    load = engine._parse_load(EXPOSITION, now=5.0)
    assert load is not None
    assert (load.running, load.waiting, load.others) == (7, 2, 9)  # both engines, "up" only
    assert load.kv_usage == 0.5 and load.at == 5.0 and not load.stale
    assert load.batch_cap == 7  # requests waited while 7 ran
    quiet = EXPOSITION.replace(b'model_name="up"} 2.0', b'model_name="up"} 0.0')
    assert engine._parse_load(quiet, now=6.0).batch_cap == 7  # kept from the last report
    assert engine._parse_load(b"# a server that is not vLLM\nup 1\n", now=7.0) is None


@pytest.fixture(scope="module")
@starts("twin")
def null_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    folder = tmp_path_factory.mktemp("upstream")
    command = [PYTHON, "-m", "workloads.null_server", "--port", str(port), "--h3-port", "0",
               "--model", "up", "--first-token-ms", "20", "--token-gap-ms", "20",
               "--max-num-seqs", str(SLOTS)]  # fmt: skip
    null = launch("null-upstream", command, port, "/health", folder)
    yield null.wait_ready()
    null.stop()


class OtherClient:
    """Requests sent straight to the upstream, as another client of the same server would, held
    open until `close`."""

    def __init__(self, url: str, count: int) -> None:
        self.url, self.stop = url, threading.Event()
        self.threads = [threading.Thread(target=self._hold) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _hold(self) -> None:
        body = {"model": "up", "prompt": "hi", "max_tokens": 5000, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_bytes():
                if self.stop.is_set():
                    return  # closing the stream aborts it upstream

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)


async def eventually(predicate: object, what: str, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.02)


async def test_other_clients_load_reaches_the_view_once_and_a_stale_report_is_not_trusted(
    null_upstream: Server,
) -> None:
    config = dataclasses.replace(replica(null_upstream.url + "/v1"), scrape_s=0.05)
    engine = RemoteEngine(config)
    replicas = ReplicaSet([Replica(config, engine)])
    await engine.start()
    other = await asyncio.to_thread(OtherClient, null_upstream.url, 1)
    ours: asyncio.Task[None] | None = None
    try:
        view = replicas.view
        await eventually(lambda: view().replicas[0].running == 1, "the other client's request")

        async def generate() -> None:
            async for _ in engine.generate(chat(max_tokens=5000, request_id="ours"), Sampling()):
                pass

        ours = asyncio.create_task(generate())
        replicas[0].running += 1  # as the gateway counts what it dispatches
        await eventually(lambda: (load := engine.load()) is not None and load.running == 2, "")
        await asyncio.sleep(0.2)  # several more reports: ours must never count twice
        assert view().replicas[0].running == 2 and engine.load().others == 1  # type: ignore[union-attr]

        with stopped(null_upstream):  # reports stop; requests stay
            await eventually(lambda: engine.load().stale, "the report to go stale")  # type: ignore[union-attr]
            assert view().replicas[0].running == 1  # the gateway's own count only
        await eventually(lambda: not engine.load().stale, "reports again")  # type: ignore[union-attr]
        assert view().replicas[0].running == 2
    finally:
        if ours is not None:
            ours.cancel()
        await asyncio.to_thread(other.close)
        await engine.close()


@asynccontextmanager
async def scraping(upstream: Server, scrape_s: float) -> AsyncIterator[RemoteEngine]:
    """A remote engine for `upstream` that reads its load every `scrape_s`, started."""
    engine = RemoteEngine(dataclasses.replace(replica(upstream.url + "/v1"), scrape_s=scrape_s))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


@asynccontextmanager
async def other_clients(upstream: Server, count: int) -> AsyncIterator[OtherClient]:
    other = await asyncio.to_thread(OtherClient, upstream.url, count)
    try:
        yield other
    finally:
        await asyncio.to_thread(other.close)


@contextmanager
def stopped(server: Server) -> Iterator[None]:
    """`server` answers nothing (SIGSTOP) until the block ends; its connections stay open."""
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


async def test_a_quiet_upstream_is_read_less_often_until_another_clients_load_shows(
    null_upstream: Server,
) -> None:
    async with scraping(null_upstream, 0.02) as engine:
        # Nothing but the gateway's own (no) requests: each report says so, and the next waits
        # longer, up to QUIET_SCRAPES intervals.
        await eventually(lambda: engine.scrape_interval == QUIET_SCRAPES * 0.02, "quiet")
        async with other_clients(null_upstream, 1):
            await eventually(lambda: (load := engine.load()) is not None and load.others == 1, "")
            for _ in range(5):  # while it shows, every report is read at the configured interval
                assert engine.scrape_interval == 0.02
                await asyncio.sleep(0.02)


async def test_a_server_that_answers_nothing_has_its_queued_request_sent_elsewhere(
    null_upstream: Server,
) -> None:
    # Another client holds both of the server's slots, and ours waits in its queue. Then the
    # server stops answering anything (SIGSTOP): once its reports are stale and none of its
    # streams has read a thing since the last, it is marked down and ours ends in an error the
    # gateway routes again, long before the read timeout (60 s).
    async with scraping(null_upstream, 0.05) as engine, other_clients(null_upstream, SLOTS):
        await eventually(lambda: (load := engine.load()) is not None and load.running == SLOTS, "")
        queued = engine.generate(chat(max_tokens=5, request_id="queued"), Sampling())
        first = asyncio.ensure_future(anext(queued))
        await eventually(lambda: (load := engine.load()) is not None and load.waiting == 1, "")
        with stopped(null_upstream):
            started = time.monotonic()
            with pytest.raises(EngineError) as failed:
                await asyncio.wait_for(first, 10)
            assert retry_reason(failed.value) in ("engine_unavailable", "upstream_lost")
            assert time.monotonic() - started < 5 and not engine.healthy()


@pytest.fixture(scope="module")
@starts("twin")
def gateway(tmp_path_factory: pytest.TempPathFactory, null_upstream: Server) -> Iterator[Server]:
    """A remote deployment with no latency profile, so admission control learns the upstream."""
    folder = tmp_path_factory.mktemp("gateway")
    placement = [{"model": "tiny-s", "url": null_upstream.url + "/v1", "served_name": "up",
                  "scrape_s": 0.05}]  # fmt: skip
    config = write_config(folder, unprofiled=(placement, {"placement": "unprofiled"}))
    port = free_port()
    server = launch("gateway", serving_command(config, "unprofiled", port), port, "/readyz", folder)
    yield server.wait_ready()
    server.stop()


def test_a_saturated_upstream_has_the_next_free_tier_request_refused_at_the_door(
    gateway: Server, null_upstream: Server
) -> None:
    replica_labels = {"replica": null_upstream.url.split("//")[1] + "/tiny-s", "model": "tiny-s"}
    # Twelve requests of another client hold the upstream's two slots and queue behind them. The
    # test config gives every class 60 s, so the free tier's budget is 15 s: behind ten waiting
    # requests, each counted as owing 256 tokens, the learned estimate is 28 s at 20 ms a step.
    other = OtherClient(null_upstream.url, 12)
    try:
        wait_until(
            lambda: gateway.metric("serving_upstream_waiting", **replica_labels) == 12 - SLOTS,
            what="the gateway to see the upstream's queue",
        )
        assert gateway.metric("serving_upstream_batch_cap", **replica_labels) == SLOTS
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
        r = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "overloaded", r.json()
        upstream = httpx.get(null_upstream.url + "/metrics", timeout=5).text
        assert 'vllm:num_requests_waiting{model_name="up"} 10' in upstream  # never sent there
        assert gateway.metric("serving_requests_total", qos_class="free-tier", model="none",
                              outcome="shed") == 1  # fmt: skip
    finally:
        other.close()
