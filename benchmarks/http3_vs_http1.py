"""HTTP/3 against HTTP/1.1 on loopback, side by side in alternating rounds.

Two loads, each at a fixed concurrency, closed loop:
- `trivial`: an in-process ASGI app that answers a small body (requests/s), and one that streams
  64 small chunks like SSE tokens (chunks/s): the transports' own cost;
- `engines` (with --server): streamed chat completions from a running `python -m serving`
  (tokens/s), HTTP/3 through transport.client, HTTP/1.1 through httpx.

HTTP/3 multiplexes every request as a stream on one QUIC connection; HTTP/1.1 uses a pool of
keep-alive connections, one request at a time each. The client runs in the same process as the
trivial server (both protocols pay that equally), so absolute numbers are low; read the ratios.

    python -m benchmarks.http3_vs_http1 [--server http://localhost:8000 --h3-port 8443]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from transport.client import Http3Client
from transport.http3 import Http3Settings
from transport.server import DualServer, Listen
from transport.tls import ensure_certificate

ROOT = Path(__file__).resolve().parent.parent
CHUNKS = 64


async def trivial_app(scope: dict, receive: Callable, send: Callable) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    if scope["path"] == "/stream":
        for i in range(CHUNKS):
            chunk = f'data: {{"token": {i}}}\n\n'.encode()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b'{"ok": true}'})


async def closed_loop(one: Callable[[], Awaitable[int]], concurrency: int, seconds: float) -> float:
    """Units per second (requests or chunks) over `seconds`, `concurrency` workers."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            done += await one()

    start = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return done / (time.perf_counter() - start)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--server", help="a running `python -m serving` (HTTP/1.1 URL)")
    parser.add_argument("--h3-port", type=int, default=8443)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "results"))
    args = parser.parse_args()
    cert, key = ensure_certificate()
    results: dict[str, dict[str, list[float]]] = {}
    settings = Http3Settings(str(cert), str(key))
    server = DualServer(trivial_app, Listen("127.0.0.1", 0, 0), settings, "warning")
    async with (
        server,
        Http3Client("localhost", server.udp_port or 0, verify=str(cert)) as h3,
        httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.tcp_port}",
            limits=httpx.Limits(max_connections=args.concurrency),
        ) as h1,
    ):
        loads = {
            "trivial requests/s": (
                lambda: _h3_get(h3, "/"), lambda: _h1_get(h1, "/")
            ),
            "streamed chunks/s": (
                lambda: _h3_get(h3, "/stream"), lambda: _h1_get(h1, "/stream")
            ),
        }  # fmt: skip
        if args.server:
            engines_h3 = Http3Client("localhost", args.h3_port, verify=str(cert))
            await engines_h3.__aenter__()
            engines_h1 = httpx.AsyncClient(
                base_url=args.server, limits=httpx.Limits(max_connections=args.concurrency)
            )
            body = {
                "model": "tiny-s",
                "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            loads["engine tokens/s"] = (
                lambda: _h3_chat(engines_h3, body), lambda: _h1_chat(engines_h1, body)
            )  # fmt: skip
        for name, (over_h3, over_h1) in loads.items():
            runs = results.setdefault(name, {"http3": [], "http1.1": []})
            for round_ in range(args.rounds):
                order = [("http3", over_h3), ("http1.1", over_h1)]
                for protocol, one in order if round_ % 2 == 0 else order[::-1]:
                    rate = await closed_loop(one, args.concurrency, args.seconds)
                    runs[protocol].append(rate)
    machine = f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"machine: {machine}")
    print(f"{args.rounds} rounds x {args.seconds} s, concurrency {args.concurrency}, medians")
    print(f"{'load':<22}{'HTTP/3':>12}{'HTTP/1.1':>12}{'h3/h1':>8}")
    summary = {}
    for name, runs in results.items():
        h3_rate, h1_rate = statistics.median(runs["http3"]), statistics.median(runs["http1.1"])
        summary[name] = {"http3": h3_rate, "http1.1": h1_rate, "runs": runs}
        print(f"{name:<22}{h3_rate:>12.0f}{h1_rate:>12.0f}{h3_rate / h1_rate:>8.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http3_vs_http1.json").write_text(json.dumps(summary, indent=2))


async def _h3_get(client: Http3Client, path: str) -> int:
    return _units(path, await (await client.request("GET", path)).read())


async def _h1_get(client: httpx.AsyncClient, path: str) -> int:
    return _units(path, (await client.get(path)).content)


def _units(path: str, body: bytes) -> int:
    """Streamed: the events that arrived; otherwise one request."""
    return body.count(b"data: ") if path == "/stream" else 1


async def _h3_chat(client: Http3Client, body: dict) -> int:
    response = await client.request(
        "POST", "/v1/chat/completions", {"content-type": "application/json"},
        json.dumps(body).encode(),
    )  # fmt: skip
    return sum([1 async for line in response.iter_lines() if line.startswith("data: {")])


async def _h1_chat(client: httpx.AsyncClient, body: dict) -> int:
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        return sum([1 async for line in response.aiter_lines() if line.startswith("data: {")])


if __name__ == "__main__":
    asyncio.run(main())
