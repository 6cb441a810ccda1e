"""What the dashboard costs: the feed's own CPU as a share of the server's, under load.

One server (`python -m serving`, by default the `paper-4gpu-sim` twin: twelve replicas, so the
largest snapshot the shipped deployments make, and engines in the server's own process, so its
CPU is all of the serving) takes `--rate` req/s from the project's load generator
(`python -m workloads.replay`, HTTP/1.1, Poisson) for `--duration` seconds, while one dashboard
client follows `/dashboard/events`. The feed counts the CPU its snapshots take
(`time.thread_time()` around building and encoding each one, `serving.pages.FeedCost`) and says
so in every snapshot; the server's CPU comes from /proc over the same interval. Both are read at
the start and the end of the load, so the share is one ratio measured side by side.

The feed also costs something per request, where the recorder (`serving.recent`) is told of
each decision and each outcome. That is too little to time call by call inside the server, so
it is timed here over many calls of the same code and multiplied by the requests the server saw.

Not counted: the transport's cost of sending the snapshots. It is one event a second against
the thousands of token events the server sends at this load; the ratio of the two is printed
as context.

    python -m benchmarks.dashboard_feed                 # 60 s at 20 req/s, about 1.5 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from experiments.harness.live import cpu_seconds, server
from serving.outcomes import CLIENTS_OWN, OK, SHED, RequestRecord
from serving.recent import Decision, Recent

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.05


class FeedClient(threading.Thread):
    """A dashboard that follows the feed for as long as the run lasts, counting snapshots."""

    def __init__(self, url: str, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.url = f"{url}/dashboard/events?interval={interval_s}"
        self.events = 0
        self.bytes = 0
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            with httpx.stream("GET", self.url, timeout=None) as feed:
                for line in feed.iter_lines():
                    if line.startswith("data: "):
                        self.events += 1
                        self.bytes += len(line)
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.error = repr(exc)


def state(url: str) -> dict[str, Any]:
    answer = httpx.get(url + "/dashboard/state", timeout=10)
    answer.raise_for_status()
    return answer.json()


def recorder_cost_per_request(replicas: int, calls: int = 200_000) -> float:
    """CPU seconds per request of what the gateway and metrics do for the recorder: a decision
    (with its sum over the replicas) and an outcome, as `Gateway._decided` and `Metrics.finish`
    do them, on a recorder of the size the server keeps."""
    recent = Recent(CLIENTS_OWN, SHED)
    fleet = [SimpleNamespace(running=i % 5, model="m", name=f"r{i}") for i in range(replicas)]
    record = RequestRecord("0123456789abcdef0123456789abcdef", "free-tier", time.monotonic())
    record.first_token, record.tokens, record.protocol = record.arrival + 0.05, 64, "1.1"
    started = time.thread_time()
    for i in range(calls):
        chosen = fleet[i % replicas]
        in_flight = sum(r.running for r in fleet)
        recent.routed(
            Decision(
                at=record.arrival,
                request_id=record.request_id or "",
                qos_class="free-tier",
                task="copa",
                asked="auto",
                model=chosen.model,
                replica=chosen.name,
                in_flight=in_flight,
                at_replica=chosen.running,
                rate=20.0,
            )
        )
        recent.finished(record, OK, True)
    return (time.thread_time() - started) / calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deployment", default="paper-4gpu-sim")
    p.add_argument("--rate", type=float, default=20.0, help="req/s, Poisson")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--interval", type=float, default=1.0, help="the feed's seconds per snapshot")
    p.add_argument("--out", default="results/dashboard_feed.json")
    args = p.parse_args()

    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".server.log")
    # No request log: its lines would add to the server's CPU and so flatter the share.
    quiet = ["--request-log", "off"]
    with server(args.deployment, None, log, ready_path="/readyz", extra=quiet) as live:
        feed = FeedClient(live.url, args.interval)
        feed.start()
        time.sleep(2 * args.interval)  # connected, and past its first snapshots
        before, cpu_before = state(live.url), cpu_seconds(live.pid)
        replay = [sys.executable, "-m", "workloads.replay", "--proto", "h1", "--url", live.url,
                  "--deployment", args.deployment, "--rate", str(args.rate),
                  "--duration", str(args.duration), "--out", str(out.with_suffix(".replay.json")),
                  "--no-progress"]  # fmt: skip
        load = subprocess.run(replay, cwd=ROOT, capture_output=True, text=True)
        after, cpu_after = state(live.url), cpu_seconds(live.pid)
        feed.stop.set()
    if load.returncode != 0:
        print(load.stdout, load.stderr, sep="\n")
        raise SystemExit(f"the load generator failed ({load.returncode})")
    if feed.error is not None:
        raise SystemExit(f"the dashboard client failed: {feed.error}")

    server_cpu = cpu_after - cpu_before
    feed_cpu = after["feed"]["cpu_s"] - before["feed"]["cpu_s"]
    snapshots = after["feed"]["snapshots"] - before["feed"]["snapshots"]
    summary = json.loads(out.with_suffix(".replay.json").read_text())["summary"]
    sent, tokens = int(summary["sent"]), int(summary["total_output_tokens"])
    per_request = recorder_cost_per_request(len(after["replicas"]))
    recorder_cpu = per_request * sent
    share = feed_cpu / server_cpu
    total = (feed_cpu + recorder_cpu) / server_cpu
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "deployment": args.deployment,
        "rate": args.rate,
        "duration_s": args.duration,
        "interval_s": args.interval,
        "requests": sent,
        "output_tokens": tokens,
        "server_cpu_s": round(server_cpu, 4),
        "feed_cpu_s": round(feed_cpu, 6),
        "snapshots": snapshots,
        "snapshot_cpu_ms": round(1000 * feed_cpu / max(snapshots, 1), 4),
        "snapshot_bytes": round(feed.bytes / max(feed.events, 1)),
        "recorder_us_per_request": round(1e6 * per_request, 3),
        "recorder_cpu_s": round(recorder_cpu, 6),
        "feed_share": round(share, 6),
        "feed_and_recorder_share": round(total, 6),
        "feed_events_per_token_event": round(snapshots / tokens, 6) if tokens else None,
        "target": TARGET,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"machine: {result['machine']}; deployment {args.deployment}, {len(after['replicas'])} "
          f"replicas; {sent} requests at {args.rate:g} req/s over {args.duration:g} s")  # fmt: skip
    print(f"server CPU over the run:        {server_cpu:8.3f} s")
    print(f"feed snapshots:                 {snapshots:8d} ({result['snapshot_cpu_ms']} ms and "
          f"{result['snapshot_bytes']} bytes each)")  # fmt: skip
    print(f"feed CPU (snapshots):           {feed_cpu:8.4f} s = {100 * share:.3f}% of the server's")
    print(f"recorder CPU ({result['recorder_us_per_request']} us/request): "
          f"{recorder_cpu:8.4f} s")  # fmt: skip
    print(f"feed + recorder:                {100 * total:.3f}% of the server's "
          f"(target under {100 * TARGET:g}%): {'met' if total < TARGET else 'MISSED'}")  # fmt: skip
    if tokens:
        print(f"context: {snapshots} feed events against {tokens} token events sent")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
