"""`python -m workloads.replay`: a load generator against a live endpoint.

Requests go out at their arrival times whether or not earlier ones have finished (open loop),
or, with `--max-concurrency N`, at most N at a time, as `vllm bench serve` sends them (closed
loop, `closed_loop`); with `--conversations`, a conversation's next turn goes out only when its
previous answer has ended. Over HTTP/3
(streams spread over `--connections` QUIC connections) or HTTP/1.1 (aiohttp, as `vllm bench serve`
uses, with a pool of keep-alive connections and no limit on their number), to the server directly
or through the edge front-end. Every request ends as one `Outcome`: completed, or an error of a
named kind; the summary counts both. Results go to JSON, a PNG and a printed table.

A load generator that falls behind measures itself, not the server. So the run reports how late
requests went out (send lag), how long HTTP/3 requests waited for stream credit, and how much of a
core the client used, and it says so, on screen and in the JSON, when any of them means the
server never saw the load that was asked of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
from tqdm import tqdm

from config import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_PATH,
    ConfigError,
    Deployment,
    deployment_serving,
    load_deployment,
)
from transport.client import Http3Pool, StreamError, split_url
from transport.qos import stream_spec
from transport.schedulers import SCHEDULERS
from workloads.arrivals import (
    ArrivalProcess,
    Gamma,
    SwitchingRate,
    arrival_stats,
    maf1,
)
from workloads.chat import ChatResult, chat_h1, chat_h2, chat_h3
from workloads.conversations import (
    SHAPES,
    conversations,
    first_turns,
    kubeai_benchmark_prompts,
    turns,
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
from workloads.lengths import ALL as LENGTHS
from workloads.request import Request, load_requests
from workloads.summary import Outcome, format_summary, summarize
from workloads.traces import (
    DEFAULT_TRACE_DIR,
    TraceError,
    per_interval_counts,
    read_azure_trace,
    read_maf1_counts,
    resolve_trace,
)


async def _content(response: httpx.Response) -> bytes:
    return response.content


def request_body(request: Request, model: str, ignore_eos: bool) -> dict[str, Any]:
    assert isinstance(request.prompt, tuple)  # it sends chat completions only
    return {
        "model": model,
        "messages": [{"role": m.role, "content": m.content} for m in request.prompt],
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "task": request.task,
        "ignore_eos": ignore_eos,
    } | (
        # Where the answer's length is known (a trace's, a drawn one), the model may not end
        # it sooner; the twin ends it there.
        {"min_tokens": max(1, min(request.answer_tokens, request.max_tokens or 2**31))}
        if request.answer_tokens is not None and not ignore_eos
        else {}
    )


def request_headers(request: Request, api_key: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-qos-class": request.qos_class}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


MAX_P99_LAG_S = 0.050
"""Past this p99 send lag (or HTTP/3 stream-credit wait), the run says the client could not
keep up."""
MAX_CLIENT_CPU = 0.90
"""Past this share of one core over the run, the run says the client was CPU-bound."""


class Client:
    """Sends one request and returns its `ChatResult`, over the chosen protocol."""

    def __init__(self, args: argparse.Namespace, deployment: Deployment) -> None:
        self.args, self.deployment = args, deployment
        self.h3: Http3Pool | None = None
        self.h2: httpx.AsyncClient | None = None
        # httpx opens a stream past the server's SETTINGS_MAX_CONCURRENT_STREAMS and fails the
        # request ("Max outbound streams is 100, 100 open") instead of waiting for one to close,
        # so the requests wait here, as HTTP/3's wait for stream credit.
        self.h2_streams = asyncio.Semaphore(args.h2_streams)
        self._draining: set[asyncio.Task[ChatResult]] = set()
        self.h1: aiohttp.ClientSession | None = None
        self.served_models: list[str] | None = None
        """The models the server's /v1/models listed when the client connected, less `auto`;
        asked only without --deployment (and always over HTTP/2, whose connection it opens)."""
        self.models_error = "it was not asked"
        self.run_started: float | None = None
        """time.time() at arrival 0, once connected: the clock of the outcomes' times."""

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Client]:
        verify: bool | str = not self.args.insecure and (self.args.cacert or True)
        if self.args.proto == "h3":
            host, port = split_url(self.args.url)
            others = [split_url(url) for url in self.args.also_url]
            async with Http3Pool(
                host, port, self.args.connections, others, verify=verify,
                scheduler=self.args.scheduler, congestion_control=self.args.congestion_control,
            ) as self.h3:  # fmt: skip
                if self.args.deployment is None:
                    await self._ask_models(self._models_h3)
                yield self
        elif self.args.proto == "h2":
            # One connection for every request, as a browser keeps one per origin: past the
            # server's concurrent-stream limit a request waits for a stream, with no pool
            # timeout (the run's --timeout bounds it).
            async with httpx.AsyncClient(
                http1=False, http2=True, verify=_ssl_context(verify),
                limits=httpx.Limits(max_connections=1),
                timeout=httpx.Timeout(None, connect=30),
            ) as self.h2:  # fmt: skip
                # Open it before the first request, as HTTP/3's pool does: the run times the
                # requests, not the handshake.
                opened = await self.h2.get(self.args.url + "/v1/models", timeout=30)
                await self._ask_models(lambda: _content(opened))
                yield self
        else:
            # As `vllm bench serve`: keep-alive connections, as many as requests in flight (an
            # open loop must never queue behind a busy connection), the same idle timeout.
            # --connection-per-request closes each after its response, as a client that keeps
            # none alive pays the TCP (and TLS) handshake every time.
            connector = aiohttp.TCPConnector(
                limit=0, keepalive_timeout=None if self.args.connection_per_request else 60,
                force_close=self.args.connection_per_request, enable_cleanup_closed=True,
                ssl=_ssl_context(verify),
            )  # fmt: skip
            timeout = aiohttp.ClientTimeout(total=None, connect=30)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as self.h1:
                if self.args.deployment is None:
                    await self._ask_models(self._models_h1)
                yield self

    async def _ask_models(self, fetch: Callable[[], Awaitable[bytes]]) -> None:
        """Fill in `served_models`, or say in `models_error` why not; the run goes on either
        way, and a server that cannot be reached fails its requests, each counted."""
        try:
            cards = json.loads(await fetch())["data"]
            self.served_models = [card["id"] for card in cards if card["id"] != "auto"]
        except (StreamError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            self.models_error = f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, TypeError) as exc:  # not JSON, not OpenAI's model list
            self.models_error = f"its /v1/models was not a model list ({exc!r})"

    def _headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}

    async def _models_h3(self) -> bytes:
        assert self.h3 is not None
        response = await asyncio.wait_for(self.h3.request("GET", "/v1/models", self._headers()), 30)
        return await response.read()

    async def _models_h1(self) -> bytes:
        assert self.h1 is not None
        limit = aiohttp.ClientTimeout(total=30)
        url = self.args.url + "/v1/models"
        async with self.h1.get(url, headers=self._headers(), timeout=limit) as response:
            return await response.read()

    async def send(self, request: Request) -> ChatResult:
        body = request_body(request, self.args.model, self.args.ignore_eos)
        headers = request_headers(request, self.args.api_key)
        if self.h3 is not None:
            qos = self.deployment.qos_classes.get(request.qos_class)
            spec = stream_spec(qos, time.monotonic()) if qos is not None else None
            return await chat_h3(self.h3, body, headers, spec=spec)
        if self.h2 is not None:
            return await self._send_h2(body, headers)
        assert self.h1 is not None
        return await chat_h1(self.h1, self.args.url, body, headers)

    async def _send_h2(self, body: dict[str, Any], headers: dict[str, str]) -> ChatResult:
        """One request on the HTTP/2 connection, once a stream is free. A request cut by its
        timeout is read to its end in the background, holding its stream: httpx abandons a
        stream without resetting it, so the connection would count it open, and a later
        request would fail on the stream limit, the same as above."""
        assert self.h2 is not None
        queued = time.perf_counter()
        await self.h2_streams.acquire()
        waited = time.perf_counter() - queued
        task = asyncio.ensure_future(chat_h2(self.h2, self.args.url, body, headers))
        self._draining.add(task)
        task.add_done_callback(self._drained)
        result = await asyncio.shield(task)
        result.credit_wait_s = waited
        return result

    def _drained(self, task: asyncio.Task[ChatResult]) -> None:
        self._draining.discard(task)
        self.h2_streams.release()
        if not task.cancelled():
            task.exception()  # retrieved here too: the waiter may have been cut and gone


def _ssl_context(verify: bool | str) -> ssl.SSLContext:
    """TLS over TCP: the system's trust, one certificate's (a path), or none (False)."""
    context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
    if verify is False:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


async def run_one(
    client: Client, request: Request, start: float, deployment: Deployment, timeout: float
) -> Outcome:
    outcome = Outcome(
        request.request_id,
        request.qos_class,
        request.task,
        request.arrival,
        lag_s=max(0.0, time.perf_counter() - start - request.arrival),
    )
    try:
        result = await asyncio.wait_for(client.send(request), timeout)
    except TimeoutError:
        outcome.error_kind, outcome.error = "timeout", f"no complete response in {timeout:g} s"
        return outcome
    except (StreamError, aiohttp.ClientError, httpx.TransportError, OSError) as exc:
        outcome.error_kind, outcome.error = "connection", f"{type(exc).__name__}: {exc}"
        outcome.connection = getattr(exc, "connection", None)
        return outcome
    except Exception as exc:  # noqa: BLE001 - a malformed reply is this request's error, counted
        outcome.error_kind, outcome.error = "bad_response", f"{type(exc).__name__}: {exc}"
        return outcome
    finally:
        outcome.end_s = time.perf_counter() - start
    outcome.connection = result.connection
    outcome.status, outcome.model, outcome.replica = result.status, result.model, result.replica
    outcome.server_request_id, outcome.response_id = result.request_id, result.response_id
    outcome.credit_wait_s = result.credit_wait_s
    outcome.ttft_s, outcome.itl_s, outcome.e2el_s = result.ttft_s, result.itl_s, result.e2el_s
    usage = result.usage or {}
    outcome.prompt_tokens = usage.get("prompt_tokens", request.prompt_tokens)
    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    outcome.output_tokens = usage.get(
        "completion_tokens", len(result.itl_s) + (result.ttft_s is not None)
    )
    if result.error is not None:
        outcome.error_kind = f"http_{result.status}" if result.status != 200 else "stream"
        outcome.error = result.error
        return outcome
    # The SLO runs from the scheduled arrival, so a client that sends late or waits for stream
    # credit cannot hide it.
    elapsed = outcome.lag_s + outcome.credit_wait_s + (result.e2el_s or 0.0)
    outcome.slo_met = deployment.slo.met(elapsed, outcome.output_tokens)
    outcome.reward = deployment.reward(
        request.task, result.model, request.qos_class, outcome.slo_met
    )
    return outcome


async def closed_loop(
    workload: Sequence[Request],
    send: Callable[[Request], Awaitable[Outcome]],
    start: float,
    concurrency: int | None,
    ordered: bool,
) -> list[Outcome]:
    """Send `workload` with at most `concurrency` requests in flight (None: no limit), each
    request ready at its arrival time and sent, in the order they became ready, as soon as a
    slot is free. With `ordered`, a session's requests after its first are ready only when the
    one before has ended. Each request is sent with its arrival set to when it went out
    (seconds since `start`, perf_counter), so that its TTFT and SLO count from there, as vLLM's
    benchmark counts them, not from a wait for a slot that the client imposed."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {concurrency}")
    first, later = first_turns(workload, ordered)
    ready: asyncio.Queue[Request] = asyncio.Queue()
    slots = asyncio.Semaphore(concurrency or len(workload))
    outcomes: list[Outcome] = []

    async def arrive() -> None:
        for request in first:
            delay = start + request.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            ready.put_nowait(request)

    async def one(request: Request) -> None:
        try:
            outcomes.append(await send(replace(request, arrival=time.perf_counter() - start)))
        finally:
            slots.release()
            rest = later.get(request.session_id or "")
            if rest:
                ready.put_nowait(rest.popleft())

    arrivals = asyncio.create_task(arrive())
    tasks: set[asyncio.Task[None]] = set()
    try:
        for _ in range(len(workload)):
            request = await ready.get()
            await slots.acquire()
            task = asyncio.create_task(one(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.wait(set(tasks))
    finally:
        arrivals.cancel()
    return outcomes


async def replay(
    workload: Sequence[Request],
    client: Client,
    deployment: Deployment,
    timeout: float,
    progress: bool = True,
    start_at: float | None = None,
    max_concurrency: int | None = None,
    ordered: bool = False,
) -> tuple[list[Outcome], float, float]:
    """Send every request at its arrival time (or as `closed_loop` does, with `max_concurrency`
    or `ordered`); return the outcomes, the run's duration and the CPU time this process spent
    on it (all threads), both in seconds. `start_at`: the wall-clock time (time.time()) that
    arrival 0 is, once connected, so that load generators in several processes (one per
    emulated client) send on one clock."""
    outcomes: list[Outcome] = []
    bar = tqdm(total=len(workload), unit="req", disable=not progress, dynamic_ncols=True)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[Outcome]] = set()
    errors = 0

    def finished(task: asyncio.Task[Outcome]) -> None:
        nonlocal errors
        tasks.discard(task)
        outcome = task.result()
        outcomes.append(outcome)
        errors += not outcome.completed
        bar.update()
        bar.set_postfix(in_flight=len(tasks), errors=errors, refresh=False)

    async with client.open():
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu = time.process_time()
        start = time.perf_counter()
        client.run_started = time.time()
        if max_concurrency is not None or ordered:

            async def send(request: Request) -> Outcome:
                outcome = await run_one(client, request, start, deployment, timeout)
                bar.update()
                return outcome

            outcomes = await closed_loop(workload, send, start, max_concurrency, ordered)
            workload = ()
        for request in workload:
            delay = start + request.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(run_one(client, request, start, deployment, timeout))
            tasks.add(task)
            task.add_done_callback(finished)
        while tasks:
            await asyncio.wait(set(tasks))
        duration = time.perf_counter() - start
        cpu = time.process_time() - cpu
    bar.close()
    return outcomes, duration, cpu


def client_health(outcomes: Sequence[Outcome], duration_s: float, cpu_s: float) -> dict:
    """How the client itself fared, and a warning for each way it may have fallen behind."""
    lags = [o.lag_s for o in outcomes]
    waits = [o.credit_wait_s for o in outcomes]
    p99_lag = float(np.percentile(lags, 99)) if lags else 0.0
    p99_wait = float(np.percentile(waits, 99)) if waits else 0.0
    cpu_share = cpu_s / duration_s if duration_s > 0 else 0.0
    waited = sum(w > 0 for w in waits)
    warnings = []
    if p99_lag > MAX_P99_LAG_S:
        warnings.append(
            f"the client sent late: p99 send lag {p99_lag * 1000:.0f} ms "
            f"(over {MAX_P99_LAG_S * 1000:.0f} ms)"
        )
    if cpu_share > MAX_CLIENT_CPU:
        warnings.append(
            f"the client used {cpu_share:.0%} of a core (over {MAX_CLIENT_CPU:.0%}): "
            "it may have timed itself, not the server"
        )
    if p99_wait > MAX_P99_LAG_S:
        warnings.append(
            f"{waited} requests waited for stream credit, p99 {p99_wait * 1000:.0f} ms: "
            "the server saw them late; raise --connections (h3) or --h2-streams (h2)"
        )
    return {
        "p99_lag_ms": p99_lag * 1000,
        "p99_credit_wait_ms": p99_wait * 1000,
        "cpu_s": cpu_s,
        "cpu_share_of_core": cpu_share,
        "credit_waited": waited,
        "mean_credit_wait_ms": float(np.mean(waits)) * 1000 if waits else 0.0,
        "max_credit_wait_ms": max(waits, default=0.0) * 1000,
        "kept_up": not warnings,
        "warnings": warnings,
    }


def deployment_served(
    config: str, client: Client, fallback: Deployment
) -> tuple[Deployment, str | None]:
    """The deployment of models.yaml that the server serves, from the models its /v1/models
    listed when `client` connected; or `fallback` and why the answers cannot be scored (another
    server, say a bare `vllm serve`, or a models.yaml that is not the server's)."""
    if client.served_models is None:
        return fallback, f"the server did not list its models ({client.models_error})"
    try:
        return deployment_serving(config, client.served_models), None
    except ConfigError as exc:
        return fallback, str(exc)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    bounds = int(lo), int(hi or lo)
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return bounds


def build_workload(
    args: argparse.Namespace, context: int = DEFAULT_MAX_MODEL_LEN
) -> tuple[WorkloadSpec, str]:
    """The spec the flags describe, and a one-line description of its arrivals; `context`: the
    deployment's, which --lengths fits requests into."""
    shape = TaskShape(args.prompt_tokens, args.output_tokens)
    common: dict[str, Any] = {
        "tasks": parse_mix(args.tasks),
        "classes": parse_mix(args.classes),
        "default_shape": shape,
        "sessions": Sessions(turns=args.turns) if args.sessions else None,
        "max_prompt_tokens": args.max_prompt_tokens,
        "max_output_tokens": args.max_output_tokens,
    }
    if args.lengths:
        common |= {"lengths": LENGTHS[args.lengths], "context": context}
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


def chat_workload(args: argparse.Namespace) -> tuple[list[Request], str]:
    """`--conversations` or `--kubeai-benchmark` (workloads.conversations), with arrival times:
    Poisson at --rate where it was given, else all at once."""
    rate_given = args.rate is not None
    qos_class = next(iter(parse_mix(args.classes)))
    if args.kubeai_benchmark:
        convs = conversations(SHAPES["sharegpt-16"], 150, args.seed)
        chosen = kubeai_benchmark_prompts(
            convs, 800, args.num_requests or 8000, args.seed, qos_class=qos_class
        )
        what = f"KubeAI's benchmark, {len(chosen)} requests"
    else:
        convs = conversations(SHAPES[args.conversations], args.num_conversations, args.seed)
        chosen = turns(convs, qos_class, max_prompt_tokens=args.max_prompt_tokens)
        what = f"{args.num_conversations} {args.conversations} conversations, {len(chosen)} turns"
    starts = len(chosen) if args.kubeai_benchmark else args.num_conversations
    gaps = np.random.default_rng([args.seed, 9]).exponential(1 / (args.rate or 1.0), starts)
    times = iter(np.cumsum(gaps) if rate_given else np.zeros(starts))
    cap = args.max_output_tokens
    out, seen = [], set()
    for request in chosen:
        first = args.kubeai_benchmark or request.session_id not in seen
        seen.add(request.session_id)
        tokens = request.max_tokens if cap is None else min(cap, request.max_tokens or cap)
        out.append(
            replace(request, arrival=float(next(times)) if first else 0.0, max_tokens=tokens)
        )
    return out, what + (f", arriving at {args.rate:g}/s" if rate_given else "")


def exact_rate(workload: list[Request], args: argparse.Namespace) -> list[Request]:
    """The workload with its arrivals scaled so the last one comes at N / rate (`--exact-rate`)."""
    if args.arrivals not in ("poisson", "gamma") or args.num_requests is None:
        raise ValueError("--exact-rate needs --arrivals poisson or gamma and --num-requests")
    if not workload or workload[-1].arrival <= 0:
        return workload
    factor = len(workload) / args.rate / workload[-1].arrival
    return [replace(r, arrival=r.arrival * factor) for r in workload]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workloads.replay",
        description="Open-loop load against a live endpoint; prints vllm-bench-style metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    net = p.add_argument_group("endpoint")
    net.add_argument(
        "--proto",
        choices=["h3", "h2", "h1"],
        default="h3",
        help="h2: HTTP/2 over TLS (an https:// --url), every request on one connection",
    )
    net.add_argument(
        "--h2-streams",
        type=int,
        default=100,
        help="h2: requests in flight at once on the connection, the server's "
        "SETTINGS_MAX_CONCURRENT_STREAMS (hypercorn's default); the rest wait in the client",
    )
    net.add_argument(
        "--connection-per-request",
        action="store_true",
        help="h1: a new connection for each request (no keep-alive), handshakes and all",
    )
    net.add_argument(
        "--scheduler",
        choices=sorted(SCHEDULERS),
        default="rr",
        help="h3: the client's stream scheduler, which orders the uploads by QoS class",
    )
    net.add_argument("--congestion-control", choices=["reno", "cubic"], default="reno", help="h3's")
    net.add_argument(
        "--also-url",
        action="append",
        default=[],
        metavar="URL",
        help="h3: another address of the same service (a second front-end host); the "
        "connections spread evenly over --url and these, and requests go to each in turn",
    )
    net.add_argument(
        "--connections",
        type=int,
        default=1,
        help="h3: QUIC connections to spread the streams over; each carries up to the server's "
        "stream limit (128 for ours) at once, and a request past that waits for credit",
    )
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
    net.add_argument(
        "--start-at",
        type=float,
        metavar="UNIX_TIME",
        help="once connected, wait for this wall-clock time to send arrival 0: several load "
        "generators then share one clock",
    )
    arr = p.add_argument_group("arrivals")
    arr.add_argument(
        "--arrivals", choices=["poisson", "gamma", "maf1", "switching", "trace"], default="poisson"
    )
    arr.add_argument(
        "--rate",
        type=float,
        default=None,
        help="req/s (poisson, gamma; default 1); with --conversations or --kubeai-benchmark, "
        "their arrivals (default: all at once)",
    )
    arr.add_argument(
        "--cv",
        type=float,
        default=None,
        help="gap CV (gamma: 1; maf1: 4, AlpaServe's; switching: 1)",
    )
    arr.add_argument("--duration", type=float, default=None, help="stop generating after this, s")
    arr.add_argument("--num-requests", type=int, default=None, help="stop after this many")
    arr.add_argument(
        "--exact-rate",
        action="store_true",
        help="poisson, gamma with --num-requests: stretch the arrival times so that the N "
        "requests span exactly N / rate seconds, as vllm bench serve does; runs at one rate "
        "then vary less from seed to seed",
    )
    arr.add_argument("--seed", type=int, default=0)
    arr.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="closed loop: at most this many requests in flight, as vllm bench serve's",
    )
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
    con.add_argument(
        "--requests",
        help="send exactly these requests (JSON lines, as workloads.request.save_requests writes "
        "them), in place of the arrival and contents flags",
    )
    con.add_argument("--tasks", default="hellaswag,copa,piqa,openbookqa", help="mix: a=3,b=1")
    con.add_argument("--classes", default="free-tier", help="QoS class mix: a=3,b=1")
    con.add_argument(
        "--prompt-tokens",
        type=_range,
        default=None,
        help="LO:HI prompt tokens (default: the examples' own length)",
    )
    con.add_argument("--output-tokens", type=_range, default=(32, 128), help="LO:HI")
    con.add_argument(
        "--lengths",
        choices=list(LENGTHS),
        help="prompt and answer lengths and max_tokens of a workloads.lengths distribution, in "
        "place of --prompt-tokens and --output-tokens, fitted to the deployment's context; each "
        "answer ends at its drawn length (sent as min_tokens): implies --no-ignore-eos",
    )
    con.add_argument("--max-prompt-tokens", type=int, default=None)
    con.add_argument("--max-output-tokens", type=int, default=None)
    con.add_argument("--prompts-file", help='JSONL of {"task": ..., "prompt": ...} rows')
    con.add_argument("--sessions", action="store_true", help="multi-turn conversations")
    con.add_argument(
        "--conversations",
        choices=sorted(SHAPES),
        help="conversations shaped like a published chat dataset, every turn carrying the "
        "history; each next turn sent when the previous answer ended; their first turns arrive "
        "at --rate (Poisson), all at once without it",
    )
    con.add_argument("--num-conversations", type=int, default=100)
    con.add_argument(
        "--kubeai-benchmark",
        action="store_true",
        help="KubeAI's benchmark requests: 800 prompts cut from sharegpt-16 conversations, "
        "repeated in shuffled passes to --num-requests (default 8,000), arriving at --rate",
    )
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
    args.url = args.url or {
        "h3": "https://localhost:8443", "h2": "https://localhost:8000", "h1": "http://localhost:8000"
    }[args.proto]  # fmt: skip
    if args.proto == "h2" and not args.url.startswith("https://"):
        print("error: --proto h2 is HTTP/2 over TLS: give an https:// --url (a server with "
              "--tls)", file=sys.stderr)  # fmt: skip
        return 2
    if args.h2_streams < 1:
        print("error: --h2-streams must be at least 1", file=sys.stderr)
        return 2
    if args.also_url and (args.proto != "h3" or args.connections < 1 + len(args.also_url)):
        print("error: --also-url is for --proto h3, with a --connections per address at least",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.connection_per_request and args.proto != "h1":
        print("error: --connection-per-request is for --proto h1", file=sys.stderr)
        return 2
    if args.cv is None:
        args.cv = 4.0 if args.arrivals == "maf1" else 1.0
    if args.lengths:
        args.ignore_eos = False  # the answers' lengths are drawn: max_tokens is only a cap
    if (
        args.arrivals not in ("trace", "maf1")
        and args.duration is None
        and args.num_requests is None
    ):
        args.duration = 40.0  # 40 s per rate, as in Chuppala (2024)
    try:
        # Without --deployment, the file's default, for the SLO and the classes, until the
        # server has said which deployment it is.
        deployment = load_deployment(args.config, args.deployment)
        if args.requests:
            workload, what = load_requests(args.requests), f"the requests of {args.requests}"
        elif args.conversations or args.kubeai_benchmark:
            workload, what = chat_workload(args)
        else:
            args.rate = 1.0 if args.rate is None else args.rate
            spec, what = build_workload(args, deployment.max_model_len)
            workload = list(requests(spec, args.seed, args.duration, args.num_requests))
            if args.exact_rate:
                workload = exact_rate(workload, args)
    except (ConfigError, TraceError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not workload:
        print("error: the workload has no requests; raise --duration or --rate", file=sys.stderr)
        return 2
    stats = arrival_stats([r.arrival for r in workload])
    print(f"{what}: {stats}", file=sys.stderr)
    if args.connections < 1:
        print("error: --connections must be at least 1", file=sys.stderr)
        return 2
    started = time.time()
    client = Client(args, deployment)
    try:
        outcomes, duration, cpu = asyncio.run(
            replay(
                workload,
                client,
                deployment,
                args.timeout,
                args.progress,
                args.start_at,
                args.max_concurrency,
                ordered=args.conversations is not None,
            )
        )
    except (ConnectionError, OSError, StreamError, httpx.TransportError) as exc:
        print(f"error: cannot connect to {args.url} over {args.proto}: {exc!r}", file=sys.stderr)
        return 2
    unscored = None
    if args.deployment is None:
        # The SLO and the classes are the file's: only the rewards depend on the deployment.
        deployment, unscored = deployment_served(args.config, client, deployment)
        if unscored is None:
            print(f"scored with deployment {deployment.name}, whose models the server serves")
            for o in outcomes:
                o.reward = deployment.reward(o.task, o.model, o.qos_class, o.slo_met)
    summary = summarize(outcomes, duration, args.window, scored=unscored is None)
    health = client_health(outcomes, duration, cpu)
    print(format_summary(summary, f"{args.proto} {args.url}"))
    if unscored is not None:
        print(f"No reward: {unscored}; name the deployment with --deployment.")
    print(
        f"client: p99 send lag {health['p99_lag_ms']:.1f} ms, {health['cpu_share_of_core']:.0%} "
        f"of a core, {health['credit_waited']} requests waited for stream credit"
    )
    for warning in health["warnings"]:
        print(f"WARNING: {warning}")
    record = {
        "started": started,
        "run_started": client.run_started,
        "command": sys.argv,
        "arrivals": {"description": what, **asdict(stats)},
        "deployment": deployment.name if unscored is None else None,
        "client": health,
        "summary": summary,
        "requests": [asdict(o) for o in sorted(outcomes, key=lambda o: o.arrival_s)],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    # matplotlib is a third of the replay's start-up; a run that fails its arguments never plots.
    from workloads.plots import plot_run

    png = plot_run(record, out.with_suffix(".png"), f"{what} over {args.proto}")
    print(f"wrote {out} and {png}", file=sys.stderr)
    return 0 if summary["errored"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
