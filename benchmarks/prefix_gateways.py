"""`python -m benchmarks.prefix_gateways`: prefix-aware routing in front of real vLLM, ours side
by side with the peers' `cache_aware` (sglang-router, vllm-router) and with round-robin.

Two `vllm serve` replicas of an embedded model (`--model`, tiny-m: big enough that prefill shows
on a CPU, as in benchmarks.cache_fidelity; CPU build, prefix caching on, each with a KV
cache of `--kv-blocks` blocks of 128 tokens: 110 hold about half the conversations' histories,
so a replica that gets every conversation thrashes and one that gets half of them need not) on
CPU 1; each gateway in turn on CPU 0, with no admission control (the peers have none):
- `ours-precise`, `ours-approx`, `ours-hash`, `ours-rr`: `python -m serving` with the two
  replicas as a remote deployment of one model, `--policy prefix-precise` (its index fed by
  the replicas' KV cache events, which they publish over ZMQ), `prefix-approx`, `prefix-hash`
  or `round-robin`; `ours-precise-unscraped`: prefix-precise reading no replica's /metrics
  (`--scrape-s 0` for it alone), to run beside `ours-precise` in the same rounds;
- `sglang-router` and `vllm-router` with `--policy cache_aware`, from `--peers-venv`.

The load asks for model `auto` (the replicas answer to it too, so the peers may pass it on),
so that our gateway's router chooses. It is the project's closed-loop client (`python -m
workloads.replay --conversations sharegpt-16 --max-concurrency N`): each conversation's next
turn, carrying its history, goes out when its previous answer ended. Before each gateway both
replicas' prefix caches are emptied (`POST /reset_prefix_cache`, vLLM's dev mode). Reported per
gateway: requests completed and failed, mean and p99 TTFT, and the prefix cache hit rate the
replicas report in /metrics (`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries`, tokens,
over the run). With `--rounds N` the gateways run in turn N times, and the table
(prefix_gateways.md) gives each gateway's means and each one's paired difference from
`--against` with its 95% interval. prefix_choices.md takes the same requests one by one
(`benchmarks.prefix_choices`): which stayed on their conversation's replica, what each found
cached (vLLM's usage), and what the choices that differ from `--against`'s cost.

    python -m benchmarks.prefix_gateways --install-peers           # 10 min
    python -m benchmarks.prefix_gateways --scrape-s 0 --gateways ours-precise,ours-rr
    python -m benchmarks.prefix_gateways --lone 60 --gateways ours-precise,sglang-router
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
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import prefix_choices
from benchmarks.common import (
    add_peer_arguments,
    install_peers,
    peer_command,
    remote_config,
    start_vllm,
)
from experiments.harness.output import write_csv
from experiments.stable import interval
from serving.launch import ROOT, free_port, launch, shipped_spec

GATEWAYS = ("ours-precise", "ours-approx", "ours-hash", "ours-rr", "sglang-router", "vllm-router")
OURS = {"ours-precise": "prefix-precise", "ours-approx": "prefix-approx",
        "ours-hash": "prefix-hash", "ours-rr": "round-robin",
        "ours-precise-unscraped": "prefix-precise"}  # fmt: skip
UNSCRAPED = "-unscraped"
"""A gateway name's suffix: ours, reading no replica's /metrics (`--scrape-s 0`), beside one
that does, in the same rounds."""
BLOCK = 128


def start_gateway(
    stack: ExitStack, name: str, urls: list[str], events: list[str], folder: Path, peers: Path,
    model: str, scrape_s: float | None,
) -> str:  # fmt: skip
    """Gateway `name` on CPU 0 in front of `urls`, which publish their KV events at `events`;
    its URL, or "" where a peer is not there."""
    port = free_port()
    if name in OURS:
        # The replicas as one model, whose local tokenizer lets our gateway count
        # prompts and hash their blocks (vLLM's block size), and where they publish their KV
        # events (which only prefix-precise reads).
        config = remote_config(folder, urls, model=model, served=model, name="prefix-upstreams",
                               each=[{"kv_events": e,
                                      "scrape_s": 0.0 if name.endswith(UNSCRAPED) else scrape_s}
                                     for e in events],
                               engine_args={"block_size": BLOCK})  # fmt: skip
        command = [sys.executable, "-m", "serving", "--config", str(config),
                   "--deployment", "prefix-upstreams", "--policy", OURS[name],
                   # The peers shed nothing: neither does ours here (its deadline rule turned
                   # away a third of this load, free-tier's first-token budget being 0.25 s).
                   "--admission", "none",
                   "--port", str(port), "--h3-port", "0"]  # fmt: skip
        ready = "/readyz"
    else:
        binary = peer_command(name, peers)
        if binary is None:
            return ""
        # A port of its own for each one's Prometheus exporter: both default to 29000.
        command = [*binary, "--host", "127.0.0.1", "--port", str(port), "--policy",
                   "cache_aware", "--worker-urls", *urls,
                   "--prometheus-port", str(free_port())]  # fmt: skip
        ready = "/health"
    gateway = launch(name, command, port, ready, folder / f"{name}.log", cpus={0})
    stack.enter_context(gateway.ready(180))
    # Ready is not yet routing: sglang-router answers /health before its workers are checked,
    # and its first requests were 503s. Wait for a model list from each gateway first.
    for _ in range(120):
        if httpx.get(gateway.url + "/v1/models", timeout=10).status_code == 200:
            break
        time.sleep(0.5)
    return gateway.url


def prefix_counts(urls: list[str]) -> tuple[float, float]:
    """Prefix cache queries and hits (tokens) summed over the replicas."""
    queries = hits = 0.0
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for sample in family.samples:
                if sample.name == "vllm:prefix_cache_queries_total":
                    queries += sample.value
                elif sample.name == "vllm:prefix_cache_hits_total":
                    hits += sample.value
    return queries, hits


def workload_flags(args: argparse.Namespace) -> list[str]:
    """`workloads.replay`'s flags for this benchmark's requests (its `chat_workload`)."""
    return ["--conversations", "sharegpt-16", "--num-conversations", str(args.conversations),
            "--max-output-tokens", "16", "--max-prompt-tokens", "1900",
            "--seed", str(args.seed)]  # fmt: skip


def load(url: str, args: argparse.Namespace, out: Path) -> dict:
    command = [sys.executable, "-m", "workloads.replay", "--proto", "h1", "--url", url,
               *workload_flags(args), "--max-concurrency", str(args.concurrency),
               "--no-progress", "--out", str(out)]  # fmt: skip
    cpus = set(range(1, os.cpu_count() or 2)) or {0}
    subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                   preexec_fn=lambda: os.sched_setaffinity(0, cpus))  # fmt: skip
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gateways", default=",".join(GATEWAYS))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model", default="tiny-m", help="an embedded model")
    parser.add_argument("--kv-blocks", type=int, default=110)
    parser.add_argument(
        "--scrape-s", type=float, default=None,
        help="how often ours reads each replica's /metrics (default: the deployment's, 0.1 s; "
        "0: never, as the peers never do)",
    )  # fmt: skip
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--against", default="ours-precise",
        help="the gateway the others' paired differences are taken from (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lone", type=int, default=0, metavar="N",
        help="instead of the rounds: N lone requests (a short chat, one token) one at a time "
        "through each gateway and straight to the first replica, alternating: each gateway's "
        "own time on an idle path",
    )  # fmt: skip
    add_peer_arguments(parser, "prefix_gateways")
    args = parser.parse_args()
    if args.install_peers:
        install_peers(args.peers_venv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with ExitStack() as replicas:
        build = shipped_spec()["models"][args.model]["build"]
        per_token = 2 * build["num_layers"] * build["hidden_size"] * 4  # K and V, float32
        ports = [free_port() for _ in range(args.replicas)]
        events = [f"tcp://127.0.0.1:{port}" for port in ports]  # vLLM binds tcp://*:port
        # Per request: what it found cached (in its usage) and which replica served it (each
        # logs the id it answers with, which the peers pass on).
        flags = [("--dtype", "float32", "--block-size", str(BLOCK),
                  "--enable-prompt-tokens-details", "--enable-log-requests",
                  "--kv-cache-memory-bytes", str(args.kv_blocks * BLOCK * per_token),
                  "--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                    "publisher": "zmq",
                                                    "endpoint": f"tcp://*:{port}"}))
                 for port in ports]  # fmt: skip
        dev = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
        urls = start_vllm(replicas, args.out, [args.model, "auto"], flags, dev, args.model)
        if args.lone:
            print(lone(replicas, urls, events, args))
            return 0
        for round_ in range(args.rounds):
            for name in args.gateways.split(","):
                for url in urls:
                    httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()
                before = prefix_counts(urls)
                with ExitStack() as gateway:
                    front = start_gateway(
                        gateway,
                        name,
                        urls,
                        events,
                        args.out,
                        args.peers_venv,
                        args.model,
                        args.scrape_s,
                    )
                    if not front:
                        continue
                    record = load(front, args, args.out / f"{name}-{round_}.json")
                queries, hits = (a - b for a, b in zip(prefix_counts(urls), before, strict=True))
                s = record["summary"]
                rows.append({
                    "gateway": name, "round": round_, "sent": s["sent"],
                    "completed": s["completed"], "errored": s["errored"],
                    "mean_ttft_ms": s["mean_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
                    "hit_rate": hits / queries if queries else 0.0,
                })  # fmt: skip
                r = rows[-1]
                print(f"{name:>14} round {round_}: {r['completed']}/{r['sent']} done, "
                      f"{r['errored']} failed, mean TTFT {r['mean_ttft_ms']:.1f} ms, p99 "
                      f"{r['p99_ttft_ms']:.1f} ms, prefix cache hits {r['hit_rate']:.3f}",
                      flush=True)  # fmt: skip
    write_csv(args.out / "prefix_gateways.csv", rows)
    table = compare(rows, args.against)
    (args.out / "prefix_gateways.md").write_text(table)
    print(table)
    # The same requests, one by one: where the gateways' choices differ, and what each cost.
    choices = prefix_choices.report(prefix_choices.runs(args.out), args.against)
    (args.out / "prefix_choices.md").write_text(choices)
    print(choices)
    return 0


def lone(stack: ExitStack, urls: list[str], events: list[str], args: argparse.Namespace) -> str:
    """Every gateway up at once, then `args.lone` rounds of one short request through each in
    turn and one straight to the first replica, from CPU 1: each one's TTFT, and its median
    excess over the direct request's of the same round."""
    fronts = {"vLLM direct": urls[0]}
    for name in args.gateways.split(","):
        front = start_gateway(stack, name, urls, events, args.out, args.peers_venv, args.model,
                              args.scrape_s)  # fmt: skip
        if front:
            fronts[name] = front
    os.sched_setaffinity(0, {1} if (os.cpu_count() or 1) > 1 else {0})
    ttft: dict[str, list[float]] = {name: [] for name in fronts}
    with httpx.Client(timeout=60) as client:
        for i in range(args.lone + 3):  # the first 3 warm each path up
            for name, url in fronts.items():
                chat = [{"role": "user", "content": f"Hello number {i} {name}"}]
                body = {"model": "auto", "max_tokens": 1, "stream": True, "messages": chat}
                start = time.perf_counter()
                first = None
                with client.stream("POST", url + "/v1/chat/completions", json=body) as answer:
                    for line in answer.iter_lines():
                        if first is None and line.startswith('data: {"') and '"choices":[{' in line:
                            first = 1000 * (time.perf_counter() - start)
                if i >= 3 and first is not None:
                    ttft[name].append(first)
    direct = ttft["vLLM direct"]
    lines = [f"{args.lone} lone requests each, one at a time (TTFT, ms)", "",
             "| path | median | mean | median excess over direct |",
             "|---|---|---|---|"]  # fmt: skip
    for name, mine in ttft.items():
        excess = [a - b for a, b in zip(mine, direct, strict=False)]
        lines.append(f"| {name} | {np.median(mine):.1f} | {np.mean(mine):.1f} | "
                     f"{np.median(excess):+.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


METRICS = (("mean_ttft_ms", "mean TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"),
           ("hit_rate", "vLLM prefix hit rate"))  # fmt: skip


def compare(rows: list[dict], against: str) -> str:
    """Each gateway's mean over the rounds, and for each other gateway its paired difference
    from `against` round by round, with the 95% interval of the mean difference (Student's t
    over rounds; rounds run the gateways in turn, so a round's drift is shared)."""
    names = list(dict.fromkeys(r["gateway"] for r in rows))
    by = {(r["gateway"], r["round"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    lines = [f"{len(rounds)} interleaved round(s); difference = other - {against}, "
             "mean ± 95% interval (paired by round)", "",
             "| gateway | " + " | ".join(name for _, name in METRICS) + " |",
             "|---|" + "---|" * len(METRICS)]  # fmt: skip
    for gateway in names:
        cells = []
        for column, _ in METRICS:
            values = [by[gateway, k][column] for k in rounds if (gateway, k) in by]
            cell = f"{np.mean(values):.3f}" if column == "hit_rate" else f"{np.mean(values):.0f}"
            if gateway != against and (against, rounds[0]) in by:
                paired = [by[gateway, k][column] - by[against, k][column]
                          for k in rounds if (gateway, k) in by and (against, k) in by]  # fmt: skip
                digits = 3 if column == "hit_rate" else 0
                cell += f" ({np.mean(paired):+.{digits}f} ± {interval(paired):.{digits}f})"
            cells.append(cell)
        lines.append(f"| {gateway} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
