"""`python -m benchmarks.engine_paths`: what a token costs on each way of reaching an engine:
whole servers on a real vLLM CPU engine (the embedded deployment's tiny-s), and the upstream
leg of a `remote` deployment alone. `--paths` chooses among:

- `in-process`: `python -m serving`, the engine (vLLM's AsyncLLM) in the front-end's process;
- `engine-host`: `python -m serving --separate-engines`, the engine in `serving.engine_host`,
  the one front-end worker reaching it over the engine link (what `--workers N` runs);
- `engine-host-tcp`: the same engine host on TCP with a link token (`--listen`), as one on
  another host is reached (its placement entry names it: `engine_host`);
- `vllm-serve`: vLLM's own OpenAI server for the engine, the front-end reaching it as a remote
  replica (HTTP/SSE, `RemoteEngine`);
- `leg-shipped`, `leg-raw`, `leg-raw-push`: the upstream leg alone, as shipped and as a
  hand-written client could at best make it (below).

The same closed loop of `--streams` streaming chat requests of `--tokens` tokens each runs for
`--seconds` against each. Every process's CPU is read from /proc, and sorted into the
front-end (the worker, and the supervisor), the engine's front (the process that holds
AsyncLLM: the front-end itself in-process, the engine host, or `vllm serve`'s API server) and
vLLM's EngineCore (the model's steps, the same work in all three). Reported: CPU µs per output
token of each, and their sum without EngineCore, which is what the way of reaching the engine
costs. Rounds interleave the three, so that the VM's drift falls on all alike.

The upstream leg alone: one null upstream (`workloads.null_server`, first token at 20 ms, then
one every 10 ms) on CPU 1; this process on CPU 0 keeps `--streams` chat streams of 64 tokens open
against it and reads them, for `--seconds` a run, in interleaved rounds. CPU per token is this
process's CPU time over the tokens read. The ways to read them:

- `leg-shipped`: `RemoteEngine.generate` (`serving.engines.upstream_http`'s pooled client,
  msgspec per chunk), pumped by a task into a queue that the reader drains, as
  `serving.gateway.Generation` does when it does not relay;
- `leg-raw`: an `asyncio.Protocol` with httptools parsing the response on the connection, the
  SSE split and msgspec decode in `data_received`, into a queue read by an async generator that
  the same pump drains: the design the shipped client took, without its errors, timeouts and
  aborts (aiohttp's client shipped before it, at 53.7 µs a token against this one's 43.3);
- `leg-raw-push`: the same protocol pushing straight into the reader's queue, no pump task:
  the engine interface changed as well.

The raw client here has none of what a shipped one needs (errors, timeouts, aborts, a pool
that closes idle connections), so its numbers are a floor for that design, not its price.
`--loops asyncio,uvloop` repeats each on uvloop's event loop.

    python -m benchmarks.engine_paths                     # 8 streams of 64 tokens, 20 s, 2 rounds
    python -m benchmarks.engine_paths --paths leg-shipped,leg-raw,leg-raw-push   # about 2 min
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx
import msgspec
import yaml

from benchmarks.common import MODEL, start_upstreams
from config import ReplicaConfig
from experiments.harness.live import cpu_seconds
from serving.engines.base import Sampling, TokenDelta
from serving.engines.remote import RemoteEngine, decode_chunk
from serving.launch import ROOT, Launched, free_port, launch, serving_command, shipped_spec
from transport.process_tree import tree
from workloads import Message, Request

SERVERS = ("in-process", "engine-host", "engine-host-tcp", "vllm-serve")
"""Whole servers on one real vLLM engine, four ways (see the module)."""


def vllm_env() -> dict[str, str]:
    """`vllm serve`'s engine placed as `serving.engines.vllm_engine` places its own: its
    threads bound to every core but the last, and no dynamo (the same reasons as there)."""
    cores = sorted(os.sched_getaffinity(0))
    bind = ",".join(map(str, cores[:-1] or cores))
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": bind,
            "TORCHDYNAMO_DISABLE": "1"}  # fmt: skip


def config(folder: Path, upstream_port: int, link_port: int) -> Path:
    """models.yaml with three deployments of one tiny-s engine: its own (`bench_hosted`), the
    engine host on TCP at `link_port` (`bench_tcp`), and the `vllm serve` on `upstream_port`
    (`bench_remote`)."""
    spec = shipped_spec()
    spec["placements"]["bench_hosted"] = [
        {"model": "tiny-s", "device": "cpu", "kv_cache_gib": 0.25}
    ]
    spec["placements"]["bench_tcp"] = [
        {"model": "tiny-s", "device": "cpu", "kv_cache_gib": 0.25,
         "engine_host": f"127.0.0.1:{link_port}"}
    ]  # fmt: skip
    spec["placements"]["bench_remote"] = [
        {"model": "tiny-s", "url": f"http://127.0.0.1:{upstream_port}/v1", "served_name": "tiny-s"}
    ]
    policy = {"name": "quality-threshold"}
    spec["deployments"]["bench_hosted"] = {
        "placement": "bench_hosted", "policy": policy, "admission": {"rule": "none"},
        "engine_args": {"enforce_eager": True, "max_model_len": 2048},
    }  # fmt: skip
    spec["deployments"]["bench_tcp"] = spec["deployments"]["bench_hosted"] | {
        "placement": "bench_tcp"
    }
    spec["deployments"]["bench_remote"] = {"placement": "bench_remote", "policy": policy,
                                           "admission": {"rule": "none"}}  # fmt: skip
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def wait_for_port(launched: Launched, port: int, timeout_s: float = 300) -> None:
    """Until something answers on `port` (an engine host has no HTTP to ask)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        if launched.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{launched.name} did not serve port {port}:\n{launched.tail()}")
        time.sleep(0.2)


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


TOKENS = 64
PROMPT = (Message("user", "hi " * 128),)
LEG = ("leg-shipped", "leg-raw", "leg-raw-push")
"""The upstream leg alone, three ways (see the module)."""
_END = object()

Sink = Callable[[Any], None]


class _Connection(asyncio.Protocol):
    """One keep-alive connection: the response parsed as it arrives, each SSE event's data
    handed to `sink`, then `_END`, and the connection back into `pool`."""

    def __init__(self, pool: list[_Connection]) -> None:
        self.pool = pool
        self.transport: Any = None  # asyncio's or uvloop's TCP transport
        self.parser = httptools.HttpResponseParser(self)
        self.sink: Sink | None = None
        self.rest = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        events = (self.rest + body).split(b"\n\n")
        self.rest = events.pop()
        assert self.sink is not None
        for event in events:
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                self.sink(event[6:])

    def on_message_complete(self) -> None:
        sink, self.sink = self.sink, None
        assert sink is not None
        sink(_END)
        self.parser = httptools.HttpResponseParser(self)
        self.pool.append(self)


class _RawClient:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.pool: list[_Connection] = []

    async def send(self, sink: Sink) -> None:
        while self.pool and (held := self.pool.pop()).transport is not None:
            if not held.transport.is_closing():
                break
        else:
            loop = asyncio.get_running_loop()
            _, held = await loop.create_connection(
                lambda: _Connection(self.pool), self.host, self.port
            )
        body = msgspec.json.encode(
            {"model": MODEL, "max_tokens": TOKENS, "stream": True, "ignore_eos": True,
             "messages": [{"role": m.role, "content": m.content} for m in PROMPT],
             "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        )  # fmt: skip
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        held.sink = sink
        assert held.transport is not None
        held.transport.write(head + body)


def _decoding(put: Sink) -> Sink:
    """A sink that decodes each chunk as `RemoteEngine` does and puts its delta."""
    generated = 0

    def sink(data: Any) -> None:
        nonlocal generated
        if data is _END:
            put(_END)
            return
        chunk = decode_chunk(data)
        if not chunk.choices or chunk.usage is None:
            return
        choice, usage = chunk.choices[0], chunk.usage
        delta = choice.delta
        put(
            TokenDelta(
                text=(delta.content if delta is not None else choice.text) or "",
                tokens=usage.completion_tokens - generated,
                prompt_tokens=usage.prompt_tokens,
                finish_reason=choice.finish_reason,
            )
        )
        generated = usage.completion_tokens

    return sink


async def _pumped(deltas: AsyncIterator[TokenDelta]) -> int:
    """Read `deltas` as `Generation` does: a task pumps them into a queue that this drains."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        async for delta in deltas:
            queue.put_nowait(delta)
        queue.put_nowait(_END)

    task = asyncio.create_task(pump())
    tokens = 0
    while (item := await queue.get()) is not _END:
        tokens += item.tokens
    await task
    return tokens


async def _run(way: str, url: str, seconds: float, streams: int) -> tuple[int, float, float]:
    engine = RemoteEngine(_replica(url))
    await engine.start()
    raw = _RawClient(url)
    ids = itertools.count()

    async def one() -> int:
        if way == "leg-shipped":
            request = Request(f"r{next(ids)}", 0.0, PROMPT, TOKENS, "free-tier")
            return await _pumped(engine.generate(request, Sampling(ignore_eos=True)))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        await raw.send(_decoding(queue.put_nowait))
        if way == "leg-raw":

            async def deltas() -> AsyncIterator[TokenDelta]:
                while (item := await queue.get()) is not _END:
                    yield item

            return await _pumped(deltas())
        tokens = 0
        while (item := await queue.get()) is not _END:
            tokens += item.tokens
        return tokens

    async def keep_one_open(until: float) -> int:
        tokens = 0
        while time.monotonic() < until:
            tokens += await one()
        return tokens

    try:
        await asyncio.gather(*(one() for _ in range(streams)))  # connections made, code warm
        cpu, wall = time.process_time(), time.monotonic()
        counts = await asyncio.gather(*(keep_one_open(wall + seconds) for _ in range(streams)))
        return sum(counts), time.process_time() - cpu, time.monotonic() - wall
    finally:
        await engine.close()
        for held in raw.pool:
            if held.transport is not None:
                held.transport.close()


def _replica(url: str) -> ReplicaConfig:
    return ReplicaConfig(
        name="remote/null", model=MODEL, source=MODEL, device=None, url=url + "/v1",
        served_name=MODEL, memory_fraction=None, kv_cache_gib=None, cpu_cores=None,
        engine_args={}, chat_template=None, fallback_chat_template=None, build=None, scrape_s=0,
    )  # fmt: skip


def _on(loop: str, main: Any) -> Any:
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


def measure_leg(args: argparse.Namespace, ways: list[str]) -> None:
    """The upstream leg alone: this process on CPU 0 reads `--streams` streams of 64 tokens
    from a null upstream on CPU 1, each way of `ways` and loop of `--loops`, in rounds."""
    loops = args.loops.split(",")
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {0})
    cost: dict[tuple[str, str], list[float]] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as folder:
        (url,) = start_upstreams(stack, Path(folder), [(20.0, 10.0)])
        for round_, loop, way in itertools.product(range(args.rounds), loops, ways):
            tokens, cpu, wall = _on(loop, _run(way, url, args.seconds, args.streams))
            cost.setdefault((loop, way), []).append(cpu / tokens * 1e6)
            print(f"round {round_} {loop:7s} {way:12s}: {tokens / wall:6.0f} tokens/s, "
                  f"{cpu / tokens * 1e6:5.1f} µs CPU per token", file=sys.stderr)  # fmt: skip
    base = statistics.median(cost[(loops[0], ways[0])])
    print(f"\nthe upstream leg: {args.streams} streams, median of {args.rounds} rounds "
          f"({sys.platform}, {os.cpu_count()} CPUs)\n")  # fmt: skip
    print(f"| loop | way | µs CPU per token | vs {loops[0]} {ways[0]} |\n|---|---|---|---|")
    for (loop, way), values in cost.items():
        median = statistics.median(values)
        print(f"| {loop} | {way} | {median:.1f} | {median / base:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.engine_paths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--paths", default=",".join(SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS + LEG)}")  # fmt: skip
    parser.add_argument("--streams", type=int, help="streams kept open (8; the leg's: 50)")
    parser.add_argument("--tokens", type=int, default=64, help="per request (servers)")
    parser.add_argument("--seconds", type=float, help="per run (20; the leg's: 10)")
    parser.add_argument("--rounds", type=int, help="(2; the leg's: 3)")
    parser.add_argument("--loops", default="asyncio", help="the leg: asyncio, uvloop or both")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "engine_paths")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    unknown = set(paths) - set(SERVERS + LEG)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {', '.join(SERVERS + LEG)}")
    servers = [p for p in paths if p in SERVERS]
    legs = [p for p in paths if p in LEG]
    if servers:
        measure_servers(argparse.Namespace(**vars(args) | {
            "streams": args.streams or 8, "seconds": args.seconds or 20.0,
            "rounds": args.rounds or 2}), servers)  # fmt: skip
    if legs:
        measure_leg(argparse.Namespace(**vars(args) | {
            "streams": args.streams or 50, "seconds": args.seconds or 10.0,
            "rounds": args.rounds or 3}), legs)  # fmt: skip
    return 0


def measure_servers(args: argparse.Namespace, paths: list[str]) -> None:
    """Each of `paths` (of `SERVERS`): a server on one tiny-s engine, a closed loop against it."""
    args.out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "serving.embedded"], cwd=ROOT, check=True)
    upstream_port, link_port = free_port(), free_port()
    models = config(args.out, upstream_port, link_port)
    token = args.out / "link-token"
    token.write_text(secrets.token_hex(16))
    template = args.out / "chat_template.jinja"
    template.write_text(yaml.safe_load((ROOT / "models.yaml").read_text())["chat_template"])
    rows: list[dict] = []
    for round_ in range(args.rounds):
        for path in paths:
            port = free_port()
            with ExitStack() as stack:
                upstream = None
                if path == "vllm-serve":
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
                if path == "engine-host-tcp":
                    link = f"127.0.0.1:{link_port}"
                    command = [sys.executable, "-m", "serving.engine_host", "--config",
                               str(models), "--deployment", "bench_tcp", "--listen", link,
                               "--link-token-file", str(token)]  # fmt: skip
                    host = stack.enter_context(launch("engine host", command, link_port, "",
                                                      args.out / "engine-host.log"))  # fmt: skip
                    wait_for_port(host, link_port)
                    upstream = host.pid
                deployment = {"vllm-serve": "bench_remote", "engine-host-tcp": "bench_tcp"}.get(
                    path, "bench_hosted"
                )
                flags = ["--config", str(models), "--h3-port", "0", "--request-log", "off",
                         "--link-token-file", str(token)]  # fmt: skip
                flags += ["--separate-engines"] if path == "engine-host" else []
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
    for path in paths:
        mine = [r for r in rows if r["path"] == path]

        def median(key: str, of: list[dict] = mine) -> float:
            return statistics.median(r.get(key, 0.0) for r in of)

        ours, engine = median("front-end"), median("engine front")
        print(f"| {path} | {median('tokens_per_s'):.0f} | {ours:.0f} | {engine:.0f} "
              f"| {ours + engine:.0f} | {median('engine core'):.0f} |")  # fmt: skip
    if {"engine-host", "engine-host-tcp"} <= set(paths):
        # Round by round, so that the VM's drift falls on both alike.
        both = {(r["round"], r["path"]): r.get("front-end", 0.0) + r.get("engine front", 0.0)
                for r in rows}  # fmt: skip
        ratios = [both[k, "engine-host-tcp"] / both[k, "engine-host"] for k in range(args.rounds)]
        print(f"\nTCP link / Unix-socket link, CPU per output token (both sides): "
              f"{statistics.median(ratios):.2f}x median of rounds "
              f"({', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
