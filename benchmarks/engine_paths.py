"""`python -m benchmarks.engine_paths`: what a token costs on each way of reaching real vLLM
engines, to choose how several front-end workers should reach them, on one vLLM CPU engine of
the embedded deployment's tiny-s.

- `in-process`: `python -m serving`, the engine (vLLM's AsyncLLM) in the front-end's process;
- `engine host`: `python -m serving --separate-engines`, the engine in `serving.engine_host`,
  the one front-end worker reaching it over the engine link (what `--workers N` runs);
- `vllm serve`: vLLM's own OpenAI server for the engine, the front-end reaching it as a remote
  replica (HTTP/SSE, `RemoteEngine`).

The same closed loop of `--streams` streaming chat requests of `--tokens` tokens each runs for
`--seconds` against each. Every process's CPU is read from /proc, and sorted into the
front-end (the worker, and the supervisor), the engine's front (the process that holds
AsyncLLM: the front-end itself in-process, the engine host, or `vllm serve`'s API server) and
vLLM's EngineCore (the model's steps, the same work in all three). Reported: CPU µs per output
token of each, and their sum without EngineCore, which is what the way of reaching the engine
costs. Rounds interleave the three, so that the VM's drift falls on all alike.

    python -m benchmarks.engine_paths                     # 8 streams of 64 tokens, 20 s, 2 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

from experiments.harness.live import cpu_seconds
from serving.launch import ROOT, free_port, launch, serving_command, shipped_spec
from transport.process_tree import tree

PATHS = ("in-process", "engine host", "vllm serve")


def vllm_env() -> dict[str, str]:
    """`vllm serve`'s engine placed as `serving.engines.vllm_engine` places its own: its
    threads bound to every core but the last, and no dynamo (the same reasons as there)."""
    cores = sorted(os.sched_getaffinity(0))
    bind = ",".join(map(str, cores[:-1] or cores))
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": bind,
            "TORCHDYNAMO_DISABLE": "1"}  # fmt: skip


def config(folder: Path, upstream_port: int) -> Path:
    """models.yaml with two deployments of one tiny-s engine: its own (`bench_hosted`) and the
    `vllm serve` on `upstream_port` (`bench_remote`)."""
    spec = shipped_spec()
    spec["placements"]["bench_hosted"] = [
        {"model": "tiny-s", "device": "cpu", "kv_cache_gib": 0.25}
    ]
    spec["placements"]["bench_remote"] = [
        {"model": "tiny-s", "url": f"http://127.0.0.1:{upstream_port}/v1", "served_name": "tiny-s"}
    ]
    policy = {"name": "quality-threshold"}
    spec["deployments"]["bench_hosted"] = {
        "placement": "bench_hosted", "policy": policy, "admission": {"rule": "none"},
        "engine_args": {"enforce_eager": True, "max_model_len": 2048},
    }  # fmt: skip
    spec["deployments"]["bench_remote"] = {"placement": "bench_remote", "policy": policy,
                                           "admission": {"rule": "none"}}  # fmt: skip
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def roles(front: int, upstream: int | None) -> dict[int, str]:
    """Each process of the server (and the upstream), by its part."""
    found: dict[int, str] = {}
    for pid in tree(front) | (tree(upstream) if upstream else set()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if "EngineCore" in name or "EngineCore" in command:
            found[pid] = "engine core"
        elif "serving.engine_host" in command or pid == upstream:
            found[pid] = "engine front"
        elif "serving" in command:
            found[pid] = "front-end"
        else:
            found[pid] = "engine core"  # vLLM's other helpers: the engine's own work
    return found


async def load(url: str, streams: int, tokens: int, seconds: float) -> int:
    """Closed loop: `streams` streaming chat requests at a time for `seconds`; the output tokens
    of the requests that finished (each exactly `tokens`: `ignore_eos`). Tokens, not events: a
    server may carry several in one event."""
    body = {"model": "tiny-s", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": tokens, "ignore_eos": True, "stream": True}  # fmt: skip
    finished = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=120) as client:

        async def one() -> None:
            nonlocal finished
            while time.monotonic() < end:
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    events = [line async for line in r.aiter_lines() if line.startswith("data:")]
                    assert events[-1] == "data: [DONE]", events[-2:]
                    finished += 1

        await asyncio.gather(*(one() for _ in range(streams)))
    return finished * tokens


def measure(url: str, front: int, upstream: int | None, args: argparse.Namespace) -> dict:
    asyncio.run(load(url, args.streams, args.tokens, 3.0))  # warm
    parts = roles(front, upstream)
    before = {pid: cpu_seconds(pid) for pid in parts}
    received = asyncio.run(load(url, args.streams, args.tokens, args.seconds))
    spent: dict[str, float] = {}
    for pid, role in parts.items():
        spent[role] = spent.get(role, 0.0) + cpu_seconds(pid) - before[pid]
    per_token = {role: 1e6 * s / received for role, s in spent.items()}
    return {"tokens": received, "tokens_per_s": received / args.seconds} | per_token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_paths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "engine_paths")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "serving.embedded"], cwd=ROOT, check=True)
    upstream_port = free_port()
    models = config(args.out, upstream_port)
    template = args.out / "chat_template.jinja"
    template.write_text(yaml.safe_load((ROOT / "models.yaml").read_text())["chat_template"])
    rows: list[dict] = []
    for round_ in range(args.rounds):
        for path in PATHS:
            port = free_port()
            with ExitStack() as stack:
                upstream = None
                if path == "vllm serve":
                    command = [
                        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                        str(ROOT / ".models/tiny-s"), "--served-model-name", "tiny-s",
                        "--port", str(upstream_port), "--chat-template", str(template),
                        "--enforce-eager", "--max-model-len", "2048",
                        "--kv-cache-memory-bytes", str(256 * 2**20),
                    ]  # fmt: skip
                    served = stack.enter_context(launch("vllm-serve", command, upstream_port,
                                                        "/health", args.out / "vllm.log",
                                                        vllm_env()))  # fmt: skip
                    served.ready(300)
                    upstream = served.pid
                deployment = "bench_remote" if path == "vllm serve" else "bench_hosted"
                flags = ["--config", str(models), "--h3-port", "0", "--request-log", "off"]
                flags += ["--separate-engines"] if path == "engine host" else []
                front = stack.enter_context(launch("serving", serving_command(deployment, port,
                                                   *flags), port, "/readyz",
                                                   args.out / "serving.log"))  # fmt: skip
                front.ready(300)
                row = {"round": round_, "path": path}
                row |= measure(f"http://127.0.0.1:{port}", front.pid, upstream, args)
                rows.append(row)
                print(json.dumps(row), flush=True)
    (args.out / "engine_paths.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{args.streams} streams x {args.tokens} tokens, {args.seconds:g} s, "
          f"{args.rounds} rounds: CPU µs per output token, median over rounds\n")  # fmt: skip
    print("| path | tokens/s | front-end | engine's front | both | EngineCore |")
    print("|---|---|---|---|---|---|")
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]

        def median(key: str, of: list[dict] = mine) -> float:
            return statistics.median(r.get(key, 0.0) for r in of)

        ours, engine = median("front-end"), median("engine front")
        print(f"| {path} | {median('tokens_per_s'):.0f} | {ours:.0f} | {engine:.0f} "
              f"| {ours + engine:.0f} | {median('engine core'):.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
