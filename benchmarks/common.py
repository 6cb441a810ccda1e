"""What several benchmarks share: the upstreams they put behind a gateway (null servers and real
`vllm serve`), the peers' gateways (sglang-router, vllm-router) from a virtual environment of
their own, the models.yaml that names the upstreams, where results go, and the timer and
machine of the microbenchmarks."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import yaml

from serving.launch import ROOT, free_port, launch, shipped_spec

MODEL = "null"
"""What the upstreams serve."""


ASKED = "opt-125m"
"""What the load asks for: the model of our deployment's replicas; the upstreams ignore it and the
peers pass it through."""


def remote_config(
    folder: Path, urls: list[str], model: str = "opt-125m", served: str = MODEL,
    name: str = "bench-upstreams", each: Sequence[dict] = (), **settings: object,
) -> Path:  # fmt: skip
    """The shipped models.yaml plus a deployment `name`: the upstreams as replicas of one model
    (`model`, served as `served`; `each`: more keys for each one's placement entry), its other
    settings the `remote` deployment's, then `settings`."""
    spec = shipped_spec()
    spec["placements"][name] = [
        {"model": model, "url": url + "/v1", "served_name": served, **(each[i] if each else {})}
        for i, url in enumerate(urls)
    ]
    spec["deployments"][name] = {**spec["deployments"]["remote"], "placement": name, **settings}
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def start_upstreams(
    stack: ExitStack, folder: Path, paces: list[tuple[float, float]], max_num_seqs: int = 0
) -> list[str]:
    """Null upstreams, one per (first-token ms, token-gap ms), on CPU 1 where there is one;
    stopped when `stack` closes. Their URLs."""
    urls = []
    for i, (first_ms, gap_ms) in enumerate(paces):
        port = free_port()
        command = [sys.executable, "-m", "workloads.null_server", "--port", str(port),
                   "--h3-port", "0", "--model", MODEL, "--max-num-seqs", str(max_num_seqs),
                   "--first-token-ms", str(first_ms), "--token-gap-ms", str(gap_ms)]  # fmt: skip
        upstream = launch(f"null-{i}", command, port, "/health", folder / f"null-{i}.log",
                          cpus={1} if (os.cpu_count() or 1) > 1 else None)  # fmt: skip
        stack.enter_context(upstream.ready(60))
        urls.append(upstream.url)
    return urls


def start_vllm(
    stack: ExitStack, folder: Path, names: list[str],
    flags: Sequence[Sequence[str]] = (("--kv-cache-memory-bytes", str(256 * 2**20)),),
    env: dict[str, str] | None = None, model: str = "tiny-s",
) -> list[str]:  # fmt: skip
    """A real `vllm serve` of an embedded model (CPU build) per entry of `flags`, with those
    flags added, answering to `names`, on CPU 1 where there is one; stopped when `stack`
    closes. Their URLs."""
    subprocess.run([sys.executable, "-m", "serving.embedded"], cwd=ROOT, check=True)
    template = folder / "chat_template.jinja"
    template.write_text(yaml.safe_load((ROOT / "models.yaml").read_text())["chat_template"])
    urls = []
    for i, extra in enumerate(flags):
        port = free_port()
        # By its module: the CPU build's `vllm` command looks up a distribution named `vllm`
        # and dies.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(ROOT / ".models" / model), "--served-model-name", *names,
                   "--port", str(port), "--chat-template", str(template), "--enforce-eager",
                   "--max-model-len", "2048", *extra]  # fmt: skip
        upstream = launch(
            f"vllm-serve-{i}", command, port, "/health", folder / f"vllm-serve-{i}.log",
            {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})},
            cpus={1} if (os.cpu_count() or 1) > 1 else None,
        )  # fmt: skip
        stack.enter_context(upstream.ready(600))
        urls.append(upstream.url)
    return urls


def peer_command(name: str, venv: Path) -> list[str] | None:
    """How to start peer gateway `name` from `venv`; None, with a note, where it is not there."""
    binary = {
        "sglang-router": [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router"],
        "vllm-router": [str(venv / "bin" / "vllm-router")],
    }[name]
    if not Path(binary[0]).exists() or (
        name == "sglang-router"
        and subprocess.run([binary[0], "-c", "import sglang_router"], capture_output=True)
        .returncode != 0
    ):  # fmt: skip
        print(f"note: {name} is not in {venv}; --install-peers", file=sys.stderr)
        return None
    return binary


def install_peers(venv: Path) -> None:
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "sglang-router", "vllm-router"], check=True)


def add_peer_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """--peers-venv, --install-peers and --out (results/`out`)."""
    parser.add_argument("--peers-venv", type=Path, default=ROOT / ".peers-venv")
    parser.add_argument("--install-peers", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / out)


def report(out: Path, rows: list[dict], text: str) -> None:
    """Write a run's rows and table under `out`, and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(text + "\n")
    print(text)


def timer_overhead_s(samples: int = 200_000) -> float:
    """What one timed interval costs with nothing inside it (median of batches)."""
    pc = time.perf_counter
    per_batch = []
    for _ in range(20):
        acc = 0.0
        for _ in range(samples // 20):
            t0 = pc()
            acc += pc() - t0
        per_batch.append(acc / (samples // 20))
    return statistics.median(per_batch)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"{platform.platform()}, {cpu}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()} ({platform.python_implementation()})"
    )
