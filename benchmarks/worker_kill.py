"""`python -m benchmarks.worker_kill`: SIGKILL one front-end worker under load, and count what
it costs.

`python -m serving --deployment paper-4gpu-sim --workers 2` (the twin at its own speed, engines
in the engine host) takes an open-loop Poisson load from `workloads.replay` (`--rate` req/s for
`--duration` s, HTTP/1.1 by default, a connection per request so that requests spread over the
workers), and `--kill-at` seconds in, worker 0 is SIGKILLed. Reported against the
targets for several workers:
- the requests that failed at the client, and on which worker the server had them: none on the
  other worker, each failure one the client saw;
- the time from the kill until the supervisor's restarted worker runs (target: under 5 s);
- the engine host's pid before and after (untouched);
- what the client sent against what the server logged: every request either in the request
  log, or lost with the killed worker (a client-side failure with no log line); and against
  what /metrics counted, where those lost are `worker_died`.

    python -m benchmarks.worker_kill                      # 48 req/s, 60 s, kill at 20 s
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from experiments.harness.live import requests_total
from serving.launch import ROOT, free_port, launch


def worker_pid(log: Path, worker: int) -> int | None:
    """The pid of the worker's last start, as the supervisor logged it."""
    started = re.findall(rf"worker {worker} started \(pid (\d+)\)", log.read_text(errors="replace"))
    return int(started[-1]) if started else None


def engine_host(pid: int) -> int | None:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    hosts = [int(p) for p in children
             if b"serving.engine_host" in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
    return hosts[0] if hosts else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.worker_kill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--deployment", default="paper-4gpu-sim")
    parser.add_argument("--rate", type=float, default=48.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--kill-at", type=float, default=20.0)
    parser.add_argument("--proto", choices=("h1", "h3"), default="h1")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "worker_kill")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    requests_log = args.out / "requests.jsonl"
    requests_log.unlink(missing_ok=True)
    port, h3_port = free_port(), free_port(socket.SOCK_DGRAM)
    command = [
        sys.executable,
        "-m",
        "serving",
        "--deployment",
        args.deployment,
        "--workers",
        "2",
        "--port",
        str(port),
        "--h3-port",
        str(h3_port),
        "--request-log",
        str(requests_log),
    ]
    server_log = args.out / "server.log"
    with launch("server", command, port, "/readyz", server_log, h3_port=h3_port) as server:
        server.ready(300)
        host_before = engine_host(server.pid)
        url = f"http://127.0.0.1:{port}" if args.proto == "h1" else f"https://localhost:{h3_port}"
        load = [
            sys.executable,
            "-m",
            "workloads.replay",
            "--proto",
            args.proto,
            "--url",
            url,
            "--cacert",
            str(ROOT / ".certs" / "cert.pem"),
            "--rate",
            str(args.rate),
            "--duration",
            str(args.duration),
            "--seed",
            str(args.seed),
            "--deployment",
            args.deployment,
            "--out",
            str(args.out / "replay.json"),
            "--no-progress",
            "--timeout",
            "60",
        ]
        if args.proto == "h1":
            load.append("--connection-per-request")
        else:
            load += ["--connections", "8"]
        client = subprocess.Popen(load, cwd=ROOT, stdout=subprocess.DEVNULL)
        time.sleep(args.kill_at)
        victim = worker_pid(server_log, 0)
        assert victim is not None, "no worker 0 in the server's log"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        restart_s = None
        while time.monotonic() - killed_at < 30:
            if worker_pid(server_log, 0) not in (victim, None):
                restart_s = time.monotonic() - killed_at
                break
            time.sleep(0.02)
        client.wait()
        host_after = engine_host(server.pid)
        counted = dict(requests_total(f"http://127.0.0.1:{port}"))
    replay = json.loads((args.out / "replay.json").read_text())
    lines = map(json.loads, requests_log.read_text().splitlines())
    logged = {line["request_id"]: line for line in lines}

    def where(request: dict) -> str:
        line = logged.get(request["server_request_id"] or "")
        if line is None:
            return "not logged (lost with the killed worker)"
        return f"worker {line['worker']}: {line['outcome']}"

    failed = [r for r in replay["requests"] if r["error_kind"] is not None]
    failed_where = Counter(where(r) for r in failed)
    sent = len(replay["requests"])
    client_ok = sum(1 for r in replay["requests"] if r["error_kind"] is None)
    server_ok = sum(1 for line in logged.values() if line["outcome"] == "ok")
    report = {
        "sent": sent,
        "client_ok": client_ok,
        "client_failed": len(failed),
        "failed_where": dict(failed_where),
        "server_logged": len(logged),
        "server_ok": server_ok,
        # /metrics, whichever worker answered: every outcome counted, worker_died included.
        "metrics_outcomes": counted,
        "metrics_total": sum(counted.values()),
        "restart_s": restart_s,
        "engine_host_before": host_before,
        "engine_host_after": host_after,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "worker_kill.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
