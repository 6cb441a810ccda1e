"""How fast can `workloads.replay` send before it falls behind? Against a server with no model.

`python -m workloads.null_server` answers every request with the same timed stream (the first
token after --first-token-ms, then one every --token-gap-ms), so nothing but the two processes
limits the rate. The replay runs at rising Poisson rates, over HTTP/1.1 and HTTP/3, and each run
reports the replay's p99 send lag, its CPU (share of one core) and the null server's; the
headroom of a protocol is the highest rate whose p99 send lag stays under 50 ms with every
request completed. Client and server share this machine's cores, as they would in a test rig
with one box, so the machine is stated beside the numbers.

    python -m benchmarks.replay_headroom --rates 50,100,200,400,800 --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path

from experiments.harness.live import cpu_seconds
from serving.launch import free_port, launch

ROOT = Path(__file__).resolve().parent.parent
MAX_P99_LAG_MS = 50.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default="50,100,200,400,800")
    p.add_argument("--seconds", type=float, default=10.0, help="arrivals per run")
    p.add_argument("--protocols", default="h1,h3")
    p.add_argument("--connections", type=int, default=4, help="h3 connections")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--first-token-ms", type=float, default=50.0)
    p.add_argument("--token-gap-ms", type=float, default=20.0)
    p.add_argument("--out", default="results/replay_headroom.json")
    args = p.parse_args()
    port, h3_port = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_DGRAM)
    work = ROOT / "results" / "replay_headroom"
    work.mkdir(parents=True, exist_ok=True)
    null = [sys.executable, "-m", "workloads.null_server", "--port", str(port),
            "--h3-port", str(h3_port), "--first-token-ms", str(args.first_token_ms),
            "--token-gap-ms", str(args.token_gap_ms)]  # fmt: skip
    runs = []
    with launch("null-server", null, port, "/v1/models", work / "null.log", h3_port=h3_port) as up:
        up.ready(30)
        for proto in args.protocols.split(","):
            for rate in (float(r) for r in args.rates.split(",")):
                runs.append(one_run(args, proto, rate, port, h3_port, up.pid, work))
    best: dict[str, float | None] = {}
    for proto in args.protocols.split(","):
        ok = [r["rate"] for r in runs if r["proto"] == proto and r["kept_up"]]
        best[proto] = max(ok, default=None)
    machine = f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs"
    print(f"\nmachine: {machine}; {args.output_tokens} tokens per request, first after "
          f"{args.first_token_ms:g} ms, then every {args.token_gap_ms:g} ms")  # fmt: skip
    print(f"{'proto':<6}{'req/s':>7}{'sent/s':>8}{'events/s':>10}{'p99 lag ms':>12}"
          f"{'client CPU':>12}{'server CPU':>12}{'errors':>8}")  # fmt: skip
    for r in runs:
        print(f"{r['proto']:<6}{r['rate']:>7g}{r['achieved_rate']:>8.0f}{r['events_per_s']:>10.0f}"
              f"{r['p99_lag_ms']:>12.1f}{r['client_cpu']:>12.0%}{r['server_cpu']:>12.0%}"
              f"{r['errored']:>8}")  # fmt: skip
    for proto, highest in best.items():
        print(f"headroom over {proto}: {highest:g} req/s" if highest else f"{proto}: none kept up")
    Path(args.out).write_text(
        json.dumps({"machine": machine, "args": vars(args), "runs": runs, "best": best}, indent=1)
    )
    return 0


def one_run(
    args: argparse.Namespace,
    proto: str,
    rate: float,
    port: int,
    h3_port: int,
    server_pid: int,
    work: Path,
) -> dict:
    out = work / f"{proto}_{rate:g}.json"
    url = f"http://127.0.0.1:{port}" if proto == "h1" else f"https://localhost:{h3_port}"
    extra = [] if proto == "h1" else ["--connections", str(args.connections), "--insecure"]
    server_cpu = cpu_seconds(server_pid)
    print(f"{proto} at {rate:g} req/s", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "workloads.replay", "--proto", proto, "--url", url,
         "--model", "null", "--rate", str(rate), "--duration", str(args.seconds),
         "--output-tokens", f"{args.output_tokens}:{args.output_tokens}", "--tasks", "copa",
         "--out", str(out), "--no-progress", "--timeout", "120", *extra],
        cwd=ROOT, check=False, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    server_cpu = cpu_seconds(server_pid) - server_cpu
    record = json.loads(out.read_text())
    summary, client = record["summary"], record["client"]
    duration = summary["duration_s"]
    return {
        "proto": proto,
        "rate": rate,
        "achieved_rate": summary["sent"] / args.seconds,
        "events_per_s": summary["total_output_tokens"] / duration,
        "p99_lag_ms": client["p99_lag_ms"],
        "client_cpu": client["cpu_share_of_core"],
        "server_cpu": server_cpu / duration,
        "errored": summary["errored"],
        "median_ttft_ms": summary["median_ttft_ms"],
        "kept_up": client["p99_lag_ms"] < MAX_P99_LAG_MS and summary["errored"] == 0,
    }


if __name__ == "__main__":
    raise SystemExit(main())
