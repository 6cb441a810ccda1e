"""`python -m benchmarks.upstream_overload`: what each gateway does when its upstreams cannot keep
up; ours beside sglang-router and vllm-router (the peers of `benchmarks.upstream_gateways`).

The load is `workloads.replay` over HTTP/1.1 (Poisson arrivals; 5% real-time requests, the rest
free-tier, all with the premium key; 128 tokens in, 64 out, a 30 s client timeout), pinned away
from the gateway's core. SLO: models.yaml's (40 ms a token, from arrival to the last token).
The upstreams are null servers (`workloads.null_server`) with `--max-num-seqs`, so each runs at
most that many requests and queues the rest in order, as vLLM does.

- `saturated`: three upstreams; capacity C = 3 x max_num_seqs / (first token + gap x 63). Each
  gateway, in one process's life, gets 20 req/s for `--probe-s` (the "before"), C for
  `--duration`, 5 C for `--duration`, then 20 req/s again (the "after"). Reported: goodput (SLO
  met per second of arrivals) at 5 C against at C, the p99 time to a 429, real-time SLO
  attainment under overload, and the gateway's RSS and p99 TTFT at 20 req/s after the overload
  against before.
- `slow`: three upstreams, one three times slower than the others (15 ms a token and 45 ms, so
  that the slow one misses the 40 ms SLO by itself), at 70% of the fleet's capacity: SLO
  attainment per class.

    python -m benchmarks.upstream_overload --install-peers
    python -m benchmarks.upstream_overload --scenarios slow --gateways ours
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from benchmarks.common import ASKED, add_peer_arguments, install_peers, report, start_upstreams
from benchmarks.upstream_gateways import start_gateway
from serving.launch import ROOT

PEERED = ("ours", "sglang-router", "vllm-router")
SCENARIOS = ("saturated", "slow")
OUTPUT_TOKENS = 64
PREMIUM_KEY = "bench-premium-key"
"""Granted the premium tier (real-time allowed) through QOS_PREMIUM_KEY, which our server reads;
the peers pass it through and the null upstreams ignore it."""


def capacity(upstreams: list[tuple[float, float]], slots: int) -> float:
    """Requests a second the upstreams finish when every slot is busy."""
    return sum(slots / ((first + gap * (OUTPUT_TOKENS - 1)) / 1000) for first, gap in upstreams)


def load(url: str, rate: float, duration_s: float, seed: int, out: Path) -> list[dict]:
    """One run of `workloads.replay`; its per-request outcomes."""
    command = [sys.executable, "-m", "workloads.replay", "--proto", "h1", "--url", url,
               "--model", ASKED, "--api-key", PREMIUM_KEY, "--arrivals", "poisson",
               "--rate", f"{rate:g}", "--duration", f"{duration_s:g}", "--seed", str(seed),
               "--classes", "real-time=1,free-tier=19", "--prompt-tokens", "128:128",
               "--output-tokens", f"{OUTPUT_TOKENS}:{OUTPUT_TOKENS}", "--timeout", "30",
               "--out", str(out), "--no-progress"]  # fmt: skip
    cpus = set(range(1, os.cpu_count() or 2)) or {0}
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )  # fmt: skip
    if result.returncode not in (0, 1) or not out.exists():  # 1: some requests failed
        raise RuntimeError(f"workloads.replay failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())["requests"]


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def judged(outcomes: list[dict], duration_s: float) -> dict:
    """What a run's outcomes come to: goodput, per-class SLO attainment, the 429s, TTFT."""
    by_class: dict[str, list[dict]] = {}
    for o in outcomes:
        by_class.setdefault(o["qos_class"], []).append(o)
    shed = [o for o in outcomes if o["error_kind"] == "http_429"]
    return {
        "requests": len(outcomes),
        "goodput": sum(o["slo_met"] for o in outcomes) / duration_s,
        "completed": sum(o["error_kind"] is None for o in outcomes),
        "shed": len(shed),
        "other_errors": sum(o["error_kind"] not in (None, "http_429") for o in outcomes),
        "p99_time_to_429_ms": _ms(p99([o["e2el_s"] for o in shed if o["e2el_s"] is not None])),
        "p99_ttft_ms": _ms(p99([o["ttft_s"] for o in outcomes if o["ttft_s"] is not None])),
        "slo": {c: sum(o["slo_met"] for o in os_) / len(os_) for c, os_ in by_class.items()},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def loop_stalls(url: str) -> int | None:
    """Our server's event-loop lag samples over 100 ms so far (`serving_event_loop_lag_seconds`,
    one sample every 50 ms); None for a gateway that does not report it."""
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


def saturated(name: str, urls: list[str], cap: float, args: argparse.Namespace) -> dict | None:
    gateway = start_gateway(name, urls, args.out / "saturated", args)
    if gateway is None:
        return None
    folder = args.out / "saturated"
    row: dict = {"scenario": "saturated", "gateway": name, "capacity_rps": cap}
    try:
        plan = [("before", 20.0, args.probe_s), ("capacity", cap, args.duration),
                ("overload", 5 * cap, args.duration), ("after", 20.0, args.probe_s)]  # fmt: skip
        for seed, (phase, rate, duration) in enumerate(plan):
            outcomes = load(gateway.url, rate, duration, seed, folder / f"{name}-{phase}.json")
            row[phase] = judged(outcomes, duration) | {
                "rate": rate,
                "rss_mb": rss_mb(gateway.pid),
                "loop_stalls": loop_stalls(gateway.url) if name == "ours" else None,
            }
            print(json.dumps({"gateway": name, "phase": phase, **row[phase]}), file=sys.stderr)
            time.sleep(2)  # the upstreams' queues drain of what the client gave up on
    finally:
        gateway.stop()
    return row


def slow(name: str, urls: list[str], cap: float, args: argparse.Namespace) -> dict | None:
    gateway = start_gateway(name, urls, args.out / "slow", args)
    if gateway is None:
        return None
    rate = 0.7 * cap
    try:
        outcomes = load(gateway.url, rate, args.duration, 7, args.out / "slow" / f"{name}.json")
    finally:
        gateway.stop()
    row = {"scenario": "slow", "gateway": name, "capacity_rps": cap, "rate": rate}
    row |= judged(outcomes, args.duration)
    print(json.dumps(row), file=sys.stderr)
    return row


def run(args: argparse.Namespace) -> list[dict]:
    if args.install_peers:
        install_peers(args.peers_venv)
    os.environ["QOS_PREMIUM_KEY"] = PREMIUM_KEY
    rows: list[dict] = []
    pace = (args.first_token_ms, args.token_gap_ms)
    fast = (args.first_token_ms, args.slow_base_gap_ms)
    scenarios = {
        "saturated": (saturated, [pace] * 3),
        "slow": (slow, [fast, fast, (3 * fast[0], 3 * fast[1])]),
    }
    for scenario in args.scenarios:
        function, paces = scenarios[scenario]
        cap = capacity(paces, args.max_num_seqs)
        for name in args.gateways:
            # Fresh upstreams for each gateway: nothing one left queued reaches the next.
            with ExitStack() as stack:
                urls = start_upstreams(stack, args.out / scenario, paces, args.max_num_seqs)
                row = function(name, urls, cap, args)
            if row is not None:
                rows.append(row)
    return rows


def _f(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def tables(rows: list[dict]) -> str:
    out = []
    saturated_rows = [r for r in rows if r["scenario"] == "saturated"]
    if saturated_rows:
        out += [
            f"Saturated: capacity {saturated_rows[0]['capacity_rps']:.1f} req/s, overload at 5x.",
            "",
            "| gateway | goodput at capacity | goodput at 5x | ratio | shed at 5x | p99 time to "
            "429 | real-time SLO at 5x | free-tier SLO at 5x | other errors at 5x | RSS before "
            "→ after | p99 TTFT at 20 req/s before → after | loop lags over 100 ms |",
            "|---" * 12 + "|",
        ]
        for r in saturated_rows:
            cap, over, before, after = r["capacity"], r["overload"], r["before"], r["after"]
            ratio = over["goodput"] / cap["goodput"] if cap["goodput"] else None
            out.append(
                f"| {r['gateway']} | {cap['goodput']:.1f} req/s | {over['goodput']:.1f} req/s "
                f"| {_f(ratio and 100 * ratio, '%', 0)} | {over['shed']} "
                f"| {_f(over['p99_time_to_429_ms'], ' ms')} "
                f"| {100 * over['slo'].get('real-time', 0):.1f}% "
                f"| {100 * over['slo'].get('free-tier', 0):.1f}% | {over['other_errors']} "
                f"| {before['rss_mb']:.0f} → {after['rss_mb']:.0f} MB "
                f"| {_f(before['p99_ttft_ms'], ' ms')} → {_f(after['p99_ttft_ms'], ' ms')} "
                f"| {'—' if after.get('loop_stalls') is None else after['loop_stalls']} |"
            )  # fmt: skip
    slow_rows = [r for r in rows if r["scenario"] == "slow"]
    if slow_rows:
        out += [
            "",
            f"One upstream 3x slower: {slow_rows[0]['rate']:.1f} req/s, 70% of the fleet's "
            f"{slow_rows[0]['capacity_rps']:.1f}.",
            "",
            "| gateway | real-time SLO | free-tier SLO | shed | other errors | p99 TTFT |",
            "|---" * 6 + "|",
        ]
        for r in slow_rows:
            out.append(
                f"| {r['gateway']} | {100 * r['slo'].get('real-time', 0):.1f}% "
                f"| {100 * r['slo'].get('free-tier', 0):.1f}% | {r['shed']} | {r['other_errors']} "
                f"| {_f(r['p99_ttft_ms'], ' ms')} |"
            )  # fmt: skip
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.upstream_overload", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--gateways", default=",".join(PEERED))
    parser.add_argument("--duration", type=float, default=60.0, help="s at C, and at 5 C")
    parser.add_argument("--probe-s", type=float, default=20.0, help="s at 20 req/s, each side")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--first-token-ms", type=float, default=20.0)
    parser.add_argument("--token-gap-ms", type=float, default=10.0)
    parser.add_argument(
        "--slow-base-gap-ms", type=float, default=15.0,
        help="slow: the fast upstreams' token gap; the slow one's is three times it, past the "
        "SLO's 40 ms a token at the default",
    )  # fmt: skip
    add_peer_arguments(parser, "upstream_overload")
    args = parser.parse_args(argv)
    args.scenarios = args.scenarios.split(",")
    args.gateways = args.gateways.split(",")
    if unknown := set(args.scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    if unknown := set(args.gateways) - set(PEERED):
        parser.error(f"unknown gateways {sorted(unknown)}; choose from {', '.join(PEERED)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    report(args.out, rows, tables(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
