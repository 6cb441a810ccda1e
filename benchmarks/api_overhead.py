"""What the gateway and the HTTP API cost on top of the engine, measured side by side.

Three paths serve the same requests (same prompt, same length, one pinned replica) in rounds that
alternate, so that drift on a noisy machine touches all three alike:
  engine   engine.generate() called in-process, no gateway
  gateway  Gateway.start() in-process: routing, accounting, the pump task
  api      HTTP/1.1 through uvicorn and the FastAPI app, streamed (SSE), from a client process

Each round keeps `--concurrency` streams open (a closed loop, like `vllm bench serve
--max-concurrency`): every worker sends its next request as soon as its last one ends, on the
same kept-alive connection. The HTTP client is a few lines over raw sockets, so that what it
costs itself stays out of the numbers.
Per path: p50 TTFT over all requests, and tokens/s per round (all tokens / round wall time).

    python -m benchmarks.api_overhead [--concurrency 16] [--rounds 10] [--model tiny-m]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Which ending is most likely? " * 4
QOS_CLASS = "long"  # the most patient class: the benchmark measures overhead, not deadlines

Stream = Callable[[int], Awaitable[tuple[float, int]]]
"""One request of the given length, start to end: returns (time to first token, tokens)."""


def length(mean: int, worker: int, k: int) -> int:
    """Output length of worker's k-th request: the same in every path, and spread out. Equal
    lengths would make all streams finish on the same step and restart as one burst."""
    return random.Random(f"{worker}/{k}").randint(mean // 2, mean * 3 // 2)


async def closed_loop(
    open_worker: Callable[[], Stream], concurrency: int, per_worker: int, mean_tokens: int
) -> dict:
    async def worker(w: int) -> list[tuple[float, int]]:
        stream = open_worker()
        return [await stream(length(mean_tokens, w, k)) for k in range(per_worker)]

    start = time.perf_counter()
    results = [
        r for rs in await asyncio.gather(*(worker(w) for w in range(concurrency))) for r in rs
    ]
    wall = time.perf_counter() - start
    return {"ttft": [r[0] for r in results], "tokens": sum(r[1] for r in results), "wall": wall}


def http_worker(port: int, model: str) -> Callable[[], Stream]:
    """Each worker keeps one connection open for all its requests, as OpenAI clients do; the
    connection is made before the first request's clock starts."""

    def open_worker() -> Stream:
        connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

        async def stream(max_tokens: int) -> tuple[float, int]:
            nonlocal connection
            if connection is None:
                connection = await asyncio.open_connection("127.0.0.1", port)
            reader, writer = connection
            body = json.dumps(
                {
                    "model": model,
                    "messages": [{"role": "user", "content": PROMPT}],
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            head = (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: application/json\r\nx-qos-class: {QOS_CLASS}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            start = time.perf_counter()
            writer.write(head + body)
            headers = await reader.readuntil(b"\r\n\r\n")
            if not headers.startswith(b"HTTP/1.1 200") or b"chunked" not in headers.lower():
                raise RuntimeError(headers.decode(errors="replace"))
            ttft, usage = None, b""
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                chunk = await reader.readexactly(size + 2)  # the data and its CRLF
                if ttft is None and b"data: {" in chunk:
                    ttft = time.perf_counter() - start
                if b'"usage"' in chunk:
                    usage = chunk
            await reader.readuntil(b"\r\n")  # the CRLF after the last, empty chunk
            event = next(line for line in usage.split(b"\n") if b'"usage"' in line)
            if ttft is None:
                raise RuntimeError("the stream ended without a token")
            return ttft, json.loads(event.removeprefix(b"data: "))["usage"]["completion_tokens"]

        return stream

    return open_worker


def in_process_stream(generate: Callable[[int], AsyncIterator]) -> Stream:
    async def stream(max_tokens: int) -> tuple[float, int]:
        start, ttft, tokens = time.perf_counter(), None, 0
        async for delta in generate(max_tokens):
            if ttft is None and delta.tokens:
                ttft = time.perf_counter() - start
            tokens += delta.tokens
        if ttft is None:
            raise RuntimeError("the stream ended without a token")
        return ttft, tokens

    return stream


async def run(args: argparse.Namespace) -> dict:
    import uvicorn

    from config import load_deployment
    from serving.app import build_app
    from serving.engines.base import Sampling
    from workloads import Message, Request

    deployment = load_deployment(args.config, args.deployment)
    app = build_app(deployment)
    gateway = app.state.gateway
    replica = next(r for r in gateway.replicas if r.model == args.model)
    port = args.port
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.2)

    if args.pin_frontend and len(os.sched_getaffinity(0)) > 1:
        # vLLM's default binding gives the engine every core but the last, which it leaves to
        # the front-end. Keep this thread (and the client processes it starts) there, as a GPU
        # host keeps its HTTP server off the accelerator, so the scheduler's migrations do not
        # add noise of their own. The engines started first and keep their own binding.
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    sampling = Sampling(ignore_eos=True)

    def request(max_tokens: int) -> Request:
        return Request(
            f"bench-{uuid.uuid4().hex}",
            gateway.clock(),
            (Message("user", PROMPT),),
            max_tokens,
            QOS_CLASS,
        )

    def engine_path(max_tokens: int) -> AsyncIterator:
        return replica.engine.generate(request(max_tokens), sampling)

    async def gateway_path(max_tokens: int) -> AsyncIterator:
        generation = await gateway.start(request(max_tokens), sampling, args.model)
        try:
            async for delta in generation:
                yield delta
            generation.delivered()
        finally:
            await generation.aclose()

    async def api_round() -> dict:
        # The client runs in a process of its own, as real clients do.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--client",
            str(port),
            "--model",
            args.model,
            "--concurrency",
            str(args.concurrency),
            "--per-worker",
            str(args.per_worker),
            "--max-tokens",
            str(args.max_tokens),
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        if proc.returncode:
            raise RuntimeError("client process failed")
        return json.loads(out)

    loop = (args.concurrency, args.per_worker, args.max_tokens)
    paths = {
        "engine": lambda: closed_loop(lambda: in_process_stream(engine_path), *loop),
        "gateway": lambda: closed_loop(lambda: in_process_stream(gateway_path), *loop),
        "api": api_round,
    }
    for run_path in paths.values():  # warm-up, not measured
        await run_path()
    results: dict[str, list[dict]] = {name: [] for name in paths}
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for name, run_path in paths.items():
            results[name].append(await run_path())

    server.should_exit = True
    await serving
    await gateway.replicas.close()
    return summarise(results, args)


def summarise(results: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    summary: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "model": args.model,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "per_worker": args.per_worker,
        "frontend_pinned": args.pin_frontend,
        "paths": {},
    }
    for name, rounds in results.items():
        ttfts = [t for r in rounds for t in r["ttft"]]
        rates = [r["tokens"] / r["wall"] for r in rounds]
        summary["paths"][name] = {
            "client_cpu_share": statistics.mean(
                r.get("client_cpu_s", 0) / r["wall"] for r in rounds
            ),
            "p50_ttft_ms": 1000 * statistics.median(ttfts),
            "tokens_per_s": statistics.mean(rates),
            "tokens_per_s_stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
        }
    base = summary["paths"]["engine"]
    for name, path in summary["paths"].items():
        path["added_p50_ttft_ms"] = path["p50_ttft_ms"] - base["p50_ttft_ms"]
        path["tokens_per_s_ratio"] = path["tokens_per_s"] / base["tokens_per_s"]
        # Paired by round: each round of a path against the engine round run just before it.
        added = [
            1000 * (statistics.median(r["ttft"]) - statistics.median(e["ttft"]))
            for r, e in zip(results[name], results["engine"], strict=True)
        ]
        ratio = [
            (r["tokens"] / r["wall"]) / (e["tokens"] / e["wall"])
            for r, e in zip(results[name], results["engine"], strict=True)
        ]
        path["paired_added_ttft_ms"] = _median_iqr(added)
        path["paired_tokens_per_s_ratio"] = _median_iqr(ratio)
    return summary


def _median_iqr(values: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"median": median, "q1": q1, "q3": q3}


def print_table(summary: dict) -> None:
    print(
        f"\n{summary['model']}, {summary['concurrency']} concurrent streams (closed loop), "
        f"{summary['max_tokens']} tokens on average, {summary['rounds']} rounds of "
        f"{summary['concurrency'] * summary['per_worker']} requests; {summary['machine']}"
    )
    print(
        f"{'path':8} {'p50 TTFT ms':>12} {'added ms':>9} {'tokens/s':>10} {'± sd':>7} "
        f"{'vs engine':>10}   {'paired by round: added ms [IQR]':>34}   ratio [IQR]"
    )
    for name, p in summary["paths"].items():
        a, r = p["paired_added_ttft_ms"], p["paired_tokens_per_s_ratio"]
        print(
            f"{name:8} {p['p50_ttft_ms']:12.1f} {p['added_p50_ttft_ms']:9.2f} "
            f"{p['tokens_per_s']:10.0f} {p['tokens_per_s_stdev']:7.0f} "
            f"{p['tokens_per_s_ratio']:10.3f}   {a['median']:14.2f} "
            f"[{a['q1']:6.2f}, {a['q3']:6.2f}]"
            f"   {r['median']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}]"
        )
    client = summary["paths"]["api"]["client_cpu_share"]
    print(
        f"the HTTP client process used {client:.0%} of a core during its rounds (on a "
        f"{os.cpu_count()}-core machine it shares the front-end's core)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(ROOT / "models.yaml"))
    parser.add_argument("--deployment", default="embedded")
    parser.add_argument("--model", default="tiny-m")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64, help="mean output length")
    parser.add_argument("--per-worker", type=int, default=3, help="requests per stream a round")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument(
        "--no-pin-frontend",
        dest="pin_frontend",
        action="store_false",
        help="let the OS place the front-end thread and the client",
    )
    parser.add_argument("--out", default=str(ROOT / "results" / "api_overhead.json"))
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)  # internal: a client round
    args = parser.parse_args()
    if args.client:
        result = asyncio.run(
            closed_loop(
                http_worker(args.client, args.model),
                args.concurrency,
                args.per_worker,
                args.max_tokens,
            )
        )
        usage = resource.getrusage(resource.RUSAGE_SELF)
        result["client_cpu_s"] = usage.ru_utime + usage.ru_stime
        print(json.dumps(result))
        return
    summary = asyncio.run(run(args))
    print_table(summary)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
