"""HTTP/3 against HTTP/1.1 from the same server, on the digital twin, side by side in one run.

The server is `python -m serving --deployment paper-4gpu-sim` (twelve simulated replicas on the
seed-calibrated profile), engines `--time-scale` times the profile's step time: 0.25 is a GPU four
times faster than those of Chuppala (2024). Open-loop Poisson load from `workloads.replay` at each
rate:

- over HTTP/1.1 (`--proto h1`, aiohttp's pool, as `vllm bench serve`);
- over HTTP/3 with each of `--connections` QUIC connections (8 and 64 by default).

Each row reports the SLO attainment, mean reward, output tokens/s, the server's cores (from
/proc over the arrivals' window) and its CPU per output token (that CPU over the tokens the run's
mean output rate puts in the window: exact when the server keeps up; where it falls behind, the
rate is averaged over the drain too, and the server is at a full core throughout), the
requests that waited in the client for stream credit, and the load generators' p99 send lag and
core share. A row whose load
generators could not keep up (`workloads.replay`'s own warnings) is marked: the generator set its
pace, not the server. `--clients N` splits each row's load over N generator processes on one
clock (`--start-at`), each with its own seed.

With `--cpus`, the server is pinned to the first CPU given and the generators to the rest.

    python -m benchmarks.http3_vs_http1            # at 0.25: 96 and 192 req/s, h1, h3 x8, h3 x64
    python -m benchmarks.http3_vs_http1 --time-scale 1 --rates 48 --connections 8

This replaced a closed-loop comparison on an in-process trivial app; the transport's own cost
without an app is `benchmarks.frontend_capacity`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.harness.live import ROOT, LiveServer, cpu_seconds, server
from workloads.summary import Outcome, summarize

DEPLOYMENT = "paper-4gpu-sim"
CONNECT_S = 5.0
"""Seconds between launching the generators and their shared arrival 0: time to import,
build the workload and connect (the QUIC handshakes of 64 connections included)."""


@dataclass(frozen=True)
class Row:
    rate: float
    proto: str
    connections: int

    @property
    def label(self) -> str:
        return "HTTP/1.1" if self.proto == "h1" else f"HTTP/3 x{self.connections}"


def generator_command(
    live: LiveServer, row: Row, rate: float, seed: int, start_at: float, duration: float, out: Path
) -> list[str]:
    if row.proto == "h1":
        target = ["--proto", "h1", "--url", live.url]
    else:
        target = ["--proto", "h3", "--url", f"https://127.0.0.1:{live.h3_port}",
                  "--cacert", str(ROOT / ".certs" / "cert.pem"),
                  "--connections", str(row.connections)]  # fmt: skip
    flags = {"--deployment": DEPLOYMENT, "--arrivals": "poisson", "--rate": f"{rate:g}",
             "--duration": f"{duration:g}", "--seed": str(seed),
             "--start-at": f"{start_at:.3f}", "--out": str(out)}  # fmt: skip
    options = [part for flag, value in flags.items() for part in (flag, value)]
    return [sys.executable, "-m", "workloads.replay", *target, *options, "--no-progress"]


def run_row(live: LiveServer, row: Row, args: argparse.Namespace, folder: Path) -> dict:
    """One rate over one protocol: the generators' requests merged into one summary, and the
    server's CPU over the load window."""
    start_at = time.time() + CONNECT_S
    outs = [
        folder / f"{row.proto}{row.connections}-r{row.rate:g}-c{i}.json"
        for i in range(args.clients)
    ]
    client_cpus = args.cpus[1:] if args.cpus else None
    processes = [
        subprocess.Popen(
            generator_command(
                live,
                row,
                row.rate / args.clients,
                args.seed + 1000 * i,
                start_at,
                args.duration,
                out,
            ),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, client_cpus)) if client_cpus else None,
        )
        for i, out in enumerate(outs)
    ]
    time.sleep(max(0.0, start_at - time.time()))
    cpu0, wall0 = cpu_seconds(live.pid), time.monotonic()
    # The server's CPU over the arrivals' window only: after it, the last answers drain.
    time.sleep(args.duration)
    server_cpu, window = cpu_seconds(live.pid) - cpu0, time.monotonic() - wall0
    for process, out in zip(processes, outs, strict=True):
        _, stderr = process.communicate()
        if not out.exists():
            raise RuntimeError(f"replay failed ({process.returncode}):\n{stderr[-2000:]}")
    records = [json.loads(out.read_text()) for out in outs]
    outcomes = [Outcome(**r) for record in records for r in record["requests"]]
    duration = max(record["summary"]["duration_s"] for record in records)
    summary = summarize(outcomes, duration)
    clients = [record["client"] for record in records]
    tokens_in_window = summary["output_throughput"] * window
    return {
        "rate": row.rate,
        "protocol": row.label,
        "sent": summary["sent"],
        "errored": summary["errored"],
        "slo_attainment": summary["slo_attainment"],
        "mean_reward": summary["mean_reward"],
        "output_tok_s": summary["output_throughput"],
        "median_ttft_ms": summary["median_ttft_ms"],
        "server_cores": server_cpu / window,
        "server_us_per_token": server_cpu / tokens_in_window * 1e6 if tokens_in_window else None,
        "credit_waited": sum(c["credit_waited"] for c in clients),
        "client_p99_lag_ms": max(c["p99_lag_ms"] for c in clients),
        "client_core_share": max(c["cpu_share_of_core"] for c in clients),
        "client_bound": any(c["warnings"] for c in clients),
        "client_warnings": [w for c in clients for w in c["warnings"]],
    }


def format_rows(rows: list[dict], title: str) -> str:
    lines = [
        f"## {title}",
        "",
        "| rate | protocol | SLO | reward | output tok/s | median TTFT | server cores | "
        "server µs/token | waited for credit | client p99 lag | client core |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = " (client-bound)" if r["client_bound"] else ""
        us = "-" if r["server_us_per_token"] is None else f"{r['server_us_per_token']:.0f}"
        ttft = "-" if r["median_ttft_ms"] is None else f"{r['median_ttft_ms']:.0f} ms"
        lines.append(
            f"| {r['rate']:g} req/s | {r['protocol']}{mark} | {r['slo_attainment']:.1%} | "
            f"{r['mean_reward']:.3f} | {r['output_tok_s']:,.0f} | {ttft} | "
            f"{r['server_cores']:.2f} | {us} | {r['credit_waited']} | "
            f"{r['client_p99_lag_ms']:.1f} ms | {r['client_core_share']:.0%} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.http3_vs_http1",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--time-scale", type=float, default=0.25, help="the twin's step-time factor")
    p.add_argument("--rates", default="96,192", help="req/s, comma-separated")
    p.add_argument("--connections", default="8,64", help="HTTP/3 rows: QUIC connections each")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per row")
    p.add_argument("--clients", type=int, default=1, help="load-generator processes per row")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument(
        "--flush-ms", type=float, help="the server's --flush-ms (default: the server's own)"
    )
    p.add_argument(
        "--cpus",
        type=lambda s: [int(c) for c in s.split(",")],
        default=None,
        help="e.g. 0,1: the server on the first, generators on the rest",
    )
    p.add_argument("--out", type=Path, default=ROOT / "results" / "http3_vs_http1")
    args = p.parse_args(argv)
    if args.clients < 1:
        p.error("--clients must be at least 1")
    if args.cpus is not None and len(args.cpus) < 2:
        p.error("--cpus needs one CPU for the server and at least one for the generators")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    layouts = [("h1", 1)] + [("h3", int(c)) for c in args.connections.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    extra = ["--time-scale", f"{args.time_scale:g}"]
    if args.flush_ms is not None:
        extra += ["--flush-ms", f"{args.flush_ms:g}"]
    rows: list[dict] = []
    with server(
        DEPLOYMENT,
        None,
        args.out / "server.log",
        extra=extra,
        cpus=set(args.cpus[:1]) if args.cpus else None,
    ) as live:
        for rate in rates:
            for proto, connections in layouts:
                row = run_row(live, Row(rate, proto, connections), args, args.out)
                rows.append(row)
                print(format_rows([row], "").splitlines()[-1], flush=True)
    flush = "" if args.flush_ms is None else f", server --flush-ms {args.flush_ms:g}"
    title = (
        f"{DEPLOYMENT} at --time-scale {args.time_scale:g}, {args.duration:g} s per row, "
        f"{args.clients} generator process(es) per row{flush}"
    )
    table = format_rows(rows, title)
    print("\n" + table)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}"
    (args.out / "table.md").write_text(f"{table}\n\nMachine: {machine}\n")
    (args.out / "rows.json").write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine, "rows": rows},
            indent=1,
        )
    )
    print(f"wrote {args.out / 'table.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
