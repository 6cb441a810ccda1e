"""Front-end capacity: how many token events a second the server delivers when no engine holds it
back, against bare servers that stream the same chunks.

Four targets, each one process pinned to CPU 0, driven in turn by the same closed-loop client
(`--clients` processes on the other CPUs, each keeping its share of the streams open; every
request asks for `--tokens` tokens with ignore_eos and is counted by its `data: {` events):

- `full/h3`, `full/h1`: `python -m serving --deployment paper-4gpu-sim`, its profile's times
  multiplied by `--time-scale` (0.001: OPT-6.7B steps in about 20 us), so the twelve simulated
  engines are never the bottleneck; the whole path, HTTP/3 or HTTP/1.1 -> classification ->
  gateway -> DQN router -> simulated engine -> the event stream back;
- `full-apart/h3`, `full-apart/h1`, `full-2w/h3`, `full-2w/h1` (not in the default targets):
  the same server with its engines in an engine host (`--separate-engines`), and with two
  workers sharing it (`--workers 2`), all of it on CPU 0; the server's CPU is the whole process
  tree's;
- `starlette/h1`: a bare Starlette endpoint under uvicorn that streams the same chunk bytes,
  one event per pass of the event loop, as tokens come from an engine;
- `aioquic/h3`: a bare aioquic HTTP/3 server that streams them the same way, one `send_data`
  and transmit an event, as a naive server would;
- `starlette-burst/h1` (not in the default targets): the Starlette endpoint writing all of a
  response's chunks back to back without yielding. No token stream arrives so; it measures how
  fast uvicorn's writes go, which the kernel coalesces into a few segments.

The streams in flight rise through `--levels` until the events a second stop growing by 5%.
For each target: its peak, the server's CPU per 1,000 events there, and the client's CPU (a
client on a full core may have timed itself). Then the ratios the issue asks for: full/h3 to
aioquic/h3, full/h1 to starlette/h1. With --profile, py-spy samples the full server at its peak
over each protocol and the top frames are printed.

With --per-packet, instead: the floor of that cost, one packet and one ACK of a server
connection, ours against bare aioquic, sans IO in one process (`per_packet`).

    python -m benchmarks.frontend_capacity            # about 5 minutes on 2 cores
    python -m benchmarks.frontend_capacity --per-packet 8,256,1024
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from experiments.harness.live import server
from serving.launch import free_port, launch
from transport.connection import ScheduledQuicConnection
from transport.http3 import Http3Settings
from transport.process_tree import tree_cpu_seconds
from transport.tls import ensure_certificate

ROOT = Path(__file__).resolve().parent.parent

CHUNK = (
    b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk",'
    b'"created":1795525162,"model":"opt-125m","replica":"cuda:0/opt-125m","choices":[{"index":0,'
    b'"delta":{"content":" stone"},"logprobs":null,"finish_reason":null}]}\n\n'
)
"""One of the server's token events, byte for byte in size; the bare servers send it."""
DONE = b"data: [DONE]\n\n"
SERVER_CPU = 0
GROWTH = 1.05
CLIENT_BOUND = 0.9
"""A level whose clients used more than this share of the cores they had was theirs to set."""


# -- the bare servers ---------------------------------------------------------------------------


def serve_starlette(port: int, burst: bool = False) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request) -> StreamingResponse:
        tokens = int((await request.json())["max_tokens"])

        async def events() -> Any:
            for _ in range(tokens):
                yield CHUNK
                if not burst:
                    await asyncio.sleep(0)
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def serve_aioquic(port: int) -> None:
    from aioquic.asyncio import QuicConnectionProtocol, serve
    from aioquic.h3.connection import H3_ALPN, H3Connection
    from aioquic.h3.events import DataReceived, HeadersReceived
    from aioquic.quic.configuration import QuicConfiguration

    class Bare(QuicConnectionProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.h3 = H3Connection(self._quic)
            self.bodies: dict[int, bytes] = {}

        def quic_event_received(self, event: Any) -> None:
            for h3_event in self.h3.handle_event(event):
                if isinstance(h3_event, HeadersReceived):
                    self.bodies[h3_event.stream_id] = b""
                elif isinstance(h3_event, DataReceived):
                    self.bodies[h3_event.stream_id] += h3_event.data
                    if h3_event.stream_ended:
                        body = self.bodies.pop(h3_event.stream_id)
                        asyncio.ensure_future(self.respond(h3_event.stream_id, body))

        async def respond(self, stream_id: int, body: bytes) -> None:
            tokens = int(json.loads(body)["max_tokens"])
            self.h3.send_headers(
                stream_id, [(b":status", b"200"), (b"content-type", b"text/event-stream")]
            )
            for _ in range(tokens):
                self.h3.send_data(stream_id, CHUNK, end_stream=False)
                self.transmit()
                await asyncio.sleep(0)
            self.h3.send_data(stream_id, DONE, end_stream=True)
            self.transmit()

    cert, key = ensure_certificate()
    config = QuicConfiguration(
        is_client=False, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536
    )
    config.load_cert_chain(cert, key)

    async def main() -> None:
        await serve("127.0.0.1", port, configuration=config, create_protocol=Bare)
        await asyncio.Future()

    asyncio.run(main())


# -- the client ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    proto: str
    host: str
    port: int
    streams: int
    tokens: int
    start: float
    """time.time() at which the streams open; counting starts `warm_s` later."""
    warm_s: float
    measure_s: float


def client_process(load: Load, cpus: set[int], out: Any) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    out.send(asyncio.run(_client(load)))


async def _client(load: Load) -> dict[str, float]:
    counted = Counter[str]()
    begin, end = load.start + load.warm_s, load.start + load.warm_s + load.measure_s
    body = json.dumps(
        {
            "model": "auto",
            "max_tokens": load.tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
        }
    ).encode()

    def count(events: int) -> None:
        if begin <= time.time() < end:
            counted["events"] += events

    await asyncio.sleep(max(0.0, load.start - time.time()))
    cpu = 0.0
    if load.proto == "h3":
        from transport.client import Http3Pool

        pool = Http3Pool(
            load.host,
            load.port,
            connections=max(1, load.streams // 100),
            verify=str(ROOT / ".certs" / "cert.pem"),
        )
        async with pool:

            async def one() -> None:
                response = await pool.request(
                    "POST", "/v1/chat/completions", {"content-type": "application/json"}, body
                )
                if response.status != 200:
                    counted["errors"] += 1
                tail = b""
                async for chunk in response.iter_bytes():
                    data = tail + chunk
                    count(data.count(b"data: {"))
                    tail = data[-6:]

            cpu = await _loop(one, load, end, counted)
    else:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            url = f"http://{load.host}:{load.port}/v1/chat/completions"

            async def one() -> None:
                headers = {"content-type": "application/json"}
                async with session.post(url, data=body, headers=headers) as response:
                    if response.status != 200:
                        counted["errors"] += 1
                    tail = b""
                    async for chunk in response.content.iter_any():
                        data = tail + chunk
                        count(data.count(b"data: {"))
                        tail = data[-6:]

            cpu = await _loop(one, load, end, counted)
    return {"events": counted["events"], "errors": counted["errors"], "cpu_s": cpu}


async def _loop(one: Callable[[], Any], load: Load, end: float, failed: Counter[str]) -> float:
    """`load.streams` streams, each opened again as it ends, until `end`; the CPU this process
    spent while the events were counted."""
    cpu: dict[str, float] = {}

    async def stream() -> None:
        while time.time() < end:
            try:
                await one()
            except Exception:  # a broken stream counts, and the next one opens
                failed["errors"] += 1

    async def clock() -> None:
        await asyncio.sleep(max(0.0, load.start + load.warm_s - time.time()))
        cpu["begin"] = time.process_time()
        await asyncio.sleep(max(0.0, end - time.time()))
        cpu["end"] = time.process_time()

    await asyncio.gather(clock(), *[stream() for _ in range(load.streams)])
    return cpu["end"] - cpu["begin"]


def drive(target: str, port: int, pid: int, streams: int, args: argparse.Namespace) -> dict:
    """One level: `streams` in flight from the client processes, and what the server spent."""
    proto = target.split("/")[1]
    clients = args.clients
    cpus = set(range(os.cpu_count() or 1)) - {SERVER_CPU}
    start = time.time() + 2.0  # time for the client processes to start
    loads = [
        Load(
            proto,
            "127.0.0.1",
            port,
            max(1, streams // clients),
            args.tokens,
            start,
            args.warm_s,
            args.measure_s,
        )
        for _ in range(clients)
    ]
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for load in loads:
        mine, theirs = context.Pipe()
        process = context.Process(target=client_process, args=(load, cpus, theirs))
        process.start()
        theirs.close()  # the child's end: its death then reads as EOF here, not a hang
        pipes.append(mine)
        processes.append(process)
    time.sleep(max(0.0, start + args.warm_s - time.time()))
    before = tree_cpu_seconds(pid)  # with workers: the supervisor, its workers, the engine host
    time.sleep(args.measure_s)
    spent = tree_cpu_seconds(pid) - before
    results = []
    for pipe, process in zip(pipes, processes, strict=True):
        try:
            results.append(pipe.recv())
        except EOFError:
            process.join(30)
            raise RuntimeError(f"a client process died (exit code {process.exitcode})") from None
    for process in processes:
        process.join(30)
    events = sum(r["events"] for r in results)
    client_cores = sum(r["cpu_s"] for r in results) / args.measure_s
    return {
        "target": target,
        "streams": streams,
        "events_per_s": events / args.measure_s,
        "server_cores": spent / args.measure_s,
        "server_cpu_ms_per_1000_events": spent * 1e6 / max(1, events),
        "client_cores": client_cores,
        # The clients' share of the cores they may use: near 1, they, not the server, may have
        # set the pace.
        "client_bound": client_cores > CLIENT_BOUND * min(clients, len(cpus)),
        "errors": sum(r["errors"] for r in results),
    }


# -- the servers under test ---------------------------------------------------------------------


@contextlib.contextmanager
def bare(kind: str, results: Path) -> Iterator[tuple[int, int]]:
    """One of the bare servers, this script run as it, on a free port of its protocol."""
    port = free_port(socket.SOCK_DGRAM if kind == "aioquic" else socket.SOCK_STREAM)
    command = [sys.executable, "-m", "benchmarks.frontend_capacity", "--serve", kind,
               "--port", str(port)]  # fmt: skip
    # No page to ask whether it is ready (one serves bare QUIC): both bind within a second,
    # and a failed start shows in the level's errors.
    with launch(kind, command, port, "/", results / f"{kind}.log", cpus={SERVER_CPU}) as server:
        time.sleep(3.0)
        if server.process.poll() is not None:
            raise RuntimeError(f"the bare {kind} server exited; see {results / kind}.log")
        yield port, server.pid


FULL = {
    "full": [],
    "full-apart": ["--separate-engines"],
    "full-2w": ["--workers", "2"],
}
"""The real server's shapes: one process; one worker with the engines in an engine host; two
workers sharing the engine host."""


@contextlib.contextmanager
def full(args: argparse.Namespace, results: Path, shape: str) -> Iterator[tuple[int, int, int]]:
    """The real server on paper-4gpu-sim, its times scaled by --time-scale, in `shape`."""
    extra = ["--time-scale", f"{args.time_scale:g}", "--admission", "none", "--request-log", "off",
             "--loop", args.loop]  # fmt: skip
    with server(
        args.deployment,
        None,
        results / f"{shape}.log",
        extra=[*extra, *FULL[shape]],
        ready_path="/readyz",
        cpus={SERVER_CPU},
    ) as live:
        yield int(live.url.rsplit(":", 1)[1]), live.h3_port, live.pid


def ramp(target: str, port: int, pid: int, args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for streams in args.levels:
        row = drive(target, port, pid, streams, args)
        rows.append(row)
        print(
            f"  {target:<18} {streams:>5} streams: {row['events_per_s']:>8.0f} events/s, "
            f"server {row['server_cores']:.2f} cores, {row['server_cpu_ms_per_1000_events']:.0f} "
            f"ms CPU/1000 events, client {row['client_cores']:.2f} cores, "
            f"{row['errors']} errors" + (", CLIENT-BOUND" if row["client_bound"] else ""),
            flush=True,
        )
        if len(rows) > 1 and row["events_per_s"] < GROWTH * rows[-2]["events_per_s"]:
            break
    return rows


def profile(
    target: str, pid: int, port: int, streams: int, args: argparse.Namespace, out: Path
) -> list[str]:
    """py-spy's view of the full server at `streams` on `target`: the functions where its samples
    were, by own time and with what they called."""
    if shutil.which("py-spy") is None:
        return ["py-spy is not installed (pip install py-spy): no profile"]
    raw = out / f"profile-{target.split('/')[1]}.txt"
    sampler = subprocess.Popen(
        [
            "py-spy",
            "record",
            "--pid",
            str(pid),
            "--duration",
            # drive()'s clients start 2 s in and are counted after warm_s more: the whole of it.
            str(int(2 + args.warm_s + args.measure_s + 1)),
            "--format",
            "raw",
            "--output",
            str(raw),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    drive(target, port, pid, streams, args)
    sampler.wait(60)
    own, total = Counter[str](), Counter[str]()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [
            f.split(" (")[0] + " " + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1]
            for f in stack.split(";")
        ]
        n = int(count)
        samples += n
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"{target} at {streams} streams, {samples} samples; own time:"]
    lines += [f"  {n / samples:6.1%}  {f}" for f, n in own.most_common(15)]
    lines.append("inclusive (with what they call), below the event loop:")
    loop = ("runners.py", "base_events.py", "events.py", "runpy>", "__main__.py", "threading.py")
    inner = [(f, n) for f, n in total.most_common() if not f.endswith(loop)]
    lines += [f"  {n / samples:6.1%}  {f}" for f, n in inner[:20]]
    return lines


CLIENT_ADDR = ("10.0.0.1", 40000)
SERVER_ADDR = ("10.0.0.2", 443)
EVENT = b"x" * 260
"""About one chat-completion chunk's server-sent event."""


def _pair(ours: bool) -> tuple[QuicConnection, QuicConnection]:
    client_config = QuicConfiguration(is_client=True, alpn_protocols=["h3"])
    client_config.verify_mode = 0
    cert, key = ensure_certificate()
    server_config = Http3Settings(str(cert), str(key)).quic_configuration()
    if ours:
        client: QuicConnection = ScheduledQuicConnection(configuration=client_config)
        server: QuicConnection = ScheduledQuicConnection(
            configuration=server_config,
            original_destination_connection_id=client.original_destination_connection_id,
            scheduler="rr",
        )
    else:
        client = QuicConnection(configuration=client_config)
        server = QuicConnection(
            configuration=server_config,
            original_destination_connection_id=client.original_destination_connection_id,
        )
    return client, server


def per_packet(ours: bool, streams: int, rounds: int) -> tuple[float, float]:
    """µs per server `datagrams_to_send` (one packet) and per ACK received (`--per-packet`).

    A client and a server connection (`tests.support.quic.quic_pair`'s settings), sans IO, in
    one process, with `streams` open request streams. Per round the server writes one token
    event (260 bytes) on the next stream in turn and builds its packets (timed); the client
    takes them, and every second round acknowledges them (the server's `receive_datagram` of
    that ACK, timed). Nothing else runs between the calls, so the figures are the floor of what
    the live server pays per packet and per ACK (the live server measured 2-3x these, with the
    app between the calls: docs/results/http3-vs-http1.md)."""
    client, server = _pair(ours)
    limit = server._local_max_streams_bidi  # as transport.http3 raises it
    limit.value = limit.sent = 2 * streams
    now = 0.0

    def carry(source: QuicConnection, to: QuicConnection) -> None:
        address = SERVER_ADDR if source is server else CLIENT_ADDR
        for data, _ in source.datagrams_to_send(now):
            to.receive_datagram(data, address, now)

    client.connect(SERVER_ADDR, now)
    for _ in range(6):
        carry(client, server)
        carry(server, client)
        now += 0.01
    ids = []
    for _ in range(streams):
        stream_id = client.get_next_available_stream_id()
        client.send_stream_data(stream_id, b"request", True)
        ids.append(stream_id)
    for _ in range(4):
        carry(client, server)
        carry(server, client)
        now += 0.01
    if len(server._streams) < streams:
        raise RuntimeError(f"only {len(server._streams)} of {streams} streams opened")
    sending = receiving = 0.0
    for i in range(rounds):
        server.send_stream_data(ids[i % streams], EVENT)
        start = time.perf_counter()
        packets = server.datagrams_to_send(now)
        sending += time.perf_counter() - start
        for data, _ in packets:
            client.receive_datagram(data, SERVER_ADDR, now)
        now += 0.0005
        if i % 2:
            acks = client.datagrams_to_send(now + 0.03)  # past any ACK delay
            start = time.perf_counter()
            for data, _ in acks:
                server.receive_datagram(data, CLIENT_ADDR, now)
            receiving += time.perf_counter() - start
        while client.next_event() is not None:
            pass
    return 1e6 * sending / rounds, 1e6 * receiving / (rounds // 2)


def per_packet_table(streams: list[int], rounds: int) -> None:
    print("| open streams | connection | µs per packet built | µs per ACK received |")
    print("|---|---|---|---|")
    for n in streams:
        for ours in (False, True):
            send, receive = per_packet(ours, n, rounds)
            name = "ours (ScheduledQuicConnection)" if ours else "bare aioquic"
            print(f"| {n} | {name} | {send:.1f} | {receive:.1f} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--serve", choices=["starlette", "starlette-burst", "aioquic"], help=argparse.SUPPRESS
    )
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--deployment", default="paper-4gpu-sim")
    p.add_argument("--time-scale", type=float, default=0.001)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="the full server's event loop (python -m serving --loop)")  # fmt: skip
    p.add_argument(
        "--levels",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[16, 64, 256, 512],
        help="streams in flight, rising",
    )
    p.add_argument("--tokens", type=int, default=64, help="events per response")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--warm-s", type=float, default=2.0)
    p.add_argument("--measure-s", type=float, default=6.0)
    p.add_argument("--targets", default="aioquic/h3,full/h3,starlette/h1,full/h1")
    p.add_argument("--profile", action="store_true", help="py-spy the full server at its peaks")
    p.add_argument("--out", default=str(ROOT / "results" / "frontend_capacity"))
    p.add_argument(
        "--per-packet", type=lambda s: [int(v) for v in s.split(",")], metavar="STREAMS",
        help="instead: what one packet and one ACK cost a server connection, ours against bare "
        "aioquic, with these many streams open (e.g. 8,256)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=20000, help="--per-packet: packets per run")
    args = p.parse_args()
    if args.per_packet:
        per_packet_table(args.per_packet, args.rounds)
        return 0
    if args.serve:
        if args.serve == "aioquic":
            serve_aioquic(args.port)
        else:
            serve_starlette(args.port, burst=args.serve == "starlette-burst")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"{platform.node()}: {os.cpu_count()} CPUs; servers on CPU {SERVER_CPU}, "
        f"{args.clients} client processes on the others; {args.tokens} events a response"
    )
    rows: list[dict] = []
    profiled: list[str] = []
    targets = args.targets.split(",")
    for shape in FULL:
        shaped = [t for t in targets if t.split("/")[0] == shape]
        if not shaped:
            continue
        with full(args, out, shape) as (port, h3_port, pid):
            for target in shaped:
                rows += ramp(target, h3_port if target.endswith("h3") else port, pid, args)
            for target in shaped if args.profile else []:
                peak = max(
                    (r for r in rows if r["target"] == target), key=lambda r: r["events_per_s"]
                )
                at = h3_port if target.endswith("h3") else port
                profiled += profile(target, pid, at, peak["streams"], args, out)
    for target in [t for t in targets if t.split("/")[0] not in FULL]:
        with bare(target.split("/")[0], out) as (port, pid):
            rows += ramp(target, port, pid, args)
    peaks = {
        t: max((r for r in rows if r["target"] == t), key=lambda r: r["events_per_s"])
        for t in targets
    }
    print(
        f"\n{'target':<18} {'streams':>7} {'events/s':>9} {'server cores':>12} "
        f"{'CPU ms/1000 ev':>14} {'client cores':>12}"
    )
    for t, r in peaks.items():
        print(
            f"{t:<18} {r['streams']:>7} {r['events_per_s']:>9.0f} {r['server_cores']:>12.2f} "
            f"{r['server_cpu_ms_per_1000_events']:>14.0f} {r['client_cores']:>12.2f}"
            + ("  client-bound" if r["client_bound"] else "")
        )
    ratios = {}
    pairs = (
        ("full/h3", "aioquic/h3"),
        ("full/h1", "starlette/h1"),
        ("full/h1", "starlette-burst/h1"),
    )
    for mine, theirs in pairs:
        if mine in peaks and theirs in peaks:
            ratios[f"{mine} / {theirs}"] = (
                peaks[mine]["events_per_s"] / peaks[theirs]["events_per_s"]
            )
    for name, ratio in ratios.items():
        # A client-bound baseline may go faster still: the ratio is then an upper bound.
        bound = peaks[name.split(" / ")[1]]["client_bound"]
        print(f"{name}: {'at most ' if bound else ''}{ratio:.2f} (target >= 0.70)")
    # The server's shapes against one process, level by level: the CPU a token costs each.
    for shape, proto in itertools.product(("full-apart", "full-2w"), ("h3", "h1")):
        for row in (r for r in rows if r["target"] == f"{shape}/{proto}"):
            base = [
                r for r in rows if (r["target"], r["streams"]) == (f"full/{proto}", row["streams"])
            ]
            if base:
                ratio = (
                    row["server_cpu_ms_per_1000_events"] / base[0]["server_cpu_ms_per_1000_events"]
                )
                ratios[f"{shape}/{proto} / full/{proto} CPU per event at {row['streams']}"] = ratio
                print(f"{shape}/{proto} at {row['streams']} streams: {ratio:.2f} of full/{proto}'s "
                      f"CPU per event, {row['events_per_s'] / base[0]['events_per_s']:.2f} of "
                      "its events/s")  # fmt: skip
    for line in profiled:
        print(line)
    record = {
        "args": {k: v for k, v in vars(args).items() if k not in ("serve", "port")},
        "rows": rows,
        "peaks": peaks,
        "ratios": ratios,
        "profile": profiled,
    }
    (out / "frontend_capacity.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'frontend_capacity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
