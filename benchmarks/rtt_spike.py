"""How the server counts answers whose path back slows under them, while their client reads
each one in full and closes at once.

Every request gets a fresh HTTP/3 connection through a `netsim.relay.LossyRelay`. The path is
fast (1 ms) while the connection measures it, then its way back slows to `--delays` (a route
change, a loaded MASQUE tunnel) just before a non-streamed chat request. The server's probe
timeout, sized to the fast path, fires before the answer's ACK can come back, and aioquic sends
the answer's packet again. The client has the whole answer either way; the table says how the
server counted them (`serving_requests_total` by outcome). Every one should be `ok`: before
`transport.connection` kept the ACKs aioquic ignores, most were `cancelled`.

    python -m benchmarks.rtt_spike --requests 40 --delays 0.1 0.3

It runs `python -m serving --deployment embedded-sim` (simulated engines: the transport is what
is measured) and needs no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from experiments.live import requests_total, server
from netsim.link import LinkConfig
from netsim.relay import LossyRelay
from transport.client import Http3Client

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "ignore_eos": True}


async def one_answer(h3_port: int, delay_s: float) -> bool:
    """One answer on a fresh connection whose way back slows to `delay_s`; True if the client
    read it whole."""
    relay = LossyRelay(("127.0.0.1", h3_port), LinkConfig(rate_bps=1e9, delay_s=0.0005))
    port = await relay.start()
    try:
        async with Http3Client("127.0.0.1", port, verify=False) as client:
            await (await client.request("GET", "/healthz")).read()  # the fast path's RTT
            relay.down.config = relay.down.config.replace(delay_s=delay_s)
            response = await client.request(
                "POST", "/v1/chat/completions", {"content-type": "application/json"},
                json.dumps(CHAT).encode(),
            )  # fmt: skip
            body = json.loads(await response.read())
        return response.status == 200 and body["usage"]["completion_tokens"] == 4
    finally:
        relay.close()


async def answers(h3_port: int, delay_s: float, requests: int) -> int:
    """How many of `requests` answers, one after another, their clients read whole."""
    return sum([await one_answer(h3_port, delay_s) for _ in range(requests)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="per delay")
    parser.add_argument("--delays", type=float, nargs="+", default=[0.1, 0.3], help="seconds")
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="rtt_spike-")) / "server.log"
    with server("embedded-sim", None, log) as live:
        print(f"{'delay back':>10}  {'read whole':>10}  server's outcomes")
        for delay_s in args.delays:
            before = requests_total(live.url)
            whole = asyncio.run(answers(live.h3_port, delay_s, args.requests))
            time.sleep(2 * delay_s + 1)  # the last ACK or close may still be on the slow path
            outcomes = requests_total(live.url) - before
            counted = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
            print(f"{delay_s * 1000:>8.0f}ms  {whole:>4}/{args.requests:<5}  {counted}")


if __name__ == "__main__":
    main()
