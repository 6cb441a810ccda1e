"""How much delay the link emulator adds beyond what it is told, and up to what rate it keeps
that under 1 ms at p99, for TCP and for QUIC.

For each rate, two emulators with 25 ms each way and no loss:
- TCP: `netsim.probe` measures the idle round trip (UDP echoes), then sends a bulk TCP
  transfer of about `--seconds` of the link's rate;
- QUIC: our HTTP/3 client uploads as much in one request to a sink on the server side.

The forwarder records, for every packet, how much later than the link model's departure time it
wrote the packet (its lateness: scheduling, the Python loop, the TUN write). That is the added
delay the target is about. The idle round trip beyond 50 ms adds what lateness cannot see: the
kernel and the TUN read on both sides, and the echoing processes.

    python -m benchmarks.netem_accuracy                   # 5 to 400 Mbit/s, about 2 min
    python -m benchmarks.netem_accuracy --rates 5,50 --seconds 2

Needs root, as `python -m netsim.netem` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from netsim.link import LinkConfig
from netsim.netem import Netem, NetemError, check_can_run

ROOT = Path(__file__).resolve().parent.parent
H3_PORT = 8443
TARGET_US = 1000
DELAY_S = 0.025


async def sink(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads a request's body and answers its length."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return  # the client left: no answer, so no count of a partial body
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


async def serve_sink() -> None:
    from transport.http3 import Http3Settings
    from transport.server import DualServer, Listen, serve_forever
    from transport.tls import ensure_certificate

    cert, key = ensure_certificate()
    host = os.environ.get("NETEM_SERVER", "127.0.0.1")
    listen = Listen(host, None, H3_PORT, 1.0)
    # A bulk transfer is a body far past the server's default 4 MiB cap.
    settings = Http3Settings(str(cert), str(key), max_body_bytes=1 << 40)
    await serve_forever(DualServer(sink, listen, settings, "warning"))


async def quic_upload(host: str, size: int) -> dict[str, float]:
    """One HTTP/3 request carrying `size` bytes: Mbit/s from the request to the answer."""
    from transport.client import Http3Client

    for _ in range(100):  # the sink is starting in its namespace
        try:
            async with Http3Client(host, H3_PORT, verify=False) as client:
                start = time.monotonic()
                response = await client.request("POST", "/", body=bytes(size))
                answer = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"the sink answered {response.status}: {answer[:200]!r}")
                received = int(answer)
                if received != size:
                    raise RuntimeError(f"the sink counted {received} bytes of {size}")
                seconds = time.monotonic() - start
                return {"bytes": received, "seconds": seconds, "mbps": received * 8 / seconds / 1e6}
        except ConnectionError:
            await asyncio.sleep(0.2)
    raise TimeoutError(f"no HTTP/3 sink answered at {host}:{H3_PORT}")


def in_namespace(net: Netem, argv: list[str]) -> dict[str, Any]:
    """Runs a client command until it succeeds (its server may still be starting); its JSON."""
    for _ in range(50):
        done = net.popen(net.client, argv, cwd=ROOT, stdout=subprocess.PIPE)
        out, _ = done.communicate(timeout=300)
        if done.returncode == 0:
            return json.loads(out)
        time.sleep(0.2)
    raise RuntimeError(f"{argv} never succeeded")


def measure(rate_mbps: float, seconds: float) -> list[dict[str, Any]]:
    link = LinkConfig(rate_bps=rate_mbps * 1e6, delay_s=DELAY_S, queue_bytes=256_000)
    size = int(rate_mbps * 1e6 * seconds / 8)
    probe = [sys.executable, "-m", "netsim.probe"]
    me = [sys.executable, "-m", "benchmarks.netem_accuracy"]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for protocol in ("tcp", "quic"):
            stats = Path(scratch) / f"{protocol}.json"
            with Netem(link, stats_path=stats) as net:
                row: dict[str, Any] = {"rate_mbps": rate_mbps, "protocol": protocol}
                if protocol == "tcp":
                    net.popen(net.server, [*probe, "serve"], cwd=ROOT)
                    to = ["--to", net.server_address]
                    idle = in_namespace(net, [*probe, "rtt", "--count", "50", *to])
                    row["idle_rtt_excess_ms"] = round(idle["median_ms"] - 2000 * DELAY_S, 2)
                    bulk = in_namespace(net, [*probe, "goodput", "--bytes", str(size), *to])
                else:
                    net.popen(net.server, [*me, "sink"], cwd=ROOT, stderr=subprocess.DEVNULL)
                    bulk = in_namespace(
                        net, [*me, "upload", "--to", net.server_address, "--bytes", str(size)]
                    )
                row["goodput_mbps"] = round(bulk["mbps"], 2)
            late = json.loads(stats.read_text())["lateness_us"]
            row.update({f"lateness_{k}_us": late[k] for k in ("p50", "p99", "max")})
            row["packets"] = late["packets"]
            rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.netem_accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("role", nargs="?", default="run", choices=["run", "sink", "upload"])
    parser.add_argument("--rates", default="5,10,20,50,100,200,400", help="Mbit/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0, help="bulk transfer: seconds of rate")
    parser.add_argument("--out", default="results/netem_accuracy.json")
    parser.add_argument("--to", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "sink":
        asyncio.run(serve_sink())
        return 0
    if args.role == "upload":
        print(json.dumps(asyncio.run(quic_upload(args.to, args.bytes))))
        return 0
    try:
        rates = [float(r) for r in args.rates.split(",")]
        if any(r <= 0 for r in rates) or args.seconds <= 0:
            raise ValueError
        check_can_run()
    except ValueError:
        parser.error("--rates are positive numbers, comma-separated; --seconds is positive")
    except NetemError as error:
        parser.exit(2, f"error: {error}\n")
    rows = []
    print(f"{'Mbit/s':>7} {'proto':5} {'goodput':>8} {'late p50 µs':>11} {'p99 µs':>7} "
          f"{'max µs':>7} {'packets':>8} {'idle RTT +ms':>12}")  # fmt: skip
    for rate in rates:
        for row in measure(rate, args.seconds):
            rows.append(row)
            print(f"{row['rate_mbps']:>7g} {row['protocol']:5} {row['goodput_mbps']:>8.2f} "
                  f"{row['lateness_p50_us']:>11} {row['lateness_p99_us']:>7} "
                  f"{row['lateness_max_us']:>7} {row['packets']:>8} "
                  f"{row.get('idle_rtt_excess_ms', ''):>12}", flush=True)  # fmt: skip
    within = [
        rate
        for rate in rates
        if all(r["lateness_p99_us"] < TARGET_US for r in rows if r["rate_mbps"] == rate)
    ]
    highest = max(within, default=None)
    below = [rate for rate in rates if rate <= (highest or 0)]
    holds = highest is not None and below == within  # no failure below the highest success
    print(f"\np99 lateness under {TARGET_US} µs for TCP and QUIC up to: "
          f"{f'{highest:g} Mbit/s' if holds else within or 'no rate tried'}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
