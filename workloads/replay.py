"""`python -m workloads.replay`: an open-loop load generator against a live endpoint.

Requests go out at their arrival times whether or not earlier ones have finished, over HTTP/3 (one
QUIC connection, a stream per request) or HTTP/1.1 (a connection per in-flight request), to the
server directly or through the edge front-end. Every request ends as one `Outcome`: completed, or
an error of a named kind; the summary counts both. Results go to JSON, a PNG and a printed table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from config import DEFAULT_PATH, ConfigError, Deployment, load_deployment
from transport.client import (
    ChatResult,
    Http3Client,
    StreamError,
    error_message,
    read_chat_stream,
    split_url,
    stream_chat,
)
from workloads.arrivals import (
    ArrivalProcess,
    Gamma,
    SwitchingRate,
    arrival_stats,
    maf1,
)
from workloads.generate import (
    Sessions,
    TaskShape,
    WorkloadSpec,
    from_trace,
    load_prompts,
    parse_mix,
    requests,
)
from workloads.metrics import Outcome, format_summary, summarize
from workloads.plots import plot_run
from workloads.request import Request
from workloads.traces import (
    DEFAULT_TRACE_DIR,
    TraceError,
    per_interval_counts,
    read_azure_trace,
    read_maf1_counts,
    resolve_trace,
)


def request_body(request: Request, model: str, ignore_eos: bool) -> dict[str, Any]:
    assert not isinstance(request.prompt, str)
    return {
        "model": model,
        "messages": [{"role": m.role, "content": m.content} for m in request.prompt],
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "task": request.task,
        "ignore_eos": ignore_eos,
    }


def request_headers(request: Request, api_key: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-qos-class": request.qos_class}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


class Client:
    """Sends one request and returns its `ChatResult`, over the chosen protocol."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.h3: Http3Client | None = None
        self.h1: httpx.AsyncClient | None = None

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Client]:
        verify: bool | str = self.args.cacert or not self.args.insecure
        if self.args.proto == "h3":
            host, port = split_url(self.args.url)
            async with Http3Client(host, port, verify=verify) as self.h3:
                yield self
        else:
            # No pool limit: an open loop must never queue requests behind a busy connection.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
            timeout = httpx.Timeout(self.args.timeout, connect=30)
            async with httpx.AsyncClient(
                base_url=self.args.url, verify=verify, limits=limits, timeout=timeout
            ) as self.h1:
                yield self

    async def send(self, request: Request) -> ChatResult:
        body = request_body(request, self.args.model, self.args.ignore_eos)
        headers = request_headers(request, self.args.api_key)
        if self.h3 is not None:
            extra = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens")}
            return await stream_chat(
                self.h3,
                body["messages"],
                model=self.args.model,
                max_tokens=request.max_tokens or 0,
                headers=headers,
                extra=extra,
            )
        assert self.h1 is not None
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with self.h1.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as response:
            result = ChatResult(
                "",
                response.headers.get("x-model"),
                response.headers.get("x-replica"),
                response.status_code,
                None,
                [],
            )
            if response.status_code != 200:
                result.error = error_message((await response.aread()).decode(errors="replace"))
                return result
            await read_chat_stream(response.aiter_lines(), result, start)
        return result


async def run_one(
    client: Client, request: Request, start: float, deployment: Deployment, timeout: float
) -> Outcome:
    loop = asyncio.get_running_loop()
    outcome = Outcome(
        request.request_id,
        request.qos_class,
        request.task,
        request.arrival,
        lag_s=max(0.0, loop.time() - start - request.arrival),
    )
    try:
        result = await asyncio.wait_for(client.send(request), timeout)
    except TimeoutError:
        outcome.error_kind, outcome.error = "timeout", f"no complete response in {timeout:g} s"
        return outcome
    except (StreamError, httpx.TransportError) as exc:
        outcome.error_kind, outcome.error = "connection", f"{type(exc).__name__}: {exc}"
        return outcome
    except Exception as exc:  # noqa: BLE001 - a malformed reply is this request's error, counted
        outcome.error_kind, outcome.error = "bad_response", f"{type(exc).__name__}: {exc}"
        return outcome
    outcome.status, outcome.model, outcome.replica = result.status, result.model, result.replica
    outcome.ttft_s, outcome.itl_s, outcome.e2el_s = result.ttft_s, result.itl_s, result.e2el_s
    usage = result.usage or {}
    outcome.prompt_tokens = usage.get("prompt_tokens", request.prompt_tokens)
    outcome.output_tokens = usage.get(
        "completion_tokens", len(result.itl_s) + (result.ttft_s is not None)
    )
    if result.error is not None:
        outcome.error_kind = f"http_{result.status}" if result.status != 200 else "stream"
        outcome.error = result.error
        return outcome
    # The SLO runs from the scheduled arrival, so a client that sends late cannot hide it.
    elapsed = outcome.lag_s + (result.e2el_s or 0.0)
    outcome.slo_met = deployment.slo.met(elapsed, outcome.output_tokens)
    outcome.reward = deployment.reward(
        request.task, result.model, request.qos_class, outcome.slo_met
    )
    return outcome


async def replay(
    workload: Sequence[Request],
    client: Client,
    deployment: Deployment,
    timeout: float,
    progress: bool = True,
) -> tuple[list[Outcome], float]:
    """Send every request at its arrival time; return the outcomes and the run's duration."""
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(workload), unit="req", disable=not progress, dynamic_ncols=True)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[Outcome]] = set()

    def finished(task: asyncio.Task[Outcome]) -> None:
        tasks.discard(task)
        outcome = task.result()
        outcomes.append(outcome)
        bar.update()
        errors = sum(not o.completed for o in outcomes)
        bar.set_postfix(in_flight=len(tasks), errors=errors, refresh=False)

    async with client.open():
        start = loop.time()
        for request in workload:
            delay = start + request.arrival - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(run_one(client, request, start, deployment, timeout))
            tasks.add(task)
            task.add_done_callback(finished)
        while tasks:
            await asyncio.wait(set(tasks))
        duration = loop.time() - start
    bar.close()
    return outcomes, duration


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    bounds = int(lo), int(hi or lo)
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return bounds


def build_workload(args: argparse.Namespace) -> tuple[WorkloadSpec, str]:
    """The spec the flags describe, and a one-line description of its arrivals."""
    shape = TaskShape(args.prompt_tokens, args.output_tokens)
    common: dict[str, Any] = {
        "tasks": parse_mix(args.tasks),
        "classes": parse_mix(args.classes),
        "default_shape": shape,
        "sessions": Sessions(turns=args.turns) if args.sessions else None,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_output_tokens": args.max_output_tokens,
    }
    if args.prompts_file:
        common["prompts"] = load_prompts(args.prompts_file)
    if args.arrivals == "trace":
        records = read_azure_trace(
            resolve_trace(args.trace, args.trace_dir),
            start_s=args.trace_start,
            duration_s=args.trace_window,
            time_scale=args.time_scale,
            target_rate=args.target_rate,
        )
        return from_trace(records, **common), f"trace {args.trace}"
    process: ArrivalProcess
    if args.arrivals in ("poisson", "gamma"):
        cv = 1.0 if args.arrivals == "poisson" else args.cv
        process, what = Gamma(args.rate, cv), f"{args.arrivals} {args.rate:g} req/s, CV {cv:g}"
    elif args.arrivals == "maf1":
        if args.maf1_file:
            counts = read_maf1_counts(args.maf1_file, args.top_functions)
            source = args.maf1_file
        else:
            trace = read_azure_trace(resolve_trace(args.trace, args.trace_dir))
            counts = per_interval_counts([r.arrival for r in trace], args.interval)
            source = f"per-{args.interval:g}s counts of trace {args.trace}"
        process = maf1(counts, args.interval, args.rate_scale, args.cv)
        what = f"MAF1-style from {source}, x{args.rate_scale:g}, CV {args.cv:g}"
    else:
        levels = tuple(float(x) for x in args.levels.split(","))
        process = SwitchingRate(levels, args.mean_level_s, args.cv)
        what = f"switching between {args.levels} req/s, mean {args.mean_level_s:g} s per level"
    return WorkloadSpec(arrivals=process, **common), what


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workloads.replay",
        description="Open-loop load against a live endpoint; prints vllm-bench-style metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    net = p.add_argument_group("endpoint")
    net.add_argument("--proto", choices=["h3", "h1"], default="h3")
    net.add_argument(
        "--url", help="default: https://localhost:8443 (h3), http://localhost:8000 (h1)"
    )
    net.add_argument("--cacert", help="trust this certificate (the server's .certs/cert.pem)")
    net.add_argument("--insecure", action="store_true", help="accept any certificate")
    net.add_argument(
        "--api-key",
        default=os.environ.get("QOS_PREMIUM_KEY"),
        help="bearer key whose tier grants the classes (default: $QOS_PREMIUM_KEY)",
    )
    net.add_argument("--model", default="auto", help="a model name, or auto for the router")
    net.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop early instead of generating max_tokens",
    )
    net.add_argument("--timeout", type=float, default=600, help="per-request limit, s")
    arr = p.add_argument_group("arrivals")
    arr.add_argument(
        "--arrivals", choices=["poisson", "gamma", "maf1", "switching", "trace"], default="poisson"
    )
    arr.add_argument("--rate", type=float, default=1.0, help="req/s (poisson, gamma)")
    arr.add_argument(
        "--cv",
        type=float,
        default=None,
        help="gap CV (gamma: 1; maf1: 4, AlpaServe's; switching: 1)",
    )
    arr.add_argument("--duration", type=float, default=None, help="stop generating after this, s")
    arr.add_argument("--num-requests", type=int, default=None, help="stop after this many")
    arr.add_argument("--seed", type=int, default=0)
    arr.add_argument("--trace", default="conv", help="code, conv or a CSV path")
    arr.add_argument("--trace-dir", default=str(DEFAULT_TRACE_DIR))
    arr.add_argument("--trace-start", type=float, default=0.0, help="window start, trace s")
    arr.add_argument("--trace-window", type=float, default=None, help="window length, trace s")
    arr.add_argument("--time-scale", type=float, default=1.0, help="replay k times faster")
    arr.add_argument("--target-rate", type=float, default=None, help="rescale to this req/s")
    arr.add_argument("--maf1-file", help="Azure Functions 2019 invocations_per_function CSV")
    arr.add_argument("--top-functions", type=int, default=None)
    arr.add_argument("--interval", type=float, default=60.0, help="MAF1 histogram interval, s")
    arr.add_argument("--rate-scale", type=float, default=1.0, help="MAF1 rate multiplier")
    arr.add_argument("--levels", default="0.25,0.5,1,2,4,8,16,32,48", help="switching rates")
    arr.add_argument("--mean-level-s", type=float, default=10.0, help="mean time at a level")
    con = p.add_argument_group("contents")
    con.add_argument("--tasks", default="hellaswag,copa,piqa,openbookqa", help="mix: a=3,b=1")
    con.add_argument("--classes", default="free-tier", help="QoS class mix: a=3,b=1")
    con.add_argument(
        "--prompt-tokens",
        type=_range,
        default=None,
        help="LO:HI prompt tokens (default: the examples' own length)",
    )
    con.add_argument("--output-tokens", type=_range, default=(32, 128), help="LO:HI")
    con.add_argument("--max-prompt-tokens", type=int, default=None)
    con.add_argument("--max-output-tokens", type=int, default=None)
    con.add_argument("--prompts-file", help='JSONL of {"task": ..., "prompt": ...} rows')
    con.add_argument("--sessions", action="store_true", help="multi-turn conversations")
    con.add_argument("--turns", type=_range, default=(2, 6), help="LO:HI turns per conversation")
    out = p.add_argument_group("output")
    out.add_argument("--config", default=str(DEFAULT_PATH), help="models.yaml, for SLO and reward")
    out.add_argument("--deployment", default=None, help="whose quality table scores the reward")
    out.add_argument("--window", type=int, default=20, help="requests per reward window")
    out.add_argument("--out", default="results/replay.json")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.url = args.url or (
        "https://localhost:8443" if args.proto == "h3" else "http://localhost:8000"
    )
    if args.cv is None:
        args.cv = 4.0 if args.arrivals == "maf1" else 1.0
    if (
        args.arrivals not in ("trace", "maf1")
        and args.duration is None
        and args.num_requests is None
    ):
        args.duration = 40.0  # seed 004's 40 s per rate
    try:
        deployment = load_deployment(args.config, args.deployment)
        spec, what = build_workload(args)
        workload = list(requests(spec, args.seed, args.duration, args.num_requests))
    except (ConfigError, TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not workload:
        print("error: the workload has no requests; raise --duration or --rate", file=sys.stderr)
        return 2
    stats = arrival_stats([r.arrival for r in workload])
    print(f"{what}: {stats}", file=sys.stderr)
    started = time.time()
    try:
        outcomes, duration = asyncio.run(
            replay(workload, Client(args), deployment, args.timeout, args.progress)
        )
    except (ConnectionError, OSError) as exc:
        print(f"error: cannot connect to {args.url} over {args.proto}: {exc!r}", file=sys.stderr)
        return 2
    summary = summarize(outcomes, duration, args.window)
    print(format_summary(summary, f"{args.proto} {args.url}"))
    record = {
        "started": started,
        "command": sys.argv,
        "arrivals": {"description": what, **asdict(stats)},
        "deployment": deployment.name,
        "summary": summary,
        "requests": [asdict(o) for o in sorted(outcomes, key=lambda o: o.arrival_s)],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    png = plot_run(record, out.with_suffix(".png"), f"{what} over {args.proto}")
    print(f"wrote {out} and {png}", file=sys.stderr)
    return 0 if summary["errored"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
