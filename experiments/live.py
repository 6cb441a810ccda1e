"""Start the real server for a live experiment and run the load generator against it."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LiveServer:
    url: str
    """HTTP/1.1."""
    h3_port: int
    """HTTP/3, UDP on 127.0.0.1."""


@contextlib.contextmanager
def server(
    deployment: str, policy: str | None, log: Path, startup_s: float = 300.0
) -> Iterator[LiveServer]:
    """`python -m serving` on free ports, yielded once /healthz answers, and stopped (SIGTERM,
    then SIGKILL) on the way out. Its log goes to `log`."""
    port, h3_port = _free_port(socket.SOCK_STREAM), _free_port(socket.SOCK_DGRAM)
    command = [sys.executable, "-m", "serving", "--deployment", deployment, "--port", str(port),
               "--h3-port", str(h3_port)]  # fmt: skip
    if policy:
        command += ["--policy", policy]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {startup_s:g} s; see {log}")
            time.sleep(0.5)
        yield LiveServer(url, h3_port)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def replay(url: str, out: Path, *flags: str) -> dict:
    """`python -m workloads.replay` over HTTP/1.1 against `url`; returns its JSON record."""
    command = [sys.executable, "-m", "workloads.replay", "--proto", "h1", "--url", url,
               "--out", str(out), "--no-progress", *flags]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode == 2 or not out.exists():
        raise RuntimeError(f"replay failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return json.loads(out.read_text())
