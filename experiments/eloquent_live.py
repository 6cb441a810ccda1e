"""`sudo python -m experiments.eloquent_live`: Eloquent with the real embedded engines over the
emulated link (Chatterbox's Figure 4, rebuilt live).

For each RTT, a fresh TUN link emulator (`netsim.netem`: 20 Mbit/s, Chatterbox's default
Gilbert-Elliott loss, about 15%, on both directions) with the embedded server
(`python -m serving --deployment embedded`) in its server namespace and a client process in its
client namespace. The client streams the same chat request with and without Eloquent, in turn
(which goes first alternates), on one HTTP/3 connection: the same engine, the same load, the
same link. Per session, at the client:
- TTFT, from the request to the first event;
- the stall ratio: the time in gaps over 200 ms between rendered events, over the session from
  the first token's generation to the last render, as in the simulation; and those gaps in
  seconds;
- the late share: events rendered over 400 ms after the server wrote them (its times come from
  `HTTP3_EVENT_TRACE`; both namespaces share the machine's monotonic clock);
- the tokens each datagram carried, and whether the body the reader got is the stream's, byte
  for byte.

Writes results/eloquent_live/sessions.csv, summary.csv and timeline.png (the rendered text of the
session where the stream alone stalled longest, beside its Eloquent twin), and prints the table.
Needs root, for the network namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from experiments.harness.output import write_csv
from netsim.link import GilbertElliott, LinkConfig
from netsim.netem import Netem, NetemError, check_can_run
from transport.client import Http3Client
from transport.eloquent.sse import SseEvents, decode_text, split_text
from workloads.summary import late_share, stall_ratio

ROOT = Path(__file__).resolve().parent.parent
HTTP_PORT, H3_PORT = 8000, 8443
RATE_BPS = 20e6


async def session(client: Http3Client, body: dict, eloquent: bool) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    row: dict[str, Any] = {"eloquent": eloquent, "start": start, "error": None, "times": []}
    try:
        response = await client.request(
            "POST", "/v1/chat/completions", {"content-type": "application/json"},
            json.dumps(body).encode(), eloquent=eloquent,
        )  # fmt: skip
        row["stream_id"], row["status"] = response.stream_id, response.status
        cutter, events = SseEvents(), []
        async for chunk in response.iter_bytes():
            now = loop.time()
            for event in cutter.feed(chunk):
                events.append(event)
                row["times"].append(now)
    except Exception as exc:  # noqa: BLE001 - a failed session is a row, not the end of the run
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    texts = [split_text(e) for e in events]
    row["text"] = "".join(decode_text(t[1]) for t in texts if t is not None)
    row["texts"] = [t is not None for t in texts]
    lane = response.lane
    if lane is not None:
        stats = lane.receiver.stats
        row["matches_stream"] = lane.matches_stream and stats.mismatches == 0
        row["per_datagram"] = stats.sizes
        row["from_datagrams"] = sum(e.source == "datagram" for e in lane.receiver.events)
    return row


async def client_main(args: argparse.Namespace) -> int:
    body = {"model": args.model, "max_tokens": args.max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about the sea."}]}  # fmt: skip
    rows = []
    async with Http3Client(args.host, H3_PORT, verify=False) as client:
        for i in range(args.sessions):
            for eloquent in (i % 2 == 0, i % 2 == 1):  # alternate which goes first
                rows.append({"session": i} | await session(client, body, eloquent))
                print(f"session {i} eloquent={eloquent} done", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(rows))
    return 0


def run_rtt(rtt: float, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """A fresh emulator and server for one RTT; the client's rows, scored."""
    link = LinkConfig(rate_bps=RATE_BPS, delay_s=rtt / 2, bursts=GilbertElliott(), seed=args.seed)
    name = f"rtt{rtt * 1000:.0f}"
    trace, out = folder / f"{name}.trace", folder / f"{name}.rows.json"
    trace.unlink(missing_ok=True)
    with Netem(link) as net:
        host = net.server_address
        server = [sys.executable, "-m", "serving", "--deployment", "embedded", "--host", host,
                  "--port", str(HTTP_PORT), "--h3-port", str(H3_PORT),
                  "--request-log", "off"]  # fmt: skip
        log = folder / f"{name}.server.log"
        with log.open("wb") as server_log:
            served = net.popen(
                net.server, server, cwd=ROOT, env={"HTTP3_EVENT_TRACE": str(trace)},
                stdout=server_log, stderr=server_log,
            )  # fmt: skip
        # Asked from inside the server's namespace: the readiness check stays off the link.
        wait = [sys.executable, "-m", "experiments.transport_macro_live", "wait",
                f"http://{host}:{HTTP_PORT}"]  # fmt: skip
        while net.popen(net.server, wait, cwd=ROOT).wait() != 0:
            if served.poll() is not None:
                raise RuntimeError(f"{name}: the server did not start; see {log}")
        me = [sys.executable, "-m", "experiments.eloquent_live", "client", "--host", host,
              "--sessions", str(args.sessions), "--model", args.model,
              "--max-tokens", str(args.max_tokens), "--out", str(out)]  # fmt: skip
        with (folder / f"{name}.client.log").open("wb") as client_log:
            client = net.popen(net.client, me, cwd=ROOT, stdout=client_log, stderr=client_log)
            try:
                code = client.wait(args.sessions * 2 * 120)
            except subprocess.TimeoutExpired:
                code = None
        if served.poll() is not None:
            raise RuntimeError(f"{name}: the server exited during the run; see {log}")
    if code != 0 or not out.exists():
        raise RuntimeError(f"{name}: the client exited with {code}; see {name}.client.log")
    written: defaultdict[int, dict[int, float]] = defaultdict(dict)
    for line in trace.read_text().splitlines():
        stream_id, position, at = line.split()
        written[int(stream_id)][int(position)] = float(at)
    return [score(row, written.get(row.get("stream_id", -1), {}), rtt) for row in
            json.loads(out.read_text())]  # fmt: skip


def score(row: dict[str, Any], written: dict[int, float], rtt: float) -> dict[str, Any]:
    times = [t for t, has_text in zip(row["times"], row.get("texts", []), strict=False)
             if has_text]  # fmt: skip
    stamps = [written.get(p) for p, has in enumerate(row.get("texts", [])) if has]
    generated = [stamp for stamp in stamps if stamp is not None]
    scored = {"rtt_ms": int(rtt * 1000), "session": row["session"], "eloquent": row["eloquent"],
              "error": row["error"], "status": row.get("status"), "tokens": len(times)}  # fmt: skip
    if row["error"] is None and times and len(generated) == len(stamps):
        # As in the simulation (Chatterbox's §4.1): the session runs from the first token's
        # generation to its last render, so that arriving sooner does not shrink it.
        end = max(times[-1], generated[-1])
        scored |= {
            "ttft_s": times[0] - row["start"],
            "stall_ratio": stall_ratio(times, end, session_start=generated[0]),
            "stall_s": sum(b - a for a, b in zip(times, times[1:], strict=False) if b - a > 0.2),
            "late_share": late_share(generated, times),
            "tokens_per_datagram": float(np.median(row["per_datagram"]))
            if row.get("per_datagram") else None,
            "from_datagrams": row.get("from_datagrams", 0) / len(row["times"]),
            "matches_stream": row.get("matches_stream"),
        }  # fmt: skip
    return scored | {"times": [t - row["start"] for t in times], "text": row.get("text")}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.eloquent_live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("role", nargs="?", default="run", choices=["run", "client"])
    parser.add_argument("--sessions", type=int, default=10, help="pairs, per RTT")
    parser.add_argument("--rtts", default="0.2,0.4", help="seconds, comma-separated")
    parser.add_argument("--model", default="tiny-l")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="the link's loss")
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--host", help=argparse.SUPPRESS)  # the client's
    parser.add_argument("--out", help=argparse.SUPPRESS)  # the client's
    args = parser.parse_args()
    if args.role == "client":
        return asyncio.run(client_main(args))
    try:
        check_can_run()
    except NetemError as error:
        parser.exit(2, f"error: {error}\n")
    folder = args.results / "eloquent_live"
    folder.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    began = time.monotonic()
    for rtt in (float(v) for v in args.rtts.split(",")):
        rows += run_rtt(rtt, args, folder)
        print(f"RTT {rtt * 1000:.0f} ms done ({time.monotonic() - began:.0f} s)", file=sys.stderr)
    write_csv(folder / "sessions.csv", rows, skip={"times", "text"})
    summary = report(rows)
    write_csv(folder / "summary.csv", summary)
    plot(rows, folder / "timeline.png")
    print(f"wrote {folder}/sessions.csv, summary.csv and timeline.png")
    return 0


def report(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    print(f"{'RTT':>5} {'':>9} {'TTFT ms':>8} {'stall':>7} {'stall s':>8} {'late':>7} "
          f"{'tok/dgram':>10} {'via dgram':>10} {'exact':>6} {'errors':>7}")  # fmt: skip
    summary = []
    for rtt in sorted({r["rtt_ms"] for r in rows}):
        for eloquent in (False, True):
            group = [r for r in rows if r["rtt_ms"] == rtt and r["eloquent"] == eloquent]
            ok = [r for r in group if "stall_ratio" in r]
            line = {
                "rtt_ms": rtt, "scheme": "eloquent" if eloquent else "stream",
                "sessions": len(ok), "errors": len(group) - len(ok),
                "ttft_ms": float(np.median([r["ttft_s"] for r in ok])) * 1000,
                "stall_ratio": float(np.mean([r["stall_ratio"] for r in ok])),
                "stall_s": float(np.mean([r["stall_s"] for r in ok])),
                "late_share": float(np.mean([r["late_share"] for r in ok])),
                "tokens_per_datagram": float(np.median([r["tokens_per_datagram"] for r in ok]))
                if eloquent else 0.0,
                "from_datagrams": float(np.mean([r["from_datagrams"] for r in ok])),
                "exact": all(r["matches_stream"] for r in ok) if eloquent else True,
            }  # fmt: skip
            summary.append(line)
            print(f"{rtt:>5} {line['scheme']:>9} {line['ttft_ms']:>8.0f} "
                  f"{line['stall_ratio']:>7.1%} {line['stall_s']:>8.2f} {line['late_share']:>7.1%} "
                  f"{line['tokens_per_datagram']:>10.1f} {line['from_datagrams']:>10.0%} "
                  f"{str(line['exact']):>6} {line['errors']:>7}")  # fmt: skip
        stream_line, eloquent_line = summary[-2], summary[-1]
        if stream_line["stall_ratio"] > 0:
            change = eloquent_line["stall_ratio"] / stream_line["stall_ratio"] - 1
            print(f"      RTT {rtt} ms: Eloquent's stall ratio {change:+.0%} against the stream's")
    return summary


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [r for r in rows if "stall_ratio" in r]
    worst = max((r for r in scored if not r["eloquent"]), key=lambda r: r["stall_ratio"])
    twin = next(
        r for r in scored
        if r["eloquent"] and (r["rtt_ms"], r["session"]) == (worst["rtt_ms"], worst["session"])
    )  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 4))
    for r, label in ((worst, "stream only"), (twin, "Eloquent")):
        ax.step(r["times"], range(1, len(r["times"]) + 1), where="post", label=label)
    ax.set(
        xlabel="time since the request (s)",
        ylabel="events rendered",
        title=f"Rendered text, RTT {worst['rtt_ms']} ms, session {worst['session']} "
        "(same link, consecutive runs)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
