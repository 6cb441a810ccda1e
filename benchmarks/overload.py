"""`python -m benchmarks.overload`: what a gateway does past its engines' capacity, with our
admission control, without it, and beside the gateways a user would pick instead.

One measurement on two back-ends. The load is `workloads.replay` (Poisson arrivals, a
`--realtime-share` of real-time requests and the rest free-tier, every request with the premium
key, so real-time is granted), run as its own process; the SLO is models.yaml's. Each run is
judged the same way: goodput (requests that met the SLO, per second of arrivals) and its ratio
to the goodput at capacity, SLO attainment per class, the shed answers (429) and the client's
p99 time to one, every other way a request ended, and, for our server, whether its outcome
counters rose by exactly the number sent.

- `--backend engines` (the default): the deployment's own engines (models.yaml's default
  deployment). The capacity is found first: free-tier load at rising `--rates`, `--step-s` each,
  against our server as shipped; the highest rate whose free-tier SLO attainment stays at or
  above 90% is the capacity, and the goodput there the yardstick. Then `--factor` (10) times that
  for `--duration` goes to each gateway: `ours` as shipped and `ours-no-admission`
  (`--admission none`), the same workload and seed. The engines run on every core but the last
  (serving's pinning); the front-end and the load float.
- `--backend upstreams`: three null upstreams (`workloads.null_server`) with `--max-num-seqs`
  each, queuing the rest in order as vLLM does, so the capacity C is known in advance. Each
  gateway (`ours`, `sglang-router`, `vllm-router`; the peers from `--peers-venv`), in one
  process's life, gets 20 req/s for `--probe-s` (before), C for `--duration`, `--factor` (5) C
  for `--duration`, and 20 req/s again (after): its RSS and p99 TTFT after the overload against
  before. Fresh upstreams for each gateway. The gateway is pinned to CPU 0, the upstreams and
  the load to the rest. The `slow` scenario puts one upstream three times slower than the others
  (past the SLO by itself) at 70% of the fleet's capacity: SLO attainment per class.

    python -m benchmarks.overload                                     # embedded, ~10 minutes
    python -m benchmarks.overload --backend upstreams --install-peers  # ~25 minutes
    python -m benchmarks.overload --backend upstreams --scenarios slow --gateways ours
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import ASKED, add_peer_arguments, install_peers, report, start_upstreams
from benchmarks.upstream_gateways import start_gateway
from config import DEFAULT_PATH, load_deployment
from experiments.harness import live
from experiments.harness.live import metric, requests_total, server
from transport.process_tree import tree_use

BACKENDS = ("engines", "upstreams")
GATEWAYS = {
    "engines": ("ours", "ours-no-admission"),
    "upstreams": ("ours", "sglang-router", "vllm-router"),
}
SCENARIOS = ("saturated", "slow")
PREMIUM_KEY = "overload-bench-premium"
"""Granted the premium tier (real-time allowed) through QOS_PREMIUM_KEY, which our server reads;
the peers pass it through and the engines ignore it."""
CAPACITY_ATTAINMENT = 0.90
UPSTREAM_TOKENS = 64
"""What each request asks of a null upstream: 128 tokens in, this many out."""


def replay(url: str, rate: float, seconds: float, seed: int, out: Path, args: argparse.Namespace,
           realtime: float) -> dict:  # fmt: skip
    """One open-loop run of `workloads.replay`: its record (per-request outcomes, the client's
    health). Pinned away from CPU 0 where the gateway is pinned there."""
    classes = f"real-time={realtime:g},free-tier={1 - realtime:g}" if realtime else "free-tier"
    flags = ["--api-key", PREMIUM_KEY, "--arrivals", "poisson", "--rate", f"{rate:g}",
             "--duration", f"{seconds:g}", "--seed", str(seed), "--classes", classes,
             "--output-tokens", args.output_tokens, "--timeout", f"{args.timeout:g}",
             "--connections", str(args.connections)]  # fmt: skip
    cpus = None
    if args.backend == "upstreams":
        flags += ["--model", ASKED, "--prompt-tokens", "128:128"]
        cpus = set(range(1, os.cpu_count() or 2)) or {0}
    return live.replay(url, out, *flags, proto=args.proto, cpus=cpus)


def judged(record: dict, seconds: float) -> dict:
    """What a run's outcomes come to."""
    outcomes = record["requests"]
    by_class: dict[str, list[dict]] = {}
    ended: dict[str, int] = {}
    for o in outcomes:
        by_class.setdefault(o["qos_class"], []).append(o)
        kind = o["error_kind"] or "ok"
        ended[kind] = ended.get(kind, 0) + 1
    shed = [1000 * o["e2el_s"] for o in outcomes if o["error_kind"] == "http_429" and o["e2el_s"]]
    ttft = [1000 * o["ttft_s"] for o in outcomes if o["ttft_s"] is not None]
    return {
        "requests": len(outcomes),
        "ended": dict(sorted(ended.items())),
        "goodput": sum(o["slo_met"] for o in outcomes) / seconds,
        "shed": ended.get("http_429", 0),
        "other_errors": sum(n for k, n in ended.items() if k not in ("ok", "http_429")),
        "p99_time_to_429_ms": _p99(shed),
        "p99_ttft_ms": _p99(ttft),
        "slo": {c: sum(o["slo_met"] for o in os_) / len(os_) for c, os_ in by_class.items()},
        "client_cpu": record["client"]["cpu_share_of_core"],
        "client_p99_lag_ms": record["client"]["p99_lag_ms"],
    }


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def counted(url: str, before: dict, sent: int) -> dict:
    """Our server's side of a run, once nothing is in flight: what its outcome counters rose by
    (every request sent should be there), and its CPU."""
    deadline = time.monotonic() + 120
    while metric(url, "serving_replica_in_flight") and time.monotonic() < deadline:
        time.sleep(0.5)
    after = requests_total(url)
    rose = sum(after.values()) - sum(before["outcomes"].values())
    return {"server_counted": rose, "all_counted": rose == sent,
            "server_cpu_s": metric(url, "process_cpu_seconds_total") - before["cpu"]}  # fmt: skip


def ours_before(url: str) -> dict:
    return {"outcomes": requests_total(url), "cpu": metric(url, "process_cpu_seconds_total")}


def loop_stalls(url: str) -> int | None:
    """Our server's event-loop lag samples over 100 ms so far (`serving_event_loop_lag_seconds`,
    one sample every 50 ms)."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        if line.startswith("serving_event_loop_lag_seconds_"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    within = values.get('serving_event_loop_lag_seconds_bucket{le="0.1"}')
    total = values.get("serving_event_loop_lag_seconds_count")
    return None if within is None or total is None else int(total - within)


def phase(name: str, label: str, url: str, metrics_url: str | None, rate: float, seconds: float,
          seed: int, folder: Path, args: argparse.Namespace, realtime: float) -> dict:  # fmt: skip
    """One run (`label`) against one gateway, judged; for ours (`metrics_url`, over HTTP/1.1
    whatever the load speaks), its own count of it too."""
    before = ours_before(metrics_url) if metrics_url else None
    record_path = folder / f"{name}-{label}.json"
    record = replay(url, rate, seconds, seed, record_path, args, realtime)
    row = judged(record, seconds) | {"rate": rate, "record": str(record_path)}
    if metrics_url is not None and before is not None:
        row |= counted(metrics_url, before, row["requests"])
    return row


# --- the deployment's own engines ------------------------------------------------------------


def on_engines(args: argparse.Namespace) -> list[dict]:
    deployment = load_deployment(args.config, args.deployment)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; deployment {deployment.name}")
    folder = args.out / "engines"
    folder.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    capacity, yardstick = 0.0, 0.0
    for gateway in args.gateways:
        extra = ["--config", args.config, "--request-log", "off"]
        if gateway == "ours-no-admission":
            extra += ["--admission", "none"]
        log = folder / f"server-{gateway}.log"
        env = {"QOS_PREMIUM_KEY": PREMIUM_KEY}
        with server(args.deployment, None, log, extra=extra, env=env) as live:
            url = live.url if args.proto == "h1" else f"https://localhost:{live.h3_port}"
            if not capacity:
                capacity, yardstick = find_capacity(gateway, url, live.url, folder, args, rows)
                if not capacity:
                    print("no rate met 90%: lower --rates", file=sys.stderr)
                    return rows
            rate = args.factor * capacity
            print(f"{gateway}: {rate:g} req/s for {args.duration:g} s", file=sys.stderr)
            row = phase(gateway, "overload", url, live.url, rate, args.duration, args.seed + 1,
                        folder, args, args.realtime_share)  # fmt: skip
            rows.append({"gateway": gateway, "phase": "overload", "capacity_rps": capacity,
                         "yardstick_rps": yardstick, **row})  # fmt: skip
    return rows


def find_capacity(gateway: str, url: str, metrics_url: str, folder: Path,
                  args: argparse.Namespace, rows: list[dict]) -> tuple[float, float]:  # fmt: skip
    """The highest of `--rates` whose free-tier SLO attainment is at least 90%, and the goodput
    there; each rate tried is a row of its own (phase `sweep`)."""
    capacity, yardstick = 0.0, 0.0
    for rate in args.rates:
        row = phase(
            gateway,
            f"sweep-{rate:g}",
            url,
            metrics_url,
            rate,
            args.step_s,
            args.seed,
            folder,
            args,
            0.0,
        )
        rows.append({"gateway": gateway, "phase": "sweep", **row})
        met = row["slo"].get("free-tier", 0.0)
        print(f"{rate:g} req/s: free-tier SLO {met:.1%}, goodput {row['goodput']:.2f} req/s",
              file=sys.stderr)  # fmt: skip
        if met < CAPACITY_ATTAINMENT:
            break
        capacity, yardstick = rate, row["goodput"]
    return capacity, yardstick


# --- null upstreams, beside the peers ----------------------------------------------------------


def upstream_capacity(paces: list[tuple[float, float]], slots: int) -> float:
    """Requests a second the upstreams finish when every slot is busy."""
    return sum(slots / ((first + gap * (UPSTREAM_TOKENS - 1)) / 1000) for first, gap in paces)


def on_upstreams(args: argparse.Namespace) -> list[dict]:
    if args.install_peers:
        install_peers(args.peers_venv)
    os.environ["QOS_PREMIUM_KEY"] = PREMIUM_KEY
    args.output_tokens = f"{UPSTREAM_TOKENS}:{UPSTREAM_TOKENS}"
    pace = (args.first_token_ms, args.token_gap_ms)
    fast = (args.first_token_ms, args.slow_base_gap_ms)
    fleets = {"saturated": [pace] * 3, "slow": [fast, fast, (3 * fast[0], 3 * fast[1])]}
    rows: list[dict] = []
    for scenario in args.scenarios:
        cap = upstream_capacity(fleets[scenario], args.max_num_seqs)
        folder = args.out / "upstreams" / scenario
        folder.mkdir(parents=True, exist_ok=True)
        plan = (
            [("before", 20.0, args.probe_s), ("capacity", cap, args.duration),
             ("overload", args.factor * cap, args.duration), ("after", 20.0, args.probe_s)]
            if scenario == "saturated" else [("slow", 0.7 * cap, args.duration)]
        )  # fmt: skip
        for name in args.gateways:
            # Fresh upstreams for each gateway: nothing one left queued reaches the next.
            with ExitStack() as stack:
                urls = start_upstreams(stack, folder, fleets[scenario], args.max_num_seqs)
                gateway = start_gateway(name, urls, folder, args)
                if gateway is None:
                    continue
                with gateway:
                    for seed, (what, rate, seconds) in enumerate(plan):
                        ours = gateway.url if name == "ours" else None
                        row = phase(name, what, gateway.url, ours, rate, seconds, seed, folder,
                                    args, args.realtime_share)  # fmt: skip
                        row |= {"rss_mb": tree_use(gateway.pid).rss_bytes / 2**20}
                        if name == "ours":
                            row |= {"loop_stalls": loop_stalls(gateway.url)}
                        rows.append({"scenario": scenario, "gateway": name, "phase": what,
                                     "capacity_rps": cap, **row})  # fmt: skip
                        print(json.dumps(rows[-1]), file=sys.stderr)
                        time.sleep(2)  # the upstreams' queues drain of what the client gave up on
    return rows


# --- tables -------------------------------------------------------------------------------------


def _f(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def _slo(row: dict, cls: str) -> str:
    return _f(100 * row["slo"][cls], "%") if cls in row["slo"] else "—"


def _counted(row: dict) -> str:
    return "—" if "all_counted" not in row else "yes" if row["all_counted"] else "NO"


OVERLOAD_HEADER = (
    "| gateway | goodput | vs capacity's | real-time SLO | free-tier SLO | shed | p99 time to 429 "
    "| other errors | every request counted |\n" + "|---" * 9 + "|"
)


def overload_line(row: dict, yardstick: float) -> str:
    ratio = row["goodput"] / yardstick if yardstick else None
    return (
        f"| {row['gateway']} | {row['goodput']:.1f} req/s | {_f(ratio, '', 3)} "
        f"| {_slo(row, 'real-time')} | {_slo(row, 'free-tier')} | {row['shed']} "
        f"| {_f(row['p99_time_to_429_ms'], ' ms')} | {row['other_errors']} | {_counted(row)} |"
    )


def tables(rows: list[dict]) -> str:
    out: list[str] = []
    if sweep := [r for r in rows if r["phase"] == "sweep"]:
        out += ["Capacity: " + ", ".join(
            f"{r['rate']:g} req/s {100 * r['slo'].get('free-tier', 0):.1f}%" for r in sweep
        ) + " of free-tier requests met the SLO.", ""]  # fmt: skip
    if engines := [r for r in rows if "scenario" not in r and r["phase"] == "overload"]:
        first = engines[0]
        out += [f"Capacity {first['capacity_rps']:g} req/s, goodput there "
                f"{first['yardstick_rps']:.1f}; {first['requests']} requests at "
                f"{first['rate']:g} req/s:", "", OVERLOAD_HEADER]  # fmt: skip
        out += [overload_line(r, r["yardstick_rps"]) for r in engines]
    saturated: dict[str, dict[str, dict]] = {
        r["gateway"]: {} for r in rows if r.get("scenario") == "saturated"
    }
    for r in rows:
        if r.get("scenario") == "saturated":
            saturated[r["gateway"]][r["phase"]] = r
    if saturated:
        some = next(iter(saturated.values()))["overload"]
        out += ["", f"Saturated null upstreams: capacity {some['capacity_rps']:.1f} req/s, "
                f"overload at {some['rate']:.1f}:", "", OVERLOAD_HEADER]  # fmt: skip
        out += [overload_line(p["overload"], p["capacity"]["goodput"]) for p in saturated.values()]
        out += ["", "| gateway | RSS before → after | p99 TTFT at 20 req/s before → after "
                "| loop lags over 100 ms |", "|---" * 4 + "|"]  # fmt: skip
        for name, p in saturated.items():
            before, after = p["before"], p["after"]
            out.append(
                f"| {name} | {before['rss_mb']:.0f} → {after['rss_mb']:.0f} MB "
                f"| {_f(before['p99_ttft_ms'], ' ms')} → {_f(after['p99_ttft_ms'], ' ms')} "
                f"| {after.get('loop_stalls', '—')} |"
            )
    if slow := [r for r in rows if r.get("scenario") == "slow"]:
        out += ["", f"One upstream 3x slower: {slow[0]['rate']:.1f} req/s, 70% of the fleet's "
                f"{slow[0]['capacity_rps']:.1f}:", "",
                "| gateway | real-time SLO | free-tier SLO | shed | other errors | p99 TTFT |",
                "|---" * 6 + "|"]  # fmt: skip
        out += [f"| {r['gateway']} | {_slo(r, 'real-time')} | {_slo(r, 'free-tier')} "
                f"| {r['shed']} | {r['other_errors']} | {_f(r['p99_ttft_ms'], ' ms')} |"
                for r in slow]  # fmt: skip
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overload", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--backend", choices=BACKENDS, default="engines")
    p.add_argument("--gateways", default=None, help="default: ours,ours-no-admission (engines); "
                   "ours,sglang-router,vllm-router (upstreams)")  # fmt: skip
    p.add_argument("--factor", type=float, default=None, help="overload = factor x capacity "
                   "(default: 10 on engines, 5 on upstreams)")  # fmt: skip
    p.add_argument("--duration", type=float, default=60.0, help="s of the overload (and at C)")
    p.add_argument("--realtime-share", type=float, default=0.05)
    p.add_argument("--proto", choices=["h1", "h3"], default="h1")
    p.add_argument("--connections", type=int, default=4, help="h3: QUIC connections")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None,
                   help="the client's, s (default: 120 on engines, 30 on upstreams)")  # fmt: skip
    engines = p.add_argument_group("engines")
    engines.add_argument("--config", default=str(DEFAULT_PATH))
    engines.add_argument("--deployment", default=None, help="default: models.yaml's default")
    engines.add_argument("--rates", default="8,16,24,32,48,64,96", help="capacity sweep, req/s")
    engines.add_argument("--step-s", type=float, default=30.0, help="seconds per sweep rate")
    engines.add_argument("--output-tokens", default="32:128", help="LO:HI per request")
    upstreams = p.add_argument_group("upstreams")
    upstreams.add_argument("--scenarios", default=",".join(SCENARIOS))
    upstreams.add_argument("--probe-s", type=float, default=20.0, help="s at 20 req/s, each side")
    upstreams.add_argument("--max-num-seqs", type=int, default=8)
    upstreams.add_argument("--first-token-ms", type=float, default=20.0)
    upstreams.add_argument("--token-gap-ms", type=float, default=10.0)
    upstreams.add_argument(
        "--slow-base-gap-ms", type=float, default=15.0,
        help="slow: the fast upstreams' token gap; the slow one's is three times it, past the "
        "SLO's 40 ms a token at the default",
    )  # fmt: skip
    add_peer_arguments(p, "overload")
    args = p.parse_args(argv)
    args.gateways = (args.gateways or ",".join(GATEWAYS[args.backend])).split(",")
    if unknown := set(args.gateways) - set(GATEWAYS[args.backend]):
        p.error(f"unknown gateways {sorted(unknown)} on {args.backend}; "
                f"choose from {', '.join(GATEWAYS[args.backend])}")  # fmt: skip
    args.scenarios = args.scenarios.split(",")
    if unknown := set(args.scenarios) - set(SCENARIOS):
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    if args.backend == "upstreams" and args.proto != "h1":
        p.error("--backend upstreams takes --proto h1: the peers serve HTTP/1.1 only")
    args.factor = args.factor or (10.0 if args.backend == "engines" else 5.0)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.timeout = args.timeout or (120.0 if args.backend == "engines" else 30.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = on_engines(args) if args.backend == "engines" else on_upstreams(args)
    report(args.out / args.backend, rows, tables(rows))
    if rows:
        plot(args.out / args.backend / "goodput.png", rows)
    return 0 if rows else 1


def plot(path: Path, rows: list[dict]) -> None:
    """Left, the capacity sweep (engines); right, requests meeting the SLO per second through each
    gateway's overload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sweep = [r for r in rows if r["phase"] == "sweep"]
    left.plot([r["rate"] for r in sweep], [r["slo"].get("free-tier", 0) for r in sweep], "o-")
    left.axhline(CAPACITY_ATTAINMENT, ls=":", c="gray")
    left.set(xlabel="offered load (req/s)", ylabel="free-tier SLO attainment", title="capacity")
    for r in (r for r in rows if r["phase"] == "overload"):
        arrivals = [o["arrival_s"] for o in json.loads(Path(r["record"]).read_text())["requests"]
                    if o["slo_met"]]  # fmt: skip
        edges = np.arange(0, max(arrivals, default=0) + 5, 5)
        right.step(edges[1:], np.histogram(arrivals, edges)[0] / 5, where="pre",
                   label=r["gateway"])  # fmt: skip
    right.set(xlabel="arrival (s)", ylabel="requests meeting the SLO per second",
              title="overload")  # fmt: skip
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
