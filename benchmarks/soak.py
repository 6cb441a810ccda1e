"""Soak: does anything grow that should not?

    python -m benchmarks.soak streams [--streams 100000] [--scheduler ml]
    python -m benchmarks.soak server --rate R [--minutes 30]

`streams`: that many real-time streams, one after another in batches, through one QUIC connection
whose server side schedules with `--scheduler`, over the virtual-time link (`netsim.simlink`),
so it measures memory, not the machine's speed. tracemalloc measures what our own modules hold
(`transport/schedulers.py`, `transport/connection.py`) after a warm-up and at the end: growth
must stay under 1 MB. What aioquic itself keeps per stream is reported apart.

`server`: `python -m serving` under Poisson load at `--rate` (70% of the capacity that
`benchmarks.overload` finds) for `--minutes`, reporting the front-end's RSS and open file
descriptors and the engines' RSS at the start and at the end, every request's outcome, and
whether the server counted each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import tracemalloc
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from experiments.harness.live import LiveServer

ROOT = Path(__file__).resolve().parent.parent
OURS = ("transport/schedulers.py", "transport/connection.py")
REALTIME_DEADLINE_S = 1.0
RESPONSE_BYTES = 512


def soak_streams(args: Namespace) -> dict:
    from aioquic.quic.configuration import QuicConfiguration
    from aioquic.quic.connection import QuicConnection
    from aioquic.quic.events import QuicEvent, StreamDataReceived

    from netsim.link import LinkConfig
    from netsim.simlink import SimulatedPath
    from transport.connection import ScheduledQuicConnection
    from transport.schedulers import StreamSpec
    from transport.tls import ensure_certificate

    cert = ensure_certificate(Path(tempfile.mkdtemp()), deterministic=True)
    client_config = QuicConfiguration(is_client=True, alpn_protocols=["soak"])
    client_config.verify_mode = 0
    client = ScheduledQuicConnection(configuration=client_config, scheduler="fcfs")
    server_config = QuicConfiguration(is_client=False, alpn_protocols=["soak"])
    server_config.load_cert_chain(*map(str, cert))
    server = ScheduledQuicConnection(
        configuration=server_config,
        original_destination_connection_id=client.original_destination_connection_id,
        scheduler=args.scheduler,
    )
    open_streams: set[int] = set()

    def on_event(connection: QuicConnection, event: QuicEvent, now: float) -> None:
        if not isinstance(event, StreamDataReceived) or not event.end_stream:
            return
        if connection is server:  # a request: answer it as the real-time class
            spec = StreamSpec(priority=0, deadline=now + REALTIME_DEADLINE_S, high=True, soft=True)
            server.set_stream_spec(event.stream_id, spec)
            server.send_stream_data(event.stream_id, b"x" * RESPONSE_BYTES, end_stream=True)
        else:
            open_streams.discard(event.stream_id)

    path = SimulatedPath(client, server, LinkConfig(rate_bps=1e9, delay_s=0.001), on_event)
    path.run(until=lambda: client._handshake_complete)

    def batch(n: int) -> None:
        for _ in range(n):
            stream_id = client.get_next_available_stream_id()
            open_streams.add(stream_id)
            client.send_stream_data(stream_id, b"request", end_stream=True)
        path.run(until=lambda: not open_streams, timeout=path.now + 600)

    def held() -> dict[str, int]:
        snapshot = tracemalloc.take_snapshot()
        sizes = {"ours": 0, "aioquic": 0}
        for stat in snapshot.statistics("filename"):
            name = stat.traceback[0].filename
            if name.endswith(OURS):
                sizes["ours"] += stat.size
            elif "/aioquic/" in name:
                sizes["aioquic"] += stat.size
        return sizes

    tracemalloc.start()
    warmup = min(1_000, args.streams)
    batch_size = 100  # under the server's default stream limit, so no stream waits for credit
    batch(warmup)
    before = held()
    done = warmup
    with tqdm(total=args.streams, initial=warmup, unit="stream") as bar:
        while done < args.streams:
            n = min(batch_size, args.streams - done)
            batch(n)
            done += n
            bar.update(n)
    after = held()
    tracemalloc.stop()
    return {
        "streams": done,
        "scheduler": args.scheduler,
        "virtual_s": round(path.now, 3),
        "ours_growth_bytes": after["ours"] - before["ours"],
        "ours_bytes_end": after["ours"],
        "aioquic_growth_bytes": after["aioquic"] - before["aioquic"],
        "aioquic_bytes_end": after["aioquic"],
        "aioquic_streams_held": len(server._streams),
        "target": "ours_growth_bytes < 1,000,000",
        "met": after["ours"] - before["ours"] < 1_000_000,
    }


def soak_server(args: Namespace) -> dict:
    from config import DEFAULT_PATH, load_deployment
    from experiments.harness.live import requests_total, server
    from workloads.arrivals import Poisson
    from workloads.generate import TaskShape, WorkloadSpec, requests
    from workloads.replay import Client, replay
    from workloads.summary import summarize

    deployment = load_deployment(DEFAULT_PATH, args.deployment)
    spec = WorkloadSpec(Poisson(args.rate), default_shape=TaskShape(None, (32, 128)))
    work = list(requests(spec, args.seed, duration=args.minutes * 60))
    log = ROOT / "results" / "soak" / "server.log"
    with server(args.deployment, None, log, extra=["--request-log", "off"]) as live:
        client = Client(
            Namespace(proto="h1", url=live.url, connections=1, cacert=None, insecure=False,
                      model="auto", ignore_eos=True, api_key=None, h2_streams=100,
                      connection_per_request=False, deployment=deployment.name),
            deployment,
        )  # fmt: skip
        counted = sum(requests_total(live.url).values())
        start = resources(live)
        done, duration, _ = asyncio.run(replay(work, client, deployment, timeout=120.0))
        time.sleep(2)
        end = resources(live)
        counted = sum(requests_total(live.url).values()) - counted
    summary = summarize(done, duration)
    return {
        "rate": args.rate,
        "minutes": args.minutes,
        "sent": len(done),
        "server_counted": counted,
        "errors": summary["errors"],
        "slo_attainment": summary["slo_attainment"],
        "start": start,
        "end": end,
    }


def resources(live: LiveServer) -> dict[str, float]:
    """The front-end's RSS and open descriptors (its own /metrics), and its children's RSS."""
    from experiments.harness.live import metric

    return {
        "frontend_rss_mib": round(metric(live.url, "process_resident_memory_bytes") / 2**20, 1),
        "frontend_open_fds": metric(live.url, "process_open_fds"),
        "engines_rss_mib": round(sum(_rss(p) for p in _descendants(live.pid)) / 2**20, 1),
        "time": time.time(),
    }


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                children = Path(f"/proc/{parent}/task/{task}/children").read_text().split()
                found += map(int, children)
                todo += map(int, children)
        except FileNotFoundError:
            continue
    return found


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("streams")
    s.add_argument("--streams", type=int, default=100_000)
    s.add_argument("--scheduler", default="ml")
    v = sub.add_parser("server")
    v.add_argument("--rate", type=float, required=True, help="req/s: 70%% of capacity")
    v.add_argument("--minutes", type=float, default=30.0)
    v.add_argument("--deployment", default=None)
    v.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    result = soak_streams(args) if args.what == "streams" else soak_server(args)
    out = ROOT / "results" / "soak" / f"{args.what}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if result.get("met", True) else 1


if __name__ == "__main__":
    sys.exit(main())
