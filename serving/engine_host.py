"""`python -m serving.engine_host --deployment embedded-sim --socket PATH`: a deployment's engines
in a process of their own, served over the engine link (`serving.engines.engine_link`) to every
front-end worker that connects to PATH. `python -m serving --workers N` starts one for a
deployment whose engines are not remote; it is seldom run by hand.

`--listen HOST:PORT --link-token-file FILE` serves the link on TCP instead, to the front-ends
of every host: one engine host per node, running the replicas whose placement entries name it
(`engine_host: NAME:PORT`, `--as` where that is not the listening address). Every front-end
connected hears each replica's load, so each sees what all of them put there.

Each request runs as a task that reads its engine's deltas; every delta of one pass of the event
loop (an engine step's worth) leaves in one frame per worker. The replicas are supervised here
as in a single server (`ReplicaSet`): an engine that dies is restarted, and its requests end in
errors that reach their workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hmac
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from config import ConfigError, load_deployment
from config.deployment import DEFAULT_PATH
from serving.engines.base import EngineError, EngineUnavailable, InvalidRequest, Sampling
from serving.engines.engine_link import (
    CONNECT_TIMEOUT_S,
    HEARTBEAT_S,
    LOAD_REPORT_S,
    MAX_HELLO_BYTES,
    MIN_TOKEN_CHARS,
    FrameReader,
    delta_row,
    frame,
    keep_alive,
    link_address,
    rate_frame,
    read_link_token,
)
from serving.replicas import Replica, ReplicaSet
from transport.workers import die_with_parent
from workloads.request import request_from_row

log = logging.getLogger(__name__)

RESTART_S = 0.5
"""How long after a dead engine host a new one starts; doubled while they keep dying, until
one has run RESTART_STABLE_S."""
RESTART_MAX_S = 10.0
RESTART_STABLE_S = 30.0
DRAIN_S = 30.0


@dataclass
class _Batch:
    """What one worker is owed from this pass of the event loop."""

    rows: list[list[Any]]
    scheduled: bool = False


class _Worker(asyncio.Protocol):
    """One worker's connection: its requests' tasks, and the frame it is owed."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(self._on_frame)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.out = _Batch([])
        self.others: list[list[Any]] = []
        self.peer = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "the Unix socket"
        if isinstance(peer, tuple):  # a front-end whose node vanishes is let go in ~10 s
            keep_alive(transport)
        if self.host.token is None:
            self._welcome()
        else:
            asyncio.get_running_loop().call_later(
                CONNECT_TIMEOUT_S, self._refuse_unwelcome, "no hello in time"
            )

    def _welcome(self) -> None:
        assert self.transport is not None
        self.host.workers.add(self)
        self.transport.write(frame(["load", self.host.loads()]))

    def _hello(self, message: list[Any]) -> None:
        """A front-end's first frame, where the host has a token: its own, or it is refused."""
        assert self.transport is not None and self.host.token is not None
        hello = isinstance(message, list) and len(message) == 2 and message[0] == "hello"
        given = message[1] if hello else None
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self.host.token.encode()):
            self._welcome()
            return
        self._refuse_unwelcome("wrong link token" if isinstance(given, str) else "no link token")

    def _refuse_unwelcome(self, why: str) -> None:
        """Turn away a connection not yet welcomed (and nothing once it is)."""
        if self in self.host.workers or self.transport is None or self.transport.is_closing():
            return
        log.warning("refused a front-end at %s: %s", self.peer, why)
        self.transport.write(frame(["refused", why]))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        # The worker is gone: what it asked for is nobody's any more.
        self.host.workers.discard(self)
        for task in self.tasks.values():
            task.cancel()

    def data_received(self, data: bytes) -> None:
        welcomed = self in self.host.workers
        if not welcomed and (self.reader.next_size(data) or 0) > MAX_HELLO_BYTES:
            self._refuse_unwelcome("not the engine link")
            return
        try:
            self.reader.feed(data)
        except (msgspec.DecodeError, ValueError, IndexError, TypeError):
            if not welcomed:
                self._refuse_unwelcome("not the engine link")
                return
            raise  # a front-end's own bytes that do not parse: a fault to see

    def _on_frame(self, message: list[Any]) -> None:
        if self not in self.host.workers:  # nothing before a welcome
            if self.transport is not None and not self.transport.is_closing():
                self._hello(message)
            return
        if message[0] == "hello":
            return  # a token the host does not ask for
        if message[0] == "add":
            _, request, replica, sampling = message
            try:
                request = request_from_row(request)
                sampling = Sampling(**{**sampling, "stop": tuple(sampling["stop"])})
            except (ValueError, TypeError, KeyError) as exc:
                why = f"a request the engine host cannot read: {exc}"
                request_id = request.get("request_id", "")
                self.send_later(["error", request_id, "invalid", why, None, None])
                return
            serving = self._serve(request, replica, sampling)
            self.tasks[request.request_id] = asyncio.get_running_loop().create_task(serving)
        elif message[0] == "abort" and (aborted := self.tasks.get(message[1])) is not None:
            aborted.cancel()
        elif message[0] == "rate" and rate_frame(message) is not None:
            self.host.pass_on(self, message)

    async def _serve(self, request: Any, name: str, sampling: Sampling) -> None:
        request_id = request.request_id
        try:
            replica = self.host.replica(name)
            async for delta in replica.engine.generate(request, sampling):
                self.send_delta(delta_row(request_id, delta))
            self.send_later(["end", request_id])
        except EngineUnavailable as exc:
            self.send_later(["error", request_id, "unavailable", str(exc), None, None])
        except InvalidRequest as exc:
            self.send_later(["error", request_id, "invalid", exc.message, exc.param, exc.code])
        except EngineError as exc:
            self.send_later(["error", request_id, "engine", str(exc), None, None])
        except Exception as exc:
            log.exception("%s: unexpected error", name)
            self.send_later(["error", request_id, "engine", f"{name}: {type(exc).__name__}",
                             None, None])  # fmt: skip
        finally:
            self.tasks.pop(request_id, None)

    def send_delta(self, row: list[Any]) -> None:
        self.out.rows.append(row)
        self._schedule()

    def send_later(self, message: list[Any]) -> None:
        """A message that goes after this pass's deltas (a request's end or error)."""
        self.others.append(message)
        self._schedule()

    def _schedule(self) -> None:
        if not self.out.scheduled:
            self.out.scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        rows, others = self.out.rows, self.others
        self.out, self.others = _Batch([]), []
        if self.transport is None or self.transport.is_closing():
            return
        data = frame(["out", rows]) if rows else b""
        self.transport.write(data + b"".join(frame(m) for m in others))


class EngineHost:
    def __init__(self, replicas: ReplicaSet, token: str | None = None) -> None:
        self.replicas = replicas
        self.token = token
        self._by_name = {r.name: r for r in replicas}
        self.workers: set[_Worker] = set()
        self.draining = False
        """Stopping: every replica reports down, so that the front-ends send no more, while
        the requests in flight finish."""

    def replica(self, name: str) -> Replica:
        replica = self._by_name.get(name)
        if replica is None:
            raise EngineUnavailable(f"the engine host runs no replica {name!r}")
        return replica

    def loads(self) -> dict[str, list[Any]]:
        """Each replica's requests in its engine (running and waiting as one), no batch cap of
        its own (the deployment's profile has it), and whether it is up."""
        up = not self.draining
        return {r.name: [r.engine.unfinished(), 0, 0, up and r.engine.healthy()]
                for r in self.replicas}  # fmt: skip

    def pass_on(self, sender: _Worker, message: list[Any]) -> None:
        """A front-end's arrival-rate level, to every other front-end (`serving.fleet_rate`)."""
        data = frame(message)
        for worker in self.workers:
            transport = worker.transport
            if worker is not sender and transport is not None and not transport.is_closing():
                transport.write(data)

    @property
    def in_flight(self) -> int:
        return sum(len(worker.tasks) for worker in self.workers)

    async def drain(self, timeout_s: float) -> None:
        """Report every replica down, and wait up to `timeout_s` for the requests in flight."""
        self.draining = True
        if self.in_flight:
            log.info("draining: %d requests in flight, up to %g s", self.in_flight, timeout_s)
        async with asyncio.timeout(timeout_s):
            while self.in_flight:
                await asyncio.sleep(0.1)

    async def report_loads(self) -> None:
        """Every LOAD_REPORT_S, each replica's load to every worker, when it changed; every
        HEARTBEAT_S when it did not, so that a front-end on another host tells a host that is
        idle from one that is gone."""
        last: dict[str, list[Any]] = {}
        sent_at = 0.0
        while True:
            await asyncio.sleep(LOAD_REPORT_S)
            now = self.loads()
            if now != last or time.monotonic() - sent_at >= HEARTBEAT_S:
                data = frame(["load", now])
                for worker in self.workers:
                    if worker.transport is not None and not worker.transport.is_closing():
                        worker.transport.write(data)
                last, sent_at = now, time.monotonic()


@contextlib.asynccontextmanager
async def link_server(
    replicas: ReplicaSet, path: str, token: str | None = None
) -> AsyncIterator[EngineHost]:
    """Serve the engine link for `replicas` (started) at `path`, a Unix socket's or HOST:PORT,
    in the block; with `token`, only to front-ends that give it."""
    host = EngineHost(replicas, token)
    where = link_address(path)
    loop = asyncio.get_running_loop()
    if isinstance(where, str):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        server = await loop.create_unix_server(lambda: _Worker(host), path)
    else:
        server = await loop.create_server(lambda: _Worker(host), *where)
    reports = asyncio.create_task(host.report_loads())
    try:
        yield host
    finally:
        reports.cancel()
        server.close()
        for worker in list(host.workers):
            if worker.transport is not None:
                worker.transport.close()
        if isinstance(where, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


async def serve(
    replicas: ReplicaSet, path: str, token: str | None = None, drain_s: float = DRAIN_S
) -> None:
    """Start the engines, then serve the link at `path` until SIGTERM or SIGINT; then give the
    requests in flight up to `drain_s` to finish (a pod that leaves its Service finishes what it
    serves)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await replicas.start()
    try:
        gc.collect()
        gc.freeze()  # as the server does after its engines start (serving.app says why)
        # Bound only once every engine runs: a worker that can connect finds them ready.
        async with link_server(replicas, path, token) as host:
            log.info("engines of %d replicas served on %s", len(replicas.replicas), path)
            await stop.wait()
            with contextlib.suppress(TimeoutError):
                await host.drain(drain_s)
            if host.in_flight:
                log.warning("stopping with %d requests in flight", host.in_flight)
    finally:
        await replicas.close()


@contextlib.contextmanager
def hosted(argv: list[str], stop_timeout_s: float = 60.0) -> Iterator[str]:
    """An engine host started with `argv` (its options but --socket), ready: the path of its
    link. One that dies is started again on the same path (after RESTART_S, doubling while it
    keeps dying), and the workers' replicas reconnect to it as to a server back up. It is
    stopped (SIGTERM, then SIGKILL after `stop_timeout_s`) when the block ends. RuntimeError
    if the first one exits before its engines run."""
    folder = tempfile.mkdtemp(prefix="qos-engines-")
    path = str(Path(folder) / "link.sock")
    # A process group of its own, so that a terminal's Ctrl-C does not stop the engines under
    # workers still draining: the block's end stops them, after the workers.
    command = [sys.executable, "-m", "serving.engine_host", *argv, "--socket", path]
    running = [subprocess.Popen(command, process_group=0)]
    stopping = threading.Event()

    def restart() -> None:
        wait, started = RESTART_S, time.monotonic()
        while not stopping.wait(0.2):
            if (code := running[-1].poll()) is None:
                continue
            if time.monotonic() - started > RESTART_STABLE_S:
                wait = RESTART_S
            log.error("the engine host exited with %s; starting it again in %g s", code, wait)
            if stopping.wait(wait):
                return
            running.append(subprocess.Popen(command, process_group=0))
            wait, started = min(wait * 2, RESTART_MAX_S), time.monotonic()

    try:
        while not _answers(path):
            if running[0].poll() is not None:
                raise RuntimeError(f"the engine host exited with {running[0].returncode}")
            time.sleep(0.1)
        watcher = threading.Thread(target=restart, name="engine host", daemon=True)
        watcher.start()
        yield path
    finally:
        stopping.set()
        process = running[-1]
        process.terminate()
        try:
            process.wait(stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(folder)


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The engine host's arguments, checked as far as they can be without reading a file
    (tests/test_manifests.py parses the manifests' with it); exits with a usage error."""
    parser = argparse.ArgumentParser(prog="python -m serving.engine_host", description=__doc__)
    parser.add_argument("--config", default=str(DEFAULT_PATH))
    parser.add_argument("--deployment")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="the Unix socket to serve the link on")
    where.add_argument(
        "--listen", metavar="HOST:PORT",
        help="serve the link on TCP, to front-ends on other hosts (needs --link-token-file)",
    )  # fmt: skip
    parser.add_argument(
        "--as", dest="name", metavar="HOST:PORT",
        help="with --listen: the engine_host its placement entries name (default: --listen's)",
    )  # fmt: skip
    parser.add_argument(
        "--link-token-file",
        help="the shared secret a front-end must give (a mounted Kubernetes Secret; at least "
        f"{MIN_TOKEN_CHARS} characters)",
    )
    parser.add_argument("--time-scale", type=float, help="as python -m serving's")
    parser.add_argument(
        "--drain-s", type=float, default=DRAIN_S,
        help="on SIGTERM, report every replica down and give the requests in flight this long "
        "to finish (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.name is not None and args.listen is None:
        parser.error("--as names an engine host on TCP: give --listen too")
    if args.listen is not None and args.link_token_file is None:
        parser.error("--listen needs --link-token-file: the engines take requests from the network")
    if args.listen is not None and isinstance(link_address(args.listen), str):
        parser.error(f"--listen: {args.listen!r} is not HOST:PORT")
    return parser, args


def main() -> int:
    parser, args = parse_args()
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s [engine host] %(name)s: %(message)s",
    )
    try:
        token = read_link_token(args.link_token_file) if args.link_token_file else None
    except (OSError, ValueError) as exc:
        parser.error(f"--link-token-file: {exc}")
    try:
        deployment = load_deployment(args.config, args.deployment)
        if args.time_scale is not None:
            deployment = deployment.with_time_scale(args.time_scale)
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
    # On TCP it runs the replicas its placement names it for; on a Unix socket, those of the
    # server that started it.
    name = (args.name or args.listen) if args.listen is not None else None
    mine = deployment.run_by(name)
    if not mine.replicas:
        named = ", ".join(deployment.engine_hosts) or "none"
        parser.exit(2, f"error: no replica of deployment {deployment.name} is placed on engine "
                       f"host {name or 'this server'} (engine hosts named: {named})\n")  # fmt: skip
    if args.socket is not None:
        die_with_parent()  # started by `python -m serving --workers N`, it goes with it
    where = args.socket or args.listen
    asyncio.run(serve(ReplicaSet.from_deployment(mine), where, token, args.drain_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
