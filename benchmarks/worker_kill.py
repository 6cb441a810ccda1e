"""`python -m benchmarks.worker_kill`: SIGKILL one front-end worker under load, and count what
it costs.

`python -m serving --deployment paper-4gpu-sim --workers 2` (the twin at its own speed, engines
in the engine host) takes an open-loop Poisson load from `workloads.replay` (`--rate` req/s for
`--duration` s, HTTP/1.1 by default, a connection per request so that requests spread over the
workers), and `--kill-at` seconds in, a worker is SIGKILLed: over HTTP/3 the one holding the
most of the client's connections (the kernel spreads them by their ports, so worker 0 may hold
none), over HTTP/1.1 worker 0. Reported against the
targets for several workers:
- the requests that failed at the client, and on which worker the server had them: none on the
  other worker, each failure one the client saw;
- the time from the kill until the supervisor's restarted worker runs (target: under 5 s);
- the engine host's pid before and after (untouched);
- what the client sent against what the server logged: every request either in the request
  log, or lost with the killed worker (a client-side failure with no log line); and against
  what /metrics counted, where those lost are `worker_died`.

Over HTTP/3 (`--proto h3`, 8 QUIC connections) it also follows each client connection the
kill cut (`affected`): when the client learnt of it, by the stateless reset of the supervisor
standing in for the worker or of the restarted worker (`reset_s`, from the kill), and when that
connection's slot was served again, the first token of its next successful request
(`next_served_s`, from the kill). The failed requests are split into those sent before the kill
and those sent after it, before their client learnt (`lost_sent_*`: a refusal such as a 429 is
an answer, not a loss). `wall_s` is the whole run, server start
included.

    python -m benchmarks.worker_kill                      # 48 req/s, 60 s, kill at 20 s
    python -m benchmarks.worker_kill --proto h3 --duration 30 --kill-at 10
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

import numpy as np

from experiments.harness.live import requests_total
from serving.launch import ROOT, free_port, launch


def worker_pid(log: Path, worker: int) -> int | None:
    """The pid of the worker's last start, as the supervisor logged it."""
    started = re.findall(rf"worker {worker} started \(pid (\d+)\)", log.read_text(errors="replace"))
    return int(started[-1]) if started else None


LOST = ("connection", "stream")
"""The replay's error kinds of a request its connection or stream lost; the others (a 429 of
admission control, a timeout) are not the kill's doing."""


def worker_ready(log: Path, worker: int, pid: int) -> bool:
    return f"worker {worker} ready (pid {pid})" in log.read_text(errors="replace")


def busiest_worker(log: Path) -> int:
    """The worker that made the most QUIC connections so far, by aioquic's log line for each;
    0 if none."""
    line = r"\[worker (\d+)\] quic: \[\w+\] Negotiated protocol"
    made = Counter(re.findall(line, log.read_text(errors="replace")))
    return int(made.most_common(1)[0][0]) if made else 0


def stand_in(log: Path, worker: int) -> dict[str, int] | None:
    """What the supervisor answered on the worker's socket while it was down."""
    said = re.findall(
        rf"stood in for worker {worker} while it was down: (\d+) resets, (\d+) connections "
        r"refused, (\d+) answers held back",
        log.read_text(errors="replace"),
    )
    if not said:
        return None
    resets, refused, held = (int(n) for n in said[-1])
    return {"resets": resets, "refused": refused, "held_back": held}


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
    began = time.monotonic()
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
        index = busiest_worker(server_log) if args.proto == "h3" else 0
        victim = worker_pid(server_log, index)
        assert victim is not None, f"no worker {index} in the server's log"
        killed_at, killed_wall = time.monotonic(), time.time()
        os.kill(victim, signal.SIGKILL)
        restart_s = ready_s = None
        while time.monotonic() - killed_at < 30 and ready_s is None:
            successor = worker_pid(server_log, index)
            if restart_s is None and successor not in (victim, None):
                restart_s = time.monotonic() - killed_at
            if successor not in (victim, None) and worker_ready(server_log, index, successor):
                ready_s = time.monotonic() - killed_at
            time.sleep(0.02)
        client.wait()
        wall_s = time.monotonic() - began
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
    lost = [r for r in failed if r["error_kind"] in LOST]
    failed_where = Counter(where(r) for r in failed)
    kill_s = killed_wall - replay["run_started"]  # on the replay's clock
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
        "ready_s": ready_s,
        "killed_worker": index,
        "kill_s": kill_s,
        "stand_in": stand_in(server_log, index),
        # Of those lost (a broken connection or stream; a refusal such as a 429 is an answer).
        "lost_sent_before_kill": sum(r["arrival_s"] + r["lag_s"] <= kill_s for r in lost),
        "lost_sent_after_kill": sum(r["arrival_s"] + r["lag_s"] > kill_s for r in lost),
        **(cut_connections(replay["requests"], kill_s) if args.proto == "h3" else {}),
        "wall_s": wall_s,
        "engine_host_before": host_before,
        "engine_host_after": host_after,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "worker_kill.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


def cut_connections(requests: list[dict], kill_s: float) -> dict:
    """Per client connection that failed requests (`slot.generation`): when its client learnt
    (its failures' end, all at once on a reset), and when its slot next served a first token."""
    affected: dict[str, list[dict]] = {}
    for r in requests:
        if r["error_kind"] in LOST and r["connection"]:
            affected.setdefault(r["connection"], []).append(r)
    cut = {}
    for name, lost in sorted(affected.items()):
        slot, generation = (int(part) for part in name.split("."))
        served = [
            r["arrival_s"] + r["lag_s"] + r["credit_wait_s"] + r["ttft_s"] - kill_s
            for r in requests
            if r["error_kind"] is None
            and r["connection"]
            and int(r["connection"].split(".")[0]) == slot
            and int(r["connection"].split(".")[1]) > generation
        ]
        cut[name] = {
            "failed": len(lost),
            "reset_s": max(r["end_s"] for r in lost) - kill_s,
            "next_served_s": min(served, default=None),
            "errors": sorted({r["error"] for r in lost}),
        }
    served_again = [c["next_served_s"] for c in cut.values()]
    known = [s for s in served_again if s is not None]
    return {
        "affected": cut,
        "affected_never_served_again": len(served_again) - len(known),
        "next_served_p99_s": float(np.percentile(known, 99)) if known else None,
        "next_served_max_s": max(known, default=None),
        "reset_max_s": max((c["reset_s"] for c in cut.values()), default=None),
    }


if __name__ == "__main__":
    raise SystemExit(main())
