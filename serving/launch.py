"""Start a server process on this machine and wait until it answers: the one way the tests, the
experiments, the benchmarks and the quality command do it.

A server runs in a process group of its own, so that stopping it stops what it started too (vLLM
engine processes, a forwarder), and its output goes to a log file that a failed start is reported
with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
"""The repository: where servers run, so that models.yaml's relative paths resolve."""


class NotReady(RuntimeError):
    """A server that exited, or did not answer in time; the message ends with its log's tail."""


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port free on 127.0.0.1 now, TCP or (SOCK_DGRAM) UDP. Another process may take it before
    the server binds it: rare, and the server then exits with 'address already in use'."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shipped_spec() -> dict:
    """The shipped models.yaml as data, its local model sources made absolute: for a config
    written elsewhere (a benchmark's, a test's) that must still find the models."""
    spec = yaml.safe_load((ROOT / "models.yaml").read_text())
    for model in spec["models"].values():
        if model["source"].startswith("."):
            model["source"] = str(ROOT / model["source"])
    return spec


def serving_command(deployment: str | None, port: int, *extra: str) -> list[str]:
    """`python -m serving` on `port` (HTTP/1.1) for `deployment` (None: models.yaml's default)."""
    chosen = ["--deployment", deployment] if deployment else []
    return [sys.executable, "-m", "serving", *chosen, "--port", str(port), *extra]


@dataclass
class Launched:
    """A server process on localhost, started by `launch`."""

    name: str
    process: subprocess.Popen
    port: int
    """Its TCP port (HTTP/1.1, or HTTPS with `tls`)."""
    log: Path
    ready_path: str
    """Answers 200 once the server is ready: /readyz, /healthz, /v1/models."""
    h3_port: int | None = None
    """Its UDP port, where it serves HTTP/3."""
    tls: bool = False
    host: str = "127.0.0.1"
    """The address it serves on (a loopback address of its own, as a host of its own)."""

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def ready(self, timeout_s: float = 300.0, tick: Callable[[], None] | None = None) -> Launched:
        """Wait until `ready_path` answers 200; raises NotReady if the process exits first or
        `timeout_s` passes. `tick` is called at each try (a progress bar's update)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise NotReady(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                answer = httpx.get(self.url + self.ready_path, timeout=2, verify=False)
                if answer.status_code == 200:
                    return self
            if time.monotonic() > deadline:
                raise NotReady(f"{self.name} not ready after {timeout_s:g} s:\n{self.tail()}")
            if tick is not None:
                tick()
            time.sleep(0.5)

    def listening(self, timeout_s: float = 120.0) -> Launched:
        """Wait until its TCP port takes connections at its host (a server with no HTTP, such
        as an engine host, which listens once its engines run); raises NotReady as `ready`."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise NotReady(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            with socket.socket() as probe:
                probe.settimeout(1)
                if probe.connect_ex((self.host, self.port)) == 0:
                    return self
            if time.monotonic() > deadline:
                raise NotReady(f"{self.name} not listening after {timeout_s:g} s:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """A graceful stop (SIGTERM: the server drains and stops its engines), then SIGKILL to
        whatever of its process group is left: vLLM workers outlive their server by seconds."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def __enter__(self) -> Launched:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def launch(
    name: str,
    args: Sequence[str],
    port: int,
    ready_path: str,
    log: Path,
    env: dict[str, str] | None = None,
    h3_port: int | None = None,
    cpus: set[int] | None = None,
    host: str = "127.0.0.1",
) -> Launched:
    """Start `args` in the repository, its output to `log`, in a process group of its own, with
    `env` added to this process's environment and pinned to `cpus` (its children too). It is
    not waited for: call `ready()`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(
            list(args),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
    return Launched(name, process, port, log, ready_path, h3_port, host=host)
