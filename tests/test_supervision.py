"""Engine supervision: a replica whose engine dies leaves the router's view, is brought back with
backoff, and serves again; requests it held end as engine errors.

The live tests run servers of their own (one kills a vLLM engine, the other takes a remote
engine's server away), so the servers other tests share never see an outage.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from config import load_deployment
from serving.engines.base import EngineUnavailable
from serving.launch import free_port
from serving.replicas import PROBE_BACKOFF, Backoff, Replica, Supervisor
from tests.support.processes import ENGINE_CORE, processes_under, thread_cores
from tests.support.servers import (
    PYTHON,
    ROOT,
    Server,
    launch,
    one_vllm_engine,
    remote_placement,
    serving_command,
    wait_until,
    write_test_config,
)
from tests.support.tiers import starts

HELLO = [{"role": "user", "content": "Hello there!"}]
VLLM_REPLICA = "cpu/tiny-s"
RECOVERY_TIMEOUT_S = 180


class _Done(Exception):
    pass


class _FlakyEngine:
    """Up until it dies; then its `recover()` fails `failures` times before it works."""

    def __init__(self, failures: int) -> None:
        self.up = True
        self.failures = failures
        self._left = 0

    def die(self) -> None:
        self.up, self._left = False, self.failures

    def healthy(self) -> bool:
        return self.up

    async def recover(self) -> None:
        if self._left:
            self._left -= 1
            raise EngineUnavailable("not yet")
        self.up = True


def test_supervisor_backs_off_and_resets_once_the_engine_stays_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a virtual clock: the engine dies at 10 s, again soon after it is back, and once more
    long after; each time two tries fail before the third brings it back."""
    poll_s = 0.25
    now = 0.0
    deaths = [10.0, 20.0, 300.0]
    engine = _FlakyEngine(failures=2)
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        nonlocal now
        now += seconds
        if seconds != poll_s:
            waits.append(seconds)
        if deaths and now >= deaths[0]:
            deaths.pop(0)
            engine.die()
        if now > 400:
            raise _Done

    config = load_deployment(ROOT / "models.yaml", "embedded").replicas[0]
    replica = Replica(config, engine)  # type: ignore[arg-type]
    backoff = Backoff(first_s=1, max_s=10, stable_s=120)
    supervisor = Supervisor(replica, backoff, poll_s=poll_s, sleep=sleep, clock=lambda: now)
    with caplog.at_level(logging.INFO, logger="serving.replicas"), pytest.raises(_Done):
        asyncio.run(supervisor.run())
    # Doubling, capped at 10 s; not reset by a death 3 s after coming back, reset after 120 s up.
    assert waits == [1, 2, 4, 8, 10, 10, 1, 2, 4]
    assert replica.restarts == 3
    lines = [r.getMessage() for r in caplog.records]
    assert sum("engine down" in line for line in lines) == 3
    assert sum("engine back after" in line for line in lines) == 3
    # The same failure reason is said once per outage, not at every try.
    assert sum("still down" in line for line in lines) == 3


@pytest.fixture(scope="module")
@starts("vllm")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """A server with one vLLM replica, a null server standing in for a `vllm serve`, and a
    server whose one replica is that null server. All start at once."""
    work = tmp_path_factory.mktemp("supervision")
    null_port = free_port()
    config = write_test_config(
        work,
        supervised=one_vllm_engine("supervised", "tiny-s"),
        remote_null=(
            remote_placement(null_port),
            {"placement": "remote_null", "policy": {"name": "quality-threshold"}},
        ),
    )
    found: dict[str, Server] = {}
    try:
        found["null"] = _launch_null(null_port, work)
        for name, deployment in (("vllm", "supervised"), ("remote", "remote_null")):
            port = free_port()
            command = serving_command(config, deployment, port, "--h3-port", "0")
            found[name] = launch(f"supervised-{name}", command, port, "/readyz", work)
        yield found
    finally:
        for server in found.values():
            server.stop()


def _launch_null(port: int, work: Path) -> Server:
    command = [PYTHON, "-m", "workloads.null_server", "--port", str(port), "--h3-port", "0",
               "--model", "tiny-s"]  # fmt: skip
    return launch("null-upstream", command, port, "/v1/models", work)


def _chat(server: Server) -> httpx.Response:
    body = {"model": "tiny-s", "messages": HELLO, "max_tokens": 8}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _ready(server: Server) -> bool:
    return httpx.get(server.url + "/readyz", timeout=5).status_code == 200


def test_a_killed_vllm_engine_fails_its_requests_then_restarts_and_serves(
    servers: dict[str, Server],
) -> None:
    server = servers["vllm"].wait_ready()
    before = processes_under(server.process.pid)
    (killed,) = [pid for pid, name in before.items() if name == ENGINE_CORE]
    old_engine = {killed, *processes_under(killed)}  # its worker, where it has one
    cores = thread_cores(killed), thread_cores(server.process.pid)
    body = {"model": "tiny-s", "messages": HELLO, "max_tokens": 2000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    events: list[str] = []
    with (
        ThreadPoolExecutor(1) as pool,
        httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r,
    ):
        assert r.status_code == 200
        lines = (line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data:"))
        events.append(next(lines))
        # Held, the engine takes a second request that then waits for its first token, so the
        # kill finds one request mid-stream and one that never saw a token.
        os.kill(killed, signal.SIGSTOP)
        waiting = pool.submit(_chat, server)
        wait_until(
            lambda: (
                server.metric("serving_engine_unfinished", replica=VLLM_REPLICA, model="tiny-s")
                == 2
            ),
            30,
            "the engine to hold both requests",
        )
        os.kill(killed, signal.SIGKILL)
        events.extend(lines)
        unstreamed = waiting.result()
    assert events[-1] == "[DONE]"
    assert '"engine_error"' in events[-2], events[-2]
    assert unstreamed.status_code == 500
    assert unstreamed.json()["error"]["code"] == "engine_error"
    failed = server.metric(
        "serving_requests_total", qos_class="free-tier", model="tiny-s", outcome="engine_error"
    )
    assert failed == 2

    # Down, out of the router's view: a request for the model has nowhere to go. The restart
    # waits at least the first backoff (1 s) and then an engine start, far longer than this.
    ready = httpx.get(server.url + "/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["down"] == [VLLM_REPLICA]
    assert server.metric("serving_replica_healthy", replica=VLLM_REPLICA, model="tiny-s") == 0
    assert _chat(server).status_code == 503

    wait_until(lambda: _ready(server), RECOVERY_TIMEOUT_S, "the engine to be back")
    # Warmed up again before it rejoined: by the time /readyz lists it, the new engine has run
    # every path (the log line of its start says how long each took).
    warmed = [
        line
        for line in server.log.read_text().splitlines()
        if f"{VLLM_REPLICA}: ready in" in line and "log-probabilities of prompt and output" in line
    ]
    assert len(warmed) == 2, warmed
    r = _chat(server)
    assert r.status_code == 200, r.text
    assert r.json()["replica"] == VLLM_REPLICA
    assert r.json()["usage"]["completion_tokens"] == 8
    assert server.metric("serving_engine_restarts_total", replica=VLLM_REPLICA, model="tiny-s") == 1

    # A new EngineCore, and nothing of the old engine left behind, here or orphaned elsewhere.
    after = processes_under(server.process.pid)
    (restarted,) = [pid for pid, name in after.items() if name == ENGINE_CORE]
    assert restarted != killed
    assert set(before) - set(after) == old_engine, before
    assert not [pid for pid in old_engine if _alive(pid)]
    assert set(after) - set(before) == {restarted, *processes_under(restarted)}, after
    # Started on the same cores as the first, and the front-end's threads kept theirs.
    assert (thread_cores(restarted), thread_cores(server.process.pid)) == cores
    log = server.log.read_text()
    assert f"{VLLM_REPLICA}: engine down" in log and f"{VLLM_REPLICA}: engine back after" in log


def test_a_remote_engine_rejoins_when_its_server_answers_again(
    servers: dict[str, Server],
) -> None:
    upstream = servers["null"].wait_ready()
    server = servers["remote"].wait_ready()
    replica = f"127.0.0.1:{upstream.port}/tiny-s"
    assert _chat(server).json()["replica"] == replica

    upstream.stop()
    # The engine learns that its server is gone from the request that cannot reach it.
    assert _chat(server).status_code == 503
    ready = httpx.get(server.url + "/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["down"] == [replica]

    servers["null"] = _launch_null(upstream.port, upstream.log.parent).wait_ready()
    # Probed with backoff: the next probe may be up to the longest wait away.
    wait_until(lambda: _ready(server), PROBE_BACKOFF.max_s + 30, "the remote replica to rejoin")
    r = _chat(server)
    assert r.status_code == 200 and r.json()["replica"] == replica
    assert server.metric("serving_engine_restarts_total", replica=replica, model="tiny-s") == 1
    assert f"{replica}: engine back after" in server.log.read_text()
