"""Does the server's TTFT agree with the client's? One load run, both sides, request by request.

The server times each request from its arrival (the first bytes parsed, or the HTTP/3 HEADERS)
and writes one JSON line per request (`python -m serving --request-log FILE`); the load
generator times it from the moment it went out and records the server's `x-request-id`. Joined
by that id, client TTFT - server TTFT is what neither side's clock covers: the request's way to
the server and into its event loop, and the first token's way back into the client's parser.
A probe beside the load measures the floor of that, the round trip of `GET /healthz` over the
same protocol, so the gap can be compared with the network and client time it should be made
of. The server's TTFT histogram (`serving_ttft_seconds`, its mean over the run) is compared
too, as a dashboard shows it.

    python -m serving --request-log results/requests.jsonl      # in another terminal
    python -m benchmarks.reconcile_ttft --log results/requests.jsonl --rate 40
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from transport.client import Http3Client, split_url

ROOT = Path(__file__).resolve().parent.parent


def udp_receive_drops() -> int:
    """Datagrams the kernel dropped for full socket receive buffers so far (Linux)."""
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()]
    header, values = [row for row in lines if row[0] == "Udp:"][:2]
    return int(values[header.index("RcvbufErrors")])


def histogram_totals(metrics: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram over all its label sets."""
    total = count = 0.0
    for line in metrics.splitlines():
        if line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def probe(args: argparse.Namespace, proto: str, stop: asyncio.Event) -> list[float]:
    """Round trips of GET /healthz over `proto`, on one kept-alive connection, until `stop`."""
    async with contextlib.AsyncExitStack() as stack:
        if proto == "h1":
            session = await stack.enter_async_context(aiohttp.ClientSession())

            async def get() -> None:
                async with session.get(args.url + "/healthz") as response:
                    await response.read()
        else:
            client = await stack.enter_async_context(
                Http3Client(*split_url(args.h3_url), verify=args.cacert)
            )

            async def get() -> None:
                await (await client.request("GET", "/healthz")).read()

        rtts = []
        while not stop.is_set():
            start = time.perf_counter()
            await get()
            rtts.append(time.perf_counter() - start)
            await asyncio.sleep(0.1)
    return rtts


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return await response.text()


async def measure(args: argparse.Namespace, proto: str, out: Path) -> dict:
    before = await metrics_text(args.url)
    url = args.url if proto == "h1" else args.h3_url
    extra = [] if proto == "h1" else ["--connections", "4", "--cacert", args.cacert]
    stop = asyncio.Event()
    drops = udp_receive_drops()
    prober = asyncio.create_task(probe(args, proto, stop))
    replay = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "workloads.replay", "--proto", proto, "--url", url,
        "--model", args.model, "--rate", str(args.rate), "--num-requests", str(args.num_requests),
        "--output-tokens", f"{args.output_tokens}:{args.output_tokens}", "--out", str(out),
        "--no-progress", *extra, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    await replay.wait()
    stop.set()
    drops = udp_receive_drops() - drops
    rtts = await prober
    after = await metrics_text(args.url)
    s0, c0 = histogram_totals(before, "serving_ttft_seconds")
    s1, c1 = histogram_totals(after, "serving_ttft_seconds")
    lag0, lagc0 = histogram_totals(before, "serving_event_loop_lag_seconds")
    lag1, lagc1 = histogram_totals(after, "serving_event_loop_lag_seconds")
    record = json.loads(out.read_text())
    return {
        "requests": record["requests"],
        "probe_rtt_s": rtts,
        "histogram_mean_ttft_s": (s1 - s0) / (c1 - c0) if c1 > c0 else None,
        "mean_loop_lag_s": (lag1 - lag0) / (lagc1 - lagc0) if lagc1 > lagc0 else None,
        "udp_receive_drops": drops,
    }


def ms(values: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if len(values) else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True, help="the server's --request-log file")
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument("--h3-url", default="https://localhost:8443")
    p.add_argument("--cacert", default=str(ROOT / ".certs" / "cert.pem"))
    p.add_argument("--model", default="tiny-m")
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--num-requests", type=int, default=800)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--protocols", default="h1,h3")
    p.add_argument("--out", default="results/reconcile_ttft.json")
    args = p.parse_args()
    work = ROOT / "results" / "reconcile_ttft"
    work.mkdir(parents=True, exist_ok=True)
    report = {}
    for proto in args.protocols.split(","):
        print(f"{proto}: {args.num_requests} requests at {args.rate:g} req/s", file=sys.stderr)
        run = asyncio.run(measure(args, proto, work / f"replay_{proto}.json"))
        time.sleep(1)  # the last lines reach the log
        server = {}
        for line in Path(args.log).read_text().splitlines():
            entry = json.loads(line)
            server[entry["request_id"]] = entry
        pairs = [
            (r, server[r["server_request_id"]])
            for r in run["requests"]
            if r["error_kind"] is None and r["server_request_id"] in server
        ]
        client_ttft = np.array([r["ttft_s"] for r, _ in pairs])
        server_ttft = np.array([s["ttft_s"] for _, s in pairs])
        queue = np.array([s["queue_s"] for _, s in pairs])
        gap = client_ttft - server_ttft
        rtt = run["probe_rtt_s"]
        report[proto] = {
            "matched": len(pairs),
            "sent": len(run["requests"]),
            "client_ttft_ms": {"p50": ms(client_ttft, 50), "mean": client_ttft.mean() * 1000},
            "server_ttft_ms": {"p50": ms(server_ttft, 50), "mean": server_ttft.mean() * 1000},
            "histogram_mean_ttft_ms": (run["histogram_mean_ttft_s"] or 0) * 1000,
            "gap_ms": {q: ms(gap, q) for q in (1, 50, 90, 99)},
            "server_queue_ms": {q: ms(queue, q) for q in (50, 99)},
            "probe_rtt_ms": {q: ms(rtt, q) for q in (50, 90, 99)},
            "mean_loop_lag_ms": (run["mean_loop_lag_s"] or 0) * 1000,
            "udp_receive_drops": run["udp_receive_drops"],
        }
        r = report[proto]
        print(f"\n{proto}: {r['matched']} of {r['sent']} requests matched by x-request-id")
        print(f"  client TTFT p50 {r['client_ttft_ms']['p50']:.1f} ms, mean "
              f"{r['client_ttft_ms']['mean']:.1f}; server (log) p50 "
              f"{r['server_ttft_ms']['p50']:.1f}, mean {r['server_ttft_ms']['mean']:.1f}; "
              f"server histogram mean {r['histogram_mean_ttft_ms']:.1f}")  # fmt: skip
        gap = r["gap_ms"]
        print(f"  client - server, per request: p1 {gap[1]:.2f}, p50 {gap[50]:.2f}, "
              f"p90 {gap[90]:.2f}, p99 {gap[99]:.2f} ms")  # fmt: skip
        print(f"  GET /healthz round trip over {proto}, under the same load: p50 "
              f"{r['probe_rtt_ms'][50]:.2f}, p90 {r['probe_rtt_ms'][90]:.2f}, p99 "
              f"{r['probe_rtt_ms'][99]:.2f} ms; server queue (arrival to handler) p50 "
              f"{r['server_queue_ms'][50]:.2f}, p99 {r['server_queue_ms'][99]:.2f} ms; "
              f"mean event-loop lag {r['mean_loop_lag_ms']:.2f} ms; UDP datagrams dropped "
              f"by full receive buffers: {r['udp_receive_drops']}")  # fmt: skip
    Path(args.out).write_text(json.dumps({"args": vars(args), "protocols": report}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
