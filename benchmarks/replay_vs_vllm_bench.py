"""`workloads.replay` against vLLM's own `vllm bench serve`: the same Poisson rate, the same
prompts and output lengths, the same endpoint, in alternating rounds.

A check of our measurement against a client no one here wrote: at each rate, the median over
rounds of each client's median TTFT, TPOT, ITL and E2EL should agree within 15% (the target),
over HTTP/1.1. Each client's round-to-round spread is printed beside it, because a
busy server varies from round to round whoever measures it. The workload is written once per
round as a `vllm bench serve` custom dataset (JSONL of prompt and output_tokens); each client then
draws its own Poisson arrival times at the same rate, so the two see statistically equal, not
identical, loads; the replay runs with --exact-rate, because vllm bench stretches its arrival
times so that N requests span exactly N / rate seconds. With --h3,
`workloads.replay --proto h3 --connections 4` joins the rotation.

A busy two-core server drifts from round to round, so two clients' medians can differ because
the server did, not because either measured wrong. With --server-log (the server's
`--request-log`), each client's requests are also found in the server's log (vllm bench names
its requests with x-request-id, the replay records the server's), and the table gains what
each client added to the server's own TTFT and E2E, request by request: a measure of the
client alone.

    make serve                                   # in another terminal
    python -m benchmarks.replay_vs_vllm_bench --rates 2,10,40 --rounds 5 --h3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

from experiments.harness.live import VLLM_BENCH
from workloads.arrivals import Poisson
from workloads.generate import TaskShape, WorkloadSpec, requests

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("ttft", "tpot", "itl", "e2el")
TOLERANCE = 0.15


def write_dataset(path: Path, args: argparse.Namespace, rate: float, n: int, seed: int) -> None:
    spec = WorkloadSpec(Poisson(rate), default_shape=TaskShape(None, (args.output_tokens,) * 2))
    with path.open("w") as f:
        for request in requests(spec, seed, limit=n):
            assert isinstance(request.prompt, tuple)  # workloads.generate makes chats
            row = {"prompt": request.prompt[-1].content, "output_tokens": request.max_tokens}
            f.write(json.dumps(row) + "\n")


def run_replay(
    args: argparse.Namespace, proto: str, rate: float, n: int, seed: int, out: Path
) -> dict[str, float]:
    url = args.url if proto == "h1" else args.h3_url
    extra = [] if proto == "h1" else ["--connections", "4", "--cacert", args.cacert]
    subprocess.run(
        [sys.executable, "-m", "workloads.replay", "--proto", proto, "--url", url,
         "--model", args.model, "--rate", str(rate), "--num-requests", str(n),
         "--output-tokens", f"{args.output_tokens}:{args.output_tokens}", "--seed", str(seed),
         "--exact-rate", "--out", str(out), "--no-progress", *extra],
        cwd=ROOT, check=False, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    record = json.loads(out.read_text())
    return {**record["summary"], "client": record["client"]}


def run_vllm_bench(
    args: argparse.Namespace, rate: float, n: int, seed: int, dataset: Path, out: Path
) -> dict[str, float]:
    tokenizer = args.tokenizer or str(ROOT / ".models" / args.model)
    done = subprocess.run(
        [sys.executable, "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", args.url,
         "--endpoint", "/v1/chat/completions", "--model", args.model, "--tokenizer", tokenizer,
         "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
         "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(n),
         "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos",
         "--percentile-metrics", ",".join(METRICS), "--save-result", "--save-detailed",
         "--request-id-prefix", f"{out.stem}-", "--result-dir", str(out.parent),
         "--result-filename", out.name, "--disable-tqdm"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def client_minus_server(who: str, result: dict, out: Path, log: dict[str, dict]) -> dict:
    """Median over requests of client TTFT - server TTFT and client E2EL - server E2E (ms)."""
    if who == "vllm":
        client = [
            (f"{out.stem}-{i}", ttft, latency)
            for i, (ttft, latency, error) in enumerate(
                zip(result["ttfts"], result["latencies"], result["errors"], strict=True)
            )
            if not error
        ]
    else:
        requests = json.loads(out.read_text())["requests"]
        client = [
            (r["server_request_id"], r["ttft_s"], r["e2el_s"])
            for r in requests
            if r["error_kind"] is None
        ]
    pairs = [(log[rid], ttft, e2el) for rid, ttft, e2el in client if rid in log]
    return {
        "matched": len(pairs),
        "ttft_ms": statistics.median((t - s["ttft_s"]) * 1000 for s, t, _ in pairs),
        "e2el_ms": statistics.median((e - s["e2e_s"]) * 1000 for s, _, e in pairs),
    }


def read_log(path: Path) -> dict[str, dict]:
    lines = (json.loads(line) for line in path.read_text().splitlines())
    return {line["request_id"]: line for line in lines if line["outcome"] == "ok"}


def server_cpu_s(url: str) -> float:
    """The server front-end process's CPU so far (its process_cpu_seconds_total)."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    raise SystemExit(f"{url}/metrics has no process_cpu_seconds_total")


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument("--h3-url", default="https://localhost:8443")
    p.add_argument("--cacert", default=str(ROOT / ".certs" / "cert.pem"))
    p.add_argument("--model", default="tiny-m", help="pinned, so every client hits one engine")
    p.add_argument("--tokenizer", help="for vllm bench (default: .models/MODEL)")
    p.add_argument("--rates", default="2,10,40", help="req/s, comma-separated")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per round")
    p.add_argument("--min-requests", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--h3", action="store_true", help="also replay over HTTP/3, 4 connections")
    p.add_argument("--server-log", type=Path, help="the server's --request-log, to join with")
    p.add_argument("--out", default="results/replay_vs_vllm_bench.json")
    args = p.parse_args()
    work = ROOT / "results" / "replay_vs_vllm_bench"
    work.mkdir(parents=True, exist_ok=True)
    clients = ["replay", "vllm"] + (["replay-h3"] if args.h3 else [])
    result: dict = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "args": vars(args),
        "rates": {},
    }
    for rate in (float(r) for r in args.rates.split(",")):
        n = max(args.min_requests, round(rate * args.duration))
        rounds = []
        for seed in range(args.rounds):
            dataset = work / f"dataset_{rate:g}_{seed}.jsonl"
            write_dataset(dataset, args, rate, n, seed)
            # Rotate who goes first, so drift on a busy machine favours no client.
            order = clients[seed % len(clients) :] + clients[: seed % len(clients)]
            got: dict[str, dict] = {}
            for who in order:
                print(f"{rate:g} req/s, round {seed}: {who}", file=sys.stderr)
                out = work / f"{who}_{rate:g}_{seed}.json"
                cpu = server_cpu_s(args.url)
                if who == "vllm":
                    got[who] = run_vllm_bench(args, rate, n, seed, dataset, out)
                else:
                    proto = "h1" if who == "replay" else "h3"
                    got[who] = run_replay(args, proto, rate, n, seed, out)
                tokens = got[who]["total_output_tokens"]
                got[who]["server_cpu_us_per_token"] = (server_cpu_s(args.url) - cpu) / tokens * 1e6
                if args.server_log:
                    log = read_log(args.server_log)
                    got[who]["over_server"] = client_minus_server(who, got[who], out, log)
                for detail in ("ttfts", "itls", "latencies", "start_times", "generated_texts"):
                    got[who].pop(detail, None)  # vllm bench's per-request lists: in its file
            rounds.append(got)
        result["rates"][f"{rate:g}"] = summarize_rate(rate, n, rounds, clients)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def summarize_rate(rate: float, n: int, rounds: list[dict], clients: list[str]) -> dict:
    """Print one rate's table and return it: medians over rounds, spreads, ratios to vllm."""
    table: dict = {"requests_per_round": n, "metrics": {}, "rounds": rounds}
    h3 = "replay-h3" in clients
    print(f"\n{rate:g} req/s, {len(rounds)} rounds of {n} requests; median over rounds (ms), "
          "round-to-round range in brackets")  # fmt: skip
    header = f"{'':<6}{'replay h1':>24}{'vllm bench':>24}{'h1/vllm':>9}"
    print(header + (f"{'replay h3, 4 conn':>26}{'h3/vllm':>9}" if h3 else ""))
    for metric in METRICS:
        key = f"median_{metric}_ms"
        row: dict = {}
        for who in clients:
            values = [r[who][key] for r in rounds]
            row[who] = {"median": statistics.median(values), "per_round": values}
        row["ratio_h1"] = row["replay"]["median"] / row["vllm"]["median"]
        row["within_tolerance"] = abs(row["ratio_h1"] - 1) <= TOLERANCE
        line = (
            f"{metric.upper():<6}"
            f"{row['replay']['median']:>10.1f} [{spread(row['replay']['per_round']):>11}]"
            f"{row['vllm']['median']:>10.1f} [{spread(row['vllm']['per_round']):>11}]"
            f"{row['ratio_h1']:>8.3f}{'' if row['within_tolerance'] else '!'}"
        )
        if h3:
            row["ratio_h3"] = row["replay-h3"]["median"] / row["vllm"]["median"]
            line += (
                f"{row['replay-h3']['median']:>12.1f} [{spread(row['replay-h3']['per_round']):>11}]"
                f"{row['ratio_h3']:>9.3f}"
            )
        print(line)
        table["metrics"][metric] = row
    failed = {
        who: [r[who]["errored"] if who != "vllm" else r[who]["failed"] for r in rounds]
        for who in clients
    }
    kept_up = {
        who: [r[who]["client"]["kept_up"] for r in rounds] for who in clients if who != "vllm"
    }
    cpu = {
        who: statistics.median(r[who]["server_cpu_us_per_token"] for r in rounds) for who in clients
    }
    print(f"failed requests per round: {failed}; replay kept up: {kept_up}")
    print(
        "server front-end CPU per output token, median over rounds: "
        + ", ".join(f"{who} {us:.0f} us" for who, us in cpu.items())
    )
    table["failed"], table["replay_kept_up"], table["server_cpu_us_per_token"] = (
        failed,
        kept_up,
        cpu,
    )
    if all("over_server" in r[who] for r in rounds for who in clients):
        print("client minus server, per request, median over requests then over rounds:")
        table["over_server"] = {}
        for who in clients:
            over = {
                m: statistics.median(r[who]["over_server"][f"{m}_ms"] for r in rounds)
                for m in ("ttft", "e2el")
            }
            table["over_server"][who] = over
            print(f"  {who:<10} TTFT +{over['ttft']:.2f} ms, E2EL +{over['e2el']:.2f} ms")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
