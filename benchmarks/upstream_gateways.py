"""`python -m benchmarks.upstream_gateways`: our server in front of `vllm serve`-shaped upstreams,
side by side with the gateways users would pick instead (sglang-router, vllm-router).

Three null upstreams (`workloads.null_server`: vLLM's chunk layout, /health, /metrics; first
token at `--first-token-ms`, then one every `--token-gap-ms`, whatever the load) stand behind
each gateway in turn:
- `ours`: `python -m serving` with a `remote` deployment naming the three URLs as three replicas
  of one model, as `make serve` runs it (request log, /metrics and HTTP/3 on);
- `sglang-router` and `vllm-router` (Rust), from a virtual environment of their own
  (`--peers-venv`; `--install-peers` makes it with pip; a gateway whose venv lacks it is skipped
  with a note);
- `direct`: the load straight at one upstream, the baseline for the added TTFT;
- `ours-2w` (not run unless named): `ours` with `--workers 2`, both workers on the one core;
- `ours-uvloop` (not run unless named): `ours` on uvloop's event loop (`--loop uvloop`);
- `ours-counted` (not run unless named): `ours` with the embedded tiny-s's tokenizer in place of
  opt-125m's, so that it counts each prompt before it routes (`ours` names facebook/opt-125m,
  whose tokenizer is not on the machine, and routes uncounted).

Each gateway is pinned to CPU 0 and the load generator, `vllm bench serve` (128 tokens in, 64
out, chat), to the others. Rounds interleave the gateways, so that the machine's drift falls on
all of them alike. Gateway CPU (the process and its children) is read from /proc over each
run. The table: achieved rate, failures, median and p99 TTFT, the median TTFT added over
`direct` in the same round, gateway CPU per request, and the gateway's resident memory at idle
(its whole process tree, 2 s after it is ready, before any load), each the median over the
rounds. For `ours-2w`, the requests each worker served.

    python -m benchmarks.upstream_gateways --install-peers          # 20, 80, 200 req/s, 3 rounds
    python -m benchmarks.upstream_gateways --rates 40 --rounds 1 --gateways ours,direct
    python -m benchmarks.upstream_gateways --upstream vllm --rates 2 --rounds 2 --duration 30
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from benchmarks.common import (
    ASKED,
    MODEL,
    add_peer_arguments,
    install_peers,
    peer_command,
    remote_config,
    report,
    start_upstreams,
    start_vllm,
)
from config.schema import TinyBuild
from experiments.harness.live import VLLM_BENCH
from serving.embedded import ensure_built
from serving.launch import ROOT, Launched, free_port, launch, shipped_spec
from transport.process_tree import tree_cpu_seconds, tree_use

GATEWAYS = (
    "direct",
    "ours",
    "ours-uvloop",
    "ours-counted",
    "ours-2w",
    "sglang-router",
    "vllm-router",
)
DEFAULT_GATEWAYS = ("direct", "ours", "sglang-router", "vllm-router")


def start_gateway(
    name: str, urls: list[str], folder: Path, args: argparse.Namespace
) -> Launched | None:
    port = free_port()
    log = folder / f"{name}.log"
    if name.startswith("ours"):
        tokenizer = None
        if name == "ours-counted":
            build = TinyBuild(**shipped_spec()["models"]["tiny-s"]["build"])
            tokenizer = ensure_built(ROOT / ".models" / "tiny-s", build)
        config = remote_config(folder, urls, tokenizer=tokenizer)
        command = [sys.executable, "-m", "serving", "--config", str(config),
                   "--deployment", "bench-upstreams", "--port", str(port),
                   "--h3-port", str(free_port(socket.SOCK_DGRAM)),
                   "--request-log", str(folder / f"requests-{name}.jsonl")]  # fmt: skip
        if name == "ours-2w":
            command += ["--workers", "2"]
        if name == "ours-uvloop":
            command += ["--loop", "uvloop"]
        ready = "/readyz"
    else:
        binary = peer_command(name, args.peers_venv)
        if binary is None:
            return None
        command = [*binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
        ready = "/health"
    return launch(name, command, port, ready, log, cpus={0}).ready(120)


def bench(url: str, rate: float, args: argparse.Namespace, out: Path) -> dict:
    prompts = max(int(rate * args.duration), 10)
    command = [sys.executable, "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", url,
               "--endpoint", "/v1/chat/completions", "--model", ASKED,
               "--tokenizer", str(ROOT / ".models" / "tiny-m"), "--dataset-name", "random",
               "--random-input-len", "128", "--random-output-len", "64", "--ignore-eos",
               "--num-prompts", str(prompts), "--request-rate", str(rate), "--seed", "3",
               "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
               "--disable-tqdm"]  # fmt: skip
    cpus = set(range(1, os.cpu_count() or 2)) or {0}
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )  # fmt: skip
    if result.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def run(args: argparse.Namespace) -> list[dict]:
    if args.install_peers:
        install_peers(args.peers_venv)
    rows: list[dict] = []
    folder = args.out
    folder.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if args.upstream == "vllm":
            urls = start_vllm(stack, folder, [MODEL, ASKED])
        else:
            paces = [(args.first_token_ms, args.token_gap_ms)] * args.upstreams
            urls = start_upstreams(stack, folder, paces)
        for round_ in range(args.rounds):
            for rate in args.rates:
                direct = None
                for name in args.gateways:
                    gateway = None if name == "direct" else start_gateway(name, urls, folder, args)
                    if name != "direct" and gateway is None:
                        continue
                    url = urls[0] if gateway is None else gateway.url
                    pid = gateway.pid if gateway is not None else None
                    if pid:
                        time.sleep(2)  # whatever it does once ready (a first scrape) is done
                    idle = tree_use(pid) if pid else None
                    idle_rss = idle.rss_bytes / 2**20 if idle else None
                    before = idle.cpu_s if idle else 0.0
                    try:
                        record = bench(url, rate, args, folder / f"{name}-r{rate:g}-{round_}.json")
                    finally:
                        used = tree_cpu_seconds(pid) - before if pid else 0.0
                        if gateway is not None:
                            gateway.stop()
                    row = {
                        "round": round_, "rate": rate, "gateway": name,
                        "achieved": record["request_throughput"],
                        "completed": record["completed"],
                        "failed": record.get("failed", record["num_prompts"] - record["completed"]),
                        "median_ttft_ms": record["median_ttft_ms"],
                        "p99_ttft_ms": record["p99_ttft_ms"],
                        "cpu_ms_per_request": 1000 * used / max(record["completed"], 1),
                        "cores": used / record["duration"],
                        "idle_rss_mb": idle_rss,
                    }  # fmt: skip
                    if name == "direct":
                        direct = row
                    row["added_ttft_ms"] = (
                        row["median_ttft_ms"] - direct["median_ttft_ms"] if direct else None
                    )
                    if name == "ours-2w":
                        row["per_worker"] = per_worker(folder / f"requests-{name}.jsonl")
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    columns = ["rate", "gateway", "achieved req/s", "failed", "median TTFT", "p99 TTFT",
               "added median TTFT", "CPU per request", "gateway cores", "idle RSS"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    keys = sorted({(r["rate"], GATEWAYS.index(r["gateway"]), r["gateway"]) for r in rows})
    for rate, _, name in keys:
        mine = [r for r in rows if (r["rate"], r["gateway"]) == (rate, name)]

        def median(field: str, rows: list[dict] = mine) -> float:
            return statistics.median(r[field] for r in rows if r[field] is not None)

        # Added TTFT needs a `direct` run in the same round; a run without one leaves it blank.
        measured = any(r["added_ttft_ms"] is not None for r in mine)
        added = f"{median('added_ttft_ms'):+.1f} ms" if measured else ""
        cpu = "" if name == "direct" else f"{median('cpu_ms_per_request'):.2f} ms"
        cores = "" if name == "direct" else f"{median('cores'):.2f}"
        rss = "" if name == "direct" else f"{median('idle_rss_mb'):.0f} MB"
        lines.append(
            f"| {rate:g} req/s | {name} | {median('achieved'):.1f} "
            f"| {sum(r['failed'] for r in mine)} "
            f"| {median('median_ttft_ms'):.1f} ms | {median('p99_ttft_ms'):.1f} ms | {added} "
            f"| {cpu} | {cores} | {rss} |"
        )  # fmt: skip
    for row in rows:
        if "per_worker" in row:
            split = ", ".join(f"worker {w}: {n}" for w, n in row["per_worker"].items())
            lines.append(f"\n{row['gateway']} at {row['rate']:g} req/s, round {row['round']}: "
                         f"{split}")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.upstream_gateways", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--rates", default="20,80,200", help="req/s, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--gateways", default=",".join(DEFAULT_GATEWAYS))
    parser.add_argument(
        "--upstream", choices=("null", "vllm"), default="null",
        help="null: --upstreams null servers; vllm: one real `vllm serve` of the embedded tiny-s "
        "(CPU), for a low rate",
    )  # fmt: skip
    parser.add_argument("--upstreams", type=int, default=3)
    parser.add_argument("--first-token-ms", type=float, default=20.0)
    parser.add_argument("--token-gap-ms", type=float, default=10.0)
    add_peer_arguments(parser, "upstream_gateways")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    args.gateways = args.gateways.split(",")
    unknown = set(args.gateways) - set(GATEWAYS)
    if unknown:
        parser.error(f"unknown gateways {sorted(unknown)}; choose from {', '.join(GATEWAYS)}")
    if "direct" in args.gateways:  # first in each round: the others' added TTFT is against it
        args.gateways = ["direct", *[g for g in args.gateways if g != "direct"]]
    return args


def per_worker(request_log: Path) -> dict[int, int]:
    """The requests each worker served in the run just ended, from the request log, which is
    then removed so that the next run counts from nothing."""
    served = Counter(json.loads(line)["worker"] for line in request_log.read_text().splitlines())
    request_log.unlink()
    return dict(sorted(served.items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    report(args.out, rows, table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
