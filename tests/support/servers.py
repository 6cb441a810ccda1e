"""Servers for tests: start one (`launch`, refused for a test in no tier), the test config it
reads (`write_test_config`), and what a test asks of it (`Server`: its request log, /metrics)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from serving.launch import Launched, NotReady, free_port, shipped_spec
from serving.launch import launch as start_server
from serving.launch import serving_command as serving_args
from tests.support.tiers import require_tier

ROOT = Path(__file__).resolve().parents[2]


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
            self.stop()  # the fixture fails here, before the `stop` after its yield
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


def launch(
    name: str,
    args: list[str],
    port: int,
    health_path: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    h3_port: int | None = None,
) -> Server:
    """Start a server for a test; refused for a test in no tier (`tiers.require_tier`)."""
    if threading.current_thread() is threading.main_thread():
        require_tier(name)
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


def write_test_config(tmp_dir: Path, **extra_deployments: tuple[list[dict], dict]) -> Path:
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


CERT = ROOT / ".certs" / "cert.pem"
"""The self-signed certificate the servers make on first start (transport.tls)."""


def null_remote_config(folder: Path, upstream: Server) -> Path:
    """A test config whose deployment `null_remote` is one remote replica of tiny-s: `upstream`
    serving it as `up`."""
    placement = [{"model": "tiny-s", "url": upstream.url + "/v1", "served_name": "up"}]
    deployment = {"placement": "null_remote", "policy": {"name": "least-load"}}
    return write_test_config(folder, null_remote=(placement, deployment))
