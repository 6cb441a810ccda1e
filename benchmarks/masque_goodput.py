"""Bulk goodput through the MASQUE CONNECT-UDP proxy against the direct path, over loopback.

The target: one bulk tunnel through `transport.masque` should carry at least 50% of the
direct path's goodput. This measures it side by side, in one run:

- `direct`: an inner QUIC connection from the client straight to the bulk server;
- `capsule`: the same inner connection through one `UdpTunnel(mode="capsule")` and the
  `MasqueProxy`: every inner packet rides as a DATAGRAM capsule on the tunnel's request stream;
- `datagram`: the same with `UdpTunnel(mode="datagram")`: inner packets ride as HTTP/3 datagrams
  when they fit the outer connection's `datagram_limit` (its `max_datagram_size` less 100 bytes
  of headroom: 1,100 at aioquic's default 1,200) and as capsules otherwise. aioquic's inner
  packets are full 1,200-byte datagrams (its `max_datagram_size` default, and its minimum, RFC
  9000's 1,200), so with stock outer packets the bulk data still goes as capsules and only the
  small inner packets (ACKs) go as datagrams; the table's `dgram%` column shows how much did.
- `capsule@N`, `datagram@N` (`--outer-mtu N`, default 1452; 0 leaves them out): the same with the
  *outer* connection's packets raised to N bytes on both ends (`MasqueProxy(max_datagram_size=N)`
  in a second proxy process, `UdpTunnel(max_datagram_size=N)`), so that a 1,200-byte inner packet
  fits one QUIC DATAGRAM frame (N >= 1,301). Loopback's MTU is 64 KiB; 1,452 is what a
  1,500-byte Ethernet path allows, so the numbers transfer to a real LAN.

The inner connection is plain aioquic QUIC with its own ALPN (`masque-goodput`), not HTTP/3: the
client opens one bidirectional stream, sends the byte count it wants, and the server answers with
that many bytes and FIN. Goodput = application bytes received / time from sending the request to
the last byte (handshakes and the tunnel's CONNECT are outside the timed span, and are reported
as `setup_s`). The inner configuration (aioquic defaults: Reno, 1 MB flow-control windows that
double as they fill) is the same on both paths, so only the path differs. Both inner endpoints
are built as the project's own HTTP/3 client and server are: `transport.connection`'s
`CoalescingProtocol` (one transmit per loop pass, not one per datagram received) and
`widen_receive_buffer`. The proxy and the tunnel run exactly as shipped.

The bulk server, the proxy and the client each run in their own process (multiprocessing,
`spawn`), as they would in production: in one process the proxy's relaying would compete with
the endpoints for one interpreter and one event loop, which understates the proxied path, and
the direct path would not pay the same. The server and the proxy live for the whole run; each
measurement gets a fresh client process. Rounds are interleaved (direct, capsule, datagram,
direct, ...) so that drift (thermal, other load) falls on all modes alike, and the table reports
medians. A 1 MB warm-up per mode comes first and is not recorded.

Each row also shows the CPU each process used during the timed span (from /proc, as % of one
core), and `ceiling`: the goodput scaled to the busiest process using a whole core. Every process
here is pure-Python aioquic and CPU-bound on loopback, so with fewer cores than processes (the
proxied path has three busy processes, the direct one two) the measured ratio also measures the
machine, and a job sharing the machine hurts the three-process path more. The ceiling ratio is
what separate machines (or a core each) would give, as long as the busiest process stays
CPU-bound; it is an upper bound, not a measurement. Read the measured ratio on a machine with at
least three idle cores, and the ceiling ratio elsewhere.

    .venv/bin/python -m benchmarks.masque_goodput [--mb 20] [--rounds 3] [--outer-mtu 1452]
        [--modes direct,capsule,datagram] [--loop asyncio|uvloop] [--profile client|proxy|server]

`--loop uvloop` runs every process on uvloop instead of asyncio's selector loop. asyncio's
datagram transport reads one datagram per socket per loop pass, so a coalesced transmit still
follows every datagram; libuv reads a batch per wake-up. Read its ratios with care: on uvloop
the direct path's bulk server used a whole core at a lower rate than on asyncio (about 95
against 145 Mbit/s on a 2-core VM), which flatters the proxied path.

`--profile ROLE` runs that process under cProfile, timed in CPU time (`time.process_time`: user
and system, so a `sendto` costs what the kernel's loopback delivery costs the sender, and time
spent idle in epoll or preempted by the other processes does not count). It slows that process,
so the goodput of such a run is not the headline number; it writes .prof files next to the CSV
and prints the top functions by own time.
Rows go to results/masque_goodput/goodput-<time>.csv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import csv
import io
import multiprocessing as mp
import os
import pstats
import queue
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any, TypeVar

from aioquic.asyncio import connect, serve
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamDataReceived
from tqdm import tqdm

from transport.connection import CoalescingProtocol, udp_transport
from transport.masque import AllowList
from transport.masque.proxy import MasqueProxy
from transport.masque.tunnel import UdpTunnel
from transport.tls import ensure_certificate
from transport.udp import widen_receive_buffer

ROOT = Path(__file__).resolve().parent.parent

ALPN = "masque-goodput"
KEY = "goodput-key"
HOST = "127.0.0.1"
MB = 1_000_000
CLIENT_TIMEOUT_S = 300.0
T = TypeVar("T")


# --- the bulk server (its own process) --------------------------------------------------------


class _BulkServer(CoalescingProtocol):
    """Answers each stream's request (an ASCII byte count, then FIN) with that many bytes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._requests: dict[int, bytearray] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        if not isinstance(event, StreamDataReceived):
            return
        request = self._requests.setdefault(event.stream_id, bytearray())
        request += event.data
        if event.end_stream:
            del self._requests[event.stream_id]
            # All at once: aioquic's stream buffer and congestion control pace it, which is what
            # a bulk sender on aioquic does anyway. Zeros cost the same to encrypt as anything.
            self._quic.send_stream_data(event.stream_id, bytes(int(request)), end_stream=True)
            self.transmit()


async def _serve_bulk(cert: str, key: str, ready: Any, stop: EventType) -> None:
    configuration = QuicConfiguration(is_client=False, alpn_protocols=[ALPN])
    configuration.load_cert_chain(cert, key)
    server = await serve(HOST, 0, configuration=configuration, create_protocol=_BulkServer)
    transport = udp_transport(server)
    widen_receive_buffer(transport.get_extra_info("socket"))  # as transport.http3 does
    ready.put(transport.get_extra_info("sockname")[1])
    # stop.wait blocks, so in a thread: the loop keeps serving meanwhile.
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    server.close()


# --- the proxy (its own process) --------------------------------------------------------------


async def _serve_proxy(
    cert: str, key: str, target_port: int, outer_mtu: int | None, ready: Any, stop: EventType
) -> None:
    # The knob only when asked, so that the stock proxy is built exactly as a deployment's is.
    options: dict[str, Any] = {} if outer_mtu is None else {"max_datagram_size": outer_mtu}
    proxy = MasqueProxy(
        {KEY: AllowList.parse([f"{HOST}:{target_port}"])},
        certfile=cert, keyfile=key, host=HOST, **options,
    )  # fmt: skip
    async with proxy:
        ready.put(proxy.port)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)


def _run_loop(main: Coroutine[Any, Any, T], loop: str) -> T:
    """`asyncio.run`, on uvloop's loop when asked (3.11's asyncio.run takes no loop factory)."""
    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


def _service(
    make: Callable[..., Coroutine[Any, Any, None]],
    args: tuple[Any, ...],
    profile: str | None,
    loop: str,
) -> None:
    """A long-lived process's body: run `make(*args)`, under cProfile when asked."""
    profiler = cProfile.Profile(time.process_time) if profile else None
    if profiler is not None:
        profiler.enable()
    try:
        _run_loop(make(*args), loop)
    finally:
        if profiler is not None and profile:
            profiler.disable()
            profiler.dump_stats(profile)


# --- the client (a fresh process per measurement) ---------------------------------------------


class _BulkClient(CoalescingProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._done: asyncio.Future[int] | None = None
        self._received = 0

    async def fetch(self, nbytes: int) -> tuple[int, float]:
        """(bytes received, seconds from sending the request to the last byte)."""
        self._done = asyncio.get_running_loop().create_future()
        self._received = 0
        stream_id = self._quic.get_next_available_stream_id()
        start = time.perf_counter()
        self._quic.send_stream_data(stream_id, str(nbytes).encode(), end_stream=True)
        self.transmit()
        received = await self._done
        return received, time.perf_counter() - start

    def quic_event_received(self, event: QuicEvent) -> None:
        done = self._done
        if done is None or done.done():
            return
        if isinstance(event, StreamDataReceived):
            self._received += len(event.data)
            if event.end_stream:
                done.set_result(self._received)
        elif isinstance(event, ConnectionTerminated):
            done.set_exception(ConnectionError(f"inner connection closed: {event.reason_phrase}"))


@dataclass
class Job:
    mode: str
    round: int
    nbytes: int
    server_port: int
    proxy_port: int
    cert: str
    outer_mtu: int | None = None
    profile: str | None = None
    loop: str = "asyncio"


@dataclass
class Result:
    mode: str
    round: int
    nbytes: int
    received: int = 0
    seconds: float = float("nan")
    setup_s: float = float("nan")
    mbit_s: float = float("nan")
    client_cpu: float = float("nan")
    """CPU seconds / timed seconds, per process (1.0 = one core busy)."""
    proxy_cpu: float = float("nan")
    server_cpu: float = float("nan")
    ceiling_mbit_s: float = float("nan")
    """`mbit_s` scaled to its busiest process using one core fully: the CPU-bound ceiling where
    each process has a core of its own, as in production (see the module docstring)."""
    sent_capsules: int = 0
    sent_datagrams: int = 0
    received_capsules: int = 0
    received_datagrams: int = 0
    error: str = ""


async def _measure(job: Job, events: Any) -> Result:
    result = Result(job.mode, job.round, job.nbytes)
    inner = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name="localhost")
    inner.load_verify_locations(job.cert)

    async def transfer(host: str, port: int, setup_start: float) -> None:
        async with connect(
            host, port, configuration=inner, create_protocol=_BulkClient, wait_connected=True
        ) as client:
            assert isinstance(client, _BulkClient)
            # As transport.client does: at the default 208 KiB a burst overflows the socket.
            widen_receive_buffer(udp_transport(client).get_extra_info("socket"))
            result.setup_s = time.perf_counter() - setup_start
            events.put(("start", None))  # the parent samples the other processes' CPU now
            cpu = time.process_time()
            result.received, result.seconds = await client.fetch(job.nbytes)
            result.client_cpu = (time.process_time() - cpu) / result.seconds
            events.put(("stop", None))
            result.mbit_s = result.received * 8 / result.seconds / 1e6

    setup_start = time.perf_counter()
    if job.mode == "direct":
        await transfer(HOST, job.server_port, setup_start)
        return result
    base, _, mtu = job.mode.partition("@")
    options: dict[str, Any] = {"max_datagram_size": int(mtu)} if mtu else {}
    # `as`: the object with `local_address` and the counters (the UdpTunnel itself, or the Tunnel
    # it opened, depending on the version of tunnel.py).
    async with UdpTunnel(
        HOST, job.proxy_port, HOST, job.server_port,
        key=KEY, verify=job.cert, mode=base, **options,  # type: ignore[arg-type]
    ) as tunnel:  # fmt: skip
        await transfer(*tunnel.local_address, setup_start)
        result.sent_capsules, result.sent_datagrams = tunnel.sent_capsules, tunnel.sent_datagrams
        result.received_capsules = tunnel.received_capsules
        result.received_datagrams = tunnel.received_datagrams
    return result


def _client(job: Job, events: Any) -> None:
    profiler = cProfile.Profile(time.process_time) if job.profile else None
    if profiler is not None:
        profiler.enable()
    try:
        result = _run_loop(asyncio.wait_for(_measure(job, events), CLIENT_TIMEOUT_S), job.loop)
    except Exception as error:  # report, so that one failed round does not end the run
        result = Result(job.mode, job.round, job.nbytes, error=f"{type(error).__name__}: {error}")
    if profiler is not None and job.profile:
        profiler.disable()
        profiler.dump_stats(job.profile)
    events.put(("result", result))


# --- the parent: start the services, run the rounds, report ---------------------------------


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux); NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Service:
    def __init__(
        self,
        ctx: Any,
        make: Callable[..., Coroutine[Any, Any, None]],
        args: tuple[Any, ...],
        profile: str | None,
        loop: str,
    ) -> None:
        self.ready = ctx.Queue()
        self.stop = ctx.Event()
        self.process = ctx.Process(
            target=_service,
            args=(make, (*args, self.ready, self.stop), profile, loop),
            daemon=True,
        )
        self.process.start()
        self.port: int = self.ready.get(timeout=60)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def close(self) -> None:
        self.stop.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _run_one(ctx: Any, job: Job, server: _Service, proxy: _Service | None) -> Result:
    events = ctx.Queue()
    process = ctx.Process(target=_client, args=(job, events))
    process.start()
    before: tuple[float, float, float] | None = None
    deltas: tuple[float, float] | None = None
    result: Result | None = None
    deadline = time.monotonic() + CLIENT_TIMEOUT_S + 30
    while result is None and time.monotonic() < deadline:
        try:
            kind, payload = events.get(timeout=1)
        except queue.Empty:
            if not process.is_alive():
                break
            continue
        if kind == "start":
            proxy_cpu = _cpu_seconds(proxy.pid) if proxy is not None else 0.0
            before = (time.perf_counter(), proxy_cpu, _cpu_seconds(server.pid))
        elif kind == "stop" and before is not None:
            wall = time.perf_counter() - before[0]
            proxy_cpu = _cpu_seconds(proxy.pid) if proxy is not None else 0.0
            deltas = ((proxy_cpu - before[1]) / wall, (_cpu_seconds(server.pid) - before[2]) / wall)
        elif kind == "result":
            result = payload
    process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join()
    if result is None:
        result = Result(job.mode, job.round, job.nbytes, error="client process gave no result")
    if deltas is not None:
        result.proxy_cpu = deltas[0] if proxy is not None else float("nan")
        result.server_cpu = deltas[1]
        busiest = max(c for c in (result.client_cpu, result.proxy_cpu, result.server_cpu) if c == c)
        if busiest > 0:
            result.ceiling_mbit_s = result.mbit_s / busiest
    return result


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN (failed rounds)
    return statistics.median(values) if values else float("nan")


def _table(results: list[Result], modes: list[str]) -> str:
    def ratio(value: float, base: float, mode: str) -> str:
        return f"{value / base:.0%}" if mode != "direct" and value == value and base > 0 else ""

    def pct(value: float) -> str:
        return "" if value != value else f"{value:.0%}"

    direct = _median([r.mbit_s for r in results if r.mode == "direct"])
    direct_ceiling = _median([r.ceiling_mbit_s for r in results if r.mode == "direct"])
    header = (
        f"{'mode':<15}{'ok':>4}{'Mbit/s':>9}{'min-max':>10}{'vs direct':>10}"
        f"{'client':>8}{'proxy':>7}{'server':>8}{'ceiling':>9}{'vs direct':>10}"
        f"{'dgram%':>8}{'setup ms':>9}"
    )
    lines = [header, "-" * len(header)]
    for mode in modes:
        rows = [r for r in results if r.mode == mode]
        ok = [r for r in rows if not r.error]
        rates = [r.mbit_s for r in ok]
        median = _median(rates)
        ceiling = _median([r.ceiling_mbit_s for r in ok])
        spread = f"{min(rates):.0f}-{max(rates):.0f}" if rates else "-"
        down = sum(r.received_capsules + r.received_datagrams for r in ok)
        dgram = sum(r.received_datagrams for r in ok) / down if down else float("nan")
        lines.append(
            f"{mode:<15}{len(ok):>2}/{len(rows):<1}{median:>9.1f}{spread:>10}"
            f"{ratio(median, direct, mode):>10}"
            f"{pct(_median([r.client_cpu for r in ok])):>8}"
            f"{pct(_median([r.proxy_cpu for r in ok])):>7}"
            f"{pct(_median([r.server_cpu for r in ok])):>8}"
            f"{ceiling:>9.1f}{ratio(ceiling, direct_ceiling, mode):>10}"
            f"{pct(dgram):>8}{_median([r.setup_s for r in ok]) * 1000:>9.0f}"
        )
    return "\n".join(lines)


def _print_profile(paths: list[Path], title: str, top: int) -> None:
    paths = [p for p in paths if p.exists()]
    if not paths:
        return
    out = io.StringIO()
    stats = pstats.Stats(str(paths[0]), stream=out)
    for path in paths[1:]:
        stats.add(str(path))
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    print(f"\n=== cProfile: {title} (by own time, {len(paths)} file(s)) ===")
    print(out.getvalue().split("\n\n", 1)[-1].rstrip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0, help="MB (10^6 bytes) per transfer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="direct,capsule,datagram", help="comma-separated")
    parser.add_argument(
        "--outer-mtu",
        type=int,
        default=1452,
        help="also run capsule@N and datagram@N, outer max_datagram_size N (0: don't)",
    )
    parser.add_argument(
        "--loop",
        choices=["asyncio", "uvloop"],
        default="asyncio",
        help="event loop in every process (asyncio: as `python -m transport.masque.proxy` runs)",
    )
    parser.add_argument("--profile", choices=["client", "proxy", "server"])
    parser.add_argument("--top", type=int, default=30, help="profile lines to print")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "results" / "masque_goodput"))
    args = parser.parse_args(argv)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.outer_mtu:
        modes += [f"capsule@{args.outer_mtu}", f"datagram@{args.outer_mtu}"]
    for mode in modes:
        base, _, mtu = mode.partition("@")
        if base not in ("direct", "capsule", "datagram") or (mtu and not mtu.isdigit()):
            parser.error(f"unknown mode {mode!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    nbytes = int(args.mb * MB)
    cert, key = (str(p) for p in ensure_certificate())
    ctx = mp.get_context("spawn")  # no inherited event loop or sockets in the children

    def profile_path(role: str, suffix: str = "") -> str | None:
        if args.profile != role:
            return None
        return str(out / f"profile-{stamp}-{role}{suffix}.prof")

    started = time.perf_counter()
    server = _Service(ctx, _serve_bulk, (cert, key), profile_path("server"), args.loop)
    proxies: dict[int | None, _Service] = {}
    try:
        for mode in modes:
            mtu = int(mode.partition("@")[2] or 0) or None
            if mode != "direct" and mtu not in proxies:
                suffix = f"@{mtu}" if mtu else ""
                proxies[mtu] = _Service(
                    ctx,
                    _serve_proxy,
                    (cert, key, server.port, mtu),
                    profile_path("proxy", suffix),
                    args.loop,
                )

        def job(mode: str, round_: int, size: int) -> tuple[Job, _Service | None]:
            mtu = int(mode.partition("@")[2] or 0) or None
            proxy = proxies.get(mtu) if mode != "direct" else None
            profile = profile_path("client", f"-{mode}-r{round_}") if round_ >= 0 else None
            return (
                Job(
                    mode=mode,
                    round=round_,
                    nbytes=size,
                    server_port=server.port,
                    proxy_port=proxy.port if proxy else 0,
                    cert=cert,
                    outer_mtu=mtu,
                    profile=profile,
                    loop=args.loop,
                ),  # fmt: skip
                proxy,
            )

        if not args.no_warmup:
            for mode in modes:
                warm, proxy = job(mode, -1, MB)
                result = _run_one(ctx, warm, server, proxy)
                if result.error:
                    print(f"warm-up {mode}: {result.error}", file=sys.stderr)

        plan = [(r, mode) for r in range(args.rounds) for mode in modes]  # interleaved
        results: list[Result] = []
        for round_, mode in tqdm(plan, desc="transfers", unit="xfer"):
            this_job, proxy = job(mode, round_, nbytes)
            result = _run_one(ctx, this_job, server, proxy)
            if result.error:
                tqdm.write(f"{mode} round {round_}: {result.error}")
            results.append(result)
    finally:
        for proxy in proxies.values():
            proxy.close()
        server.close()
    elapsed = time.perf_counter() - started

    csv_path = out / f"goodput-{stamp}.csv"
    columns = list(Result.__dataclass_fields__)
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for result in results:
            writer.writerow(asdict(result))

    print(
        f"\n{args.mb:g} MB per transfer, {args.rounds} interleaved round(s), loopback, "
        f"{os.cpu_count()} CPU(s), Python {sys.version.split()[0]}, {args.loop} loop"
        + (f"; {args.profile} under cProfile" if args.profile else "")
    )
    print(_table(results, modes))
    print(
        "client/proxy/server: CPU time / timed span, per process (100% = one core). ceiling: "
        "Mbit/s if the busiest process had a whole core.\ndgram%: the share of the proxy's "
        "packets to the client that came as HTTP/3 datagrams. Medians over the rounds."
    )
    print(f"rows: {csv_path}   ({elapsed:.0f} s in all)")

    if args.profile == "client":
        for mode in modes:
            paths = [Path(p) for r in range(args.rounds) if (p := job(mode, r, nbytes)[0].profile)]
            _print_profile(paths, f"client, {mode}", args.top)
    elif args.profile:
        for mtu in [None, *[m for m in proxies if m]] if args.profile == "proxy" else [None]:
            suffix = f"@{mtu}" if mtu else ""
            path = profile_path(args.profile, suffix)
            if path:
                _print_profile([Path(path)], args.profile + suffix, args.top)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
