"""A fresh server's first requests: how long it takes to be ready, and what its first users meet.

Each run starts `python -m serving` for the deployment with its real deadlines and admission
control, times it from launch to the first 200 of /readyz, and at once sends one of:

- `first` (default): lm-eval's loglikelihood request (`POST /v1/completions`, echo, logprobs 1,
  max_tokens 1, no class header, so the free tier and its 2 s deadline) once to every model, then
  `--singles` chat requests of 4 tokens spread over the models in parallel bursts of one per
  model;
- `vllm-bench`: `vllm bench serve` at `--rate` x `--num-prompts` (random dataset, 64 tokens in,
  80 out, model auto), `--rounds` times in a row with the same requests, `--idle` seconds
  apart: the first on the cold server, the others on the same server warm, a baseline from the
  same machine;
- `lm-eval`: lm-eval's `local-completions` (`python -m serving.quality`) at lm-eval's defaults
  (one prompt a request, one request at a time, the free tier) over `--limit` items of each task.

and prints each status it got. `--runs` repeats it on a new server each time.

    python -m benchmarks.cold_start --runs 3 --then vllm-bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from config import DEFAULT_PATH, load_deployment
from experiments.harness.live import ROOT, VLLM_BENCH, requests_total, server

LOGLIKELIHOOD = {"prompt": "The cat sat on the mat", "max_tokens": 1, "echo": True, "logprobs": 1}
"""What lm-eval's local-completions sends to score a continuation."""


async def first_requests(url: str, models: list[str], singles: int) -> dict:
    """The loglikelihood request on every model, then `singles` chat requests in bursts."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def post(path: str, body: dict) -> tuple[int, float]:
            started = time.perf_counter()
            reply = await client.post(path, json=body)
            return reply.status_code, time.perf_counter() - started

        loglikelihood = {}
        for model in models:
            status, took = await post("/v1/completions", {"model": model, **LOGLIKELIHOOD})
            loglikelihood[model] = {"status": status, "seconds": round(took, 3)}
            print(f"loglikelihood on {model}: {status} in {took * 1000:.0f} ms", file=sys.stderr)
        statuses: Counter[int] = Counter()
        chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
        for burst in range(0, singles, len(models)):
            got = await asyncio.gather(
                *(
                    post("/v1/chat/completions", {"model": model, **chat})
                    for model in models[: singles - burst]
                )
            )
            statuses.update(status for status, _ in got)
    print(f"{singles} requests in bursts of {len(models)}: {dict(statuses)}", file=sys.stderr)
    return {"loglikelihood": loglikelihood, "singles": {str(k): n for k, n in statuses.items()}}


def vllm_bench(url: str, tokenizer: str, rate: float, n: int, seed: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", url,
         "--endpoint", "/v1/chat/completions", "--model", "auto", "--tokenizer", tokenizer,
         "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "80",
         "--ignore-eos", "--num-prompts", str(n), "--request-rate", str(rate),
         "--seed", str(seed), "--disable-tqdm"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-4000:]}")
    lines = done.stdout.splitlines()
    get: dict[str, object] = {
        key: next((line.split(":")[-1].strip() for line in lines if line.startswith(label)), None)
        for key, label in (
            ("successful", "Successful requests:"),
            ("failed", "Failed requests:"),
            ("median_ttft_ms", "Median TTFT (ms):"),
            ("output_throughput", "Output token throughput (tok/s):"),
        )
    }
    print(f"vllm bench serve at {rate:g} req/s x {n}: {get}", file=sys.stderr)
    # vllm bench prints the first ten errors, each on a line of its own.
    errors = [line for line in lines if line.startswith("Error ")]
    get["errors"] = errors
    for line in errors:
        print(f"  {line[:300]}", file=sys.stderr)
    return get


def lm_eval(url: str, limit: int) -> dict:
    """lm-eval's run, and how the server counted its requests (lm-eval retries a failed one, so
    a run that finishes may still have met errors)."""
    done = subprocess.run(
        [sys.executable, "-m", "serving.quality", "--url", url, "--limit", str(limit),
         "--batch-size", "1", "--num-concurrent", "1", "--qos-class", "free-tier",
         "--out", str(ROOT / "results" / "cold_start" / "quality.yaml")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    outcomes = dict(requests_total(url))
    print(done.stdout[-2000:], file=sys.stderr)
    print(f"lm-eval exited {done.returncode}; the server counted {outcomes}", file=sys.stderr)
    return {"returncode": done.returncode, "outcomes": outcomes, "stderr_tail": done.stderr[-2000:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_PATH))
    p.add_argument("--deployment", default="embedded")
    p.add_argument("--then", choices=["first", "vllm-bench", "lm-eval"], default="first")
    p.add_argument("--runs", type=int, default=1, help="each on a freshly started server")
    p.add_argument("--singles", type=int, default=100)
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--num-prompts", type=int, default=800)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="vllm-bench: runs one after the other on each server; the first meets it cold, the "
        "others warm, a baseline for the same machine",
    )
    p.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="vllm-bench: seconds idle between rounds (60 or more: the router's arrival-rate "
        "estimate and what admission control learned have faded, the engines are still warm)",
    )
    p.add_argument("--tokenizer", default=str(ROOT / ".models" / "tiny-m"))
    p.add_argument("--limit", type=int, default=20, help="lm-eval: items per task")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "cold_start.json")
    args = p.parse_args()
    models = load_deployment(args.config, args.deployment).models
    runs = []
    for run in range(args.runs):
        log = ROOT / "results" / "cold_start" / f"server-{run}.log"
        launched = time.monotonic()
        requests = log.with_name(f"requests-{run}.jsonl")
        extra = ["--config", args.config, "--request-log", str(requests)]
        with server(args.deployment, None, log, extra=extra, ready_path="/readyz") as live:
            ready_s = time.monotonic() - launched
            print(f"run {run}: /readyz 200 after {ready_s:.1f} s", file=sys.stderr)
            if args.then == "first":
                got = asyncio.run(first_requests(live.url, models, args.singles))
            elif args.then == "vllm-bench":
                rounds = []
                for round_ in range(args.rounds):
                    if round_:
                        time.sleep(args.idle)
                    # The same requests each round: the server is all that changes.
                    rounds.append(
                        vllm_bench(live.url, args.tokenizer, args.rate, args.num_prompts, run)
                    )
                got = {"rounds": rounds}
            else:
                got = lm_eval(live.url, args.limit)
        runs.append({"ready_s": round(ready_s, 1), **got})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.node()} {platform.machine()}"
    record = {"machine": machine, "args": vars(args), "runs": runs}
    args.out.write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
