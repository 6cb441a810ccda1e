"""Overload: find the server's capacity, then send it ten times that, with and without shedding.

1. Capacity: Poisson free-tier load at rising rates (`--rates`, `--step-s` each) against the
   server as shipped (admission control on); the capacity is the highest rate at which the free
   tier's SLO attainment stays at or above 90%, and the goodput there (requests that met the SLO,
   per second) is the yardstick.
2. Overload: `--factor` times that rate for `--overload-s`, a `--realtime-share` of it real-time
   requests, every request carrying the premium key (so real-time is granted; the others ask for
   free-tier with x-qos-class). The same workload, same seed, then goes to the same server
   restarted with `--admission none`, so the two runs are side by side.

For each run it prints: goodput and its ratio to the goodput at capacity (target >= 0.8 with
shedding), real-time SLO attainment (target >= 0.95), the client's time to a shed answer (p99
target < 50 ms), every way requests ended at the client, and whether the server's outcome
counters rose by exactly the number sent. Client and server share the machine: the engines run
on every core but the last (serving's pinning), the front-end and this client float; the table
gives the share of a core each of them used.

    python -m benchmarks.overload                    # embedded deployment, about 10 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import sys
import time
from argparse import Namespace
from dataclasses import asdict
from pathlib import Path

import numpy as np

from config import DEFAULT_PATH, Deployment, load_deployment
from experiments.harness.live import LiveServer, metric, requests_total, server
from workloads.arrivals import Poisson
from workloads.generate import TaskShape, WorkloadSpec, requests
from workloads.replay import Client, client_health, replay
from workloads.request import Request
from workloads.summary import Outcome, summarize

ROOT = Path(__file__).resolve().parent.parent
PREMIUM_KEY = "overload-bench-premium"
CAPACITY_ATTAINMENT = 0.90


def parse() -> Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_PATH))
    p.add_argument("--deployment", default=None, help="default: models.yaml's default")
    p.add_argument("--rates", default="8,16,24,32,48,64,96", help="capacity sweep, req/s")
    p.add_argument("--step-s", type=float, default=30.0, help="seconds per sweep rate")
    p.add_argument("--factor", type=float, default=10.0, help="overload = factor x capacity")
    p.add_argument("--overload-s", type=float, default=60.0)
    p.add_argument("--realtime-share", type=float, default=0.05)
    p.add_argument("--output-tokens", default="32:128", help="LO:HI per request")
    p.add_argument("--proto", choices=["h1", "h3"], default="h1")
    p.add_argument("--connections", type=int, default=4, help="h3: QUIC connections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "overload")
    return p.parse_args()


def workload(
    rate: float, seconds: float, realtime: float, tokens: tuple[int, int], seed: int
) -> list[Request]:
    classes = {"free-tier": 1.0 - realtime, **({"real-time": realtime} if realtime else {})}
    spec = WorkloadSpec(Poisson(rate), classes=classes, default_shape=TaskShape(None, tokens))
    return list(requests(spec, seed, duration=seconds))


def load(live: LiveServer, batch: list, deployment: Deployment, args: Namespace) -> dict:
    """One open-loop run; its summary, the client's health and the server's side of it."""
    client_args = Namespace(
        proto=args.proto,
        url=live.url if args.proto == "h1" else f"https://localhost:{live.h3_port}",
        connections=args.connections,
        cacert=str(ROOT / ".certs" / "cert.pem"),
        insecure=False,
        model="auto",
        ignore_eos=True,
        api_key=PREMIUM_KEY,
        # What the rest of Client reads, as workloads.replay's flags default them.
        h2_streams=100,
        connection_per_request=False,
        scheduler="rr",
        congestion_control="reno",
        deployment=deployment.name,
    )
    before, cpu_before = requests_total(live.url), metric(live.url, "process_cpu_seconds_total")
    done, duration, client_cpu = asyncio.run(
        replay(batch, Client(client_args, deployment), deployment, timeout=120.0, progress=False)
    )
    settle(live.url)
    after, cpu_after = requests_total(live.url), metric(live.url, "process_cpu_seconds_total")
    counted = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    return {
        "outcomes": done,
        "summary": summarize(done, duration),
        "client": client_health(done, duration, client_cpu),
        "server_counted": counted,
        "server_cpu_share": (cpu_after - cpu_before) / duration,
    }


def settle(url: str, timeout_s: float = 120.0) -> None:
    """Wait until the server has nothing in flight, so that its counters are final."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metric(url, "serving_replica_in_flight") == 0:
            return
        time.sleep(0.5)


def attainment(run: dict, cls: str) -> float:
    group = run["summary"]["per_class"].get(cls)
    return group["slo_attainment"] if group else 0.0


def goodput(done: list[Outcome], duration_s: float) -> float:
    return sum(o.slo_met for o in done) / duration_s


def shed_latencies_ms(done: list[Outcome]) -> list[float]:
    """The client's time to each shed answer: a 429 whose error says it was overloaded."""
    return [
        o.e2el_s * 1000
        for o in done
        if o.status == 429 and o.e2el_s is not None and "overloaded" in (o.error or "")
    ]


def row(name: str, run: dict, seconds: float, yardstick: float) -> dict:
    done = run["outcomes"]
    shed = shed_latencies_ms(done)
    kinds: dict[str, int] = {}
    for o in done:
        key = "ok" if o.completed else o.error_kind or "?"
        kinds[key] = kinds.get(key, 0) + 1
    sent = len(done)
    good = goodput(done, seconds)
    return {
        "run": name,
        "sent": sent,
        "ended": json.dumps(kinds, sort_keys=True),
        "server_counted": sum(run["server_counted"].values()),
        "connection_errors": sum(v for k, v in kinds.items() if not k.startswith(("ok", "http_"))),
        "goodput_rps": round(good, 2),
        "goodput_vs_capacity": round(good / yardstick, 3) if yardstick else None,
        "realtime_slo": round(attainment(run, "real-time"), 3),
        "free_tier_slo": round(attainment(run, "free-tier"), 3),
        "shed_p50_ms": round(float(np.percentile(shed, 50)), 1) if shed else None,
        "shed_p99_ms": round(float(np.percentile(shed, 99)), 1) if shed else None,
        "median_ttft_ms": run["summary"]["median_ttft_ms"],
        "client_cpu": round(run["client"]["cpu_share_of_core"], 2),
        "server_cpu": round(run["server_cpu_share"], 2),
        "client_p99_lag_ms": round(run["client"]["p99_lag_ms"], 1),
    }


def main() -> int:
    args = parse()
    args.out.mkdir(parents=True, exist_ok=True)
    deployment = load_deployment(args.config, args.deployment)
    lo, _, hi = args.output_tokens.partition(":")
    tokens = (int(lo), int(hi or lo))
    env = {"QOS_PREMIUM_KEY": PREMIUM_KEY}
    extra = ["--config", args.config, "--request-log", "off"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; deployment {deployment.name}")

    sweep: list[dict] = []
    with server(args.deployment, None, args.out / "server-shed.log", extra=extra, env=env) as live:
        capacity, yardstick = 0.0, 0.0
        for rate in (float(r) for r in args.rates.split(",")):
            run = load(live, workload(rate, args.step_s, 0.0, tokens, args.seed), deployment, args)
            met = attainment(run, "free-tier")
            good = goodput(run["outcomes"], args.step_s)
            summary = run["summary"]
            sweep.append(
                {"rate": rate, "free_tier_slo": met, "goodput_rps": good,
                 "errors": summary["errors"], "median_ttft_ms": summary["median_ttft_ms"]}
            )  # fmt: skip
            print(f"{rate:g} req/s: free-tier SLO {met:.1%}, goodput {good:.2f} req/s")
            if met < CAPACITY_ATTAINMENT:
                break
            capacity, yardstick = rate, good
        if capacity == 0:
            print("no rate met 90%: lower --rates", file=sys.stderr)
            return 1
        rate = args.factor * capacity
        print(f"capacity {capacity:g} req/s (goodput {yardstick:.2f}); overload at {rate:g} req/s")
        batch = workload(rate, args.overload_s, args.realtime_share, tokens, args.seed + 1)
        runs = {"shedding": load(live, batch, deployment, args)}
    unshed = [*extra, "--admission", "none"]
    with server(
        args.deployment, None, args.out / "server-noshed.log", extra=unshed, env=env
    ) as live:
        runs["no shedding"] = load(live, batch, deployment, args)

    rows = [row(name, run, args.overload_s, yardstick) for name, run in runs.items()]
    write(args.out, sweep, rows, runs, capacity, yardstick)
    print(f"\ncapacity {capacity:g} req/s, goodput there {yardstick:.2f} req/s; "
          f"{len(batch)} requests at {rate:g} req/s for {args.overload_s:g} s:")  # fmt: skip
    for r in rows:
        print(json.dumps(r))
    return 0


def write(out: Path, sweep: list[dict], rows: list[dict], runs: dict, capacity: float,
          yardstick: float) -> None:  # fmt: skip
    with (out / "overload.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "overload.json").write_text(json.dumps({
        "capacity_rps": capacity, "goodput_at_capacity_rps": yardstick, "sweep": sweep,
        "runs": rows,
        "requests": {n: [asdict(o) for o in r["outcomes"]] for n, r in runs.items()},
    }, indent=1))  # fmt: skip
    plot(out / "overload.png", sweep, runs)


def plot(path: Path, sweep: list[dict], runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot([s["rate"] for s in sweep], [s["free_tier_slo"] for s in sweep], "o-")
    left.axhline(CAPACITY_ATTAINMENT, ls=":", c="gray")
    left.set(xlabel="offered load (req/s)", ylabel="free-tier SLO attainment", title="capacity")
    for name, run in runs.items():
        done = sorted(run["outcomes"], key=lambda o: o.arrival_s)
        edges = np.arange(0, max(o.arrival_s for o in done) + 5, 5)
        met = np.histogram([o.arrival_s for o in done if o.slo_met], edges)[0] / 5
        right.step(edges[1:], met, where="pre", label=f"{name}: goodput")
    right.set(xlabel="arrival (s)", ylabel="requests meeting the SLO per second",
              title="10x capacity")  # fmt: skip
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
