"""`python -m experiments.eloquent_live`: Eloquent with the real embedded engines over a lossy
link (seed 002 Figure 4, rebuilt live).

Starts the embedded server, puts `transport.relay.LossyRelay` (the same link model as the
virtual-time experiment: default Gilbert-Elliott loss, ~15%) in front of its HTTP/3 port, and
streams the same chat request alternately with and without Eloquent. Per session, at the client:
TTFT, the stall ratio (gaps over 200 ms between rendered tokens, over the session) and the mean
gap. The PNG draws the rendered-text timeline of one session of each, as 002 Figure 4 does.

Writes results/eloquent_live.csv and .png and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from experiments.live import server
from experiments.output import write_csv
from transport.client import Http3Client
from transport.eloquent import stall_ratio
from transport.link import GilbertElliott, LinkConfig
from transport.relay import LossyRelay
from workloads.chat import ChatResult, read_chat_stream


async def session(client: Http3Client, body: dict, eloquent: bool) -> dict:
    start = time.perf_counter()
    times: list[float] = []
    response = await client.request(
        "POST",
        "/v1/chat/completions",
        {"content-type": "application/json"},
        json.dumps(body).encode(),
        eloquent=eloquent,
    )
    result = ChatResult(status=response.status)
    await read_chat_stream(
        response.iter_lines(),
        result,
        start,
        on_token=lambda _: times.append(time.perf_counter() - start),
    )
    lane = response.lane
    return {
        "eloquent": eloquent,
        "error": result.error,
        "tokens": len(times),
        "ttft_s": result.ttft_s,
        "stall_ratio": stall_ratio(times, times[-1], session_start=times[0]) if times else None,
        "mean_gap_ms": float(np.mean(np.diff(times))) * 1000 if len(times) > 1 else None,
        "from_datagrams": sum(e.source == "datagram" for e in lane.receiver.events) if lane else 0,
        "times": times,
    }


async def run(url_port: int, args: argparse.Namespace) -> list[dict]:
    link = LinkConfig(rate_bps=20e6, delay_s=args.rtt / 2, bursts=GilbertElliott(), seed=args.seed)
    relay = LossyRelay(("127.0.0.1", url_port), link)
    port = await relay.start()
    body = {"model": args.model, "max_tokens": args.max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the sea."}]}  # fmt: skip
    rows = []
    try:
        async with Http3Client("127.0.0.1", port, verify=False) as client:
            for i in range(args.sessions):
                for eloquent in (i % 2 == 0, i % 2 == 1):  # alternate which goes first
                    rows.append({"session": i} | await session(client, body, eloquent))
    finally:
        relay.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.eloquent_live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--rtt", type=float, default=0.2, help="seconds")
    parser.add_argument("--model", default="tiny-l")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    log = args.results / "eloquent_live-server.log"
    with server("embedded", None, log) as live:
        rows = asyncio.run(run(live.h3_port, args))
    write_csv(args.results / "eloquent_live.csv", rows, skip={"times"})
    print(
        f"{args.sessions} sessions each, {args.model}, {args.max_tokens} tokens, RTT "
        f"{args.rtt * 1000:.0f} ms, default Gilbert-Elliott loss (~15%)"
    )
    print(
        f"{'':>10} {'TTFT ms':>9} {'stall':>8} {'mean gap ms':>12} {'via datagram':>13} "
        f"{'errors':>7}"
    )
    for eloquent in (False, True):
        group = [r for r in rows if r["eloquent"] == eloquent]
        ok = [r for r in group if r["error"] is None]
        print(
            f"{'eloquent' if eloquent else 'stream':>10} "
            f"{np.mean([r['ttft_s'] for r in ok]) * 1000:>9.1f} "
            f"{np.mean([r['stall_ratio'] for r in ok]):>8.2%} "
            f"{np.mean([r['mean_gap_ms'] for r in ok]):>12.1f} "
            f"{np.mean([r['from_datagrams'] / max(1, r['tokens']) for r in ok]):>13.1%} "
            f"{len(group) - len(ok):>7}"
        )
    plot(rows, args.results / "eloquent_live.png")
    print(f"wrote {args.results / 'eloquent_live.csv'} and .png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The session where the stream alone stalled longest shows what Eloquent is for.
    worst = max(
        (r for r in rows if not r["eloquent"] and r["error"] is None),
        key=lambda r: r["stall_ratio"],
    )
    twin = next(r for r in rows if r["eloquent"] and r["session"] == worst["session"])
    fig, ax = plt.subplots(figsize=(8, 4))
    for r, label in ((worst, "stream only"), (twin, "Eloquent")):
        ax.step(r["times"], range(1, len(r["times"]) + 1), where="post", label=label)
    ax.set(
        xlabel="time since the request (s)",
        ylabel="tokens rendered",
        title=f"Rendered text, session {worst['session']} (same link, consecutive runs)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
