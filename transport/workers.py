"""`--workers N`: N front-end processes serving one set of ports, under a supervisor.

The supervisor binds every socket itself: per port, N sockets in one `SO_REUSEPORT` group, and
worker i inherits the i-th TCP listener and the i-th UDP socket. The kernel hands each new TCP
connection, and each UDP datagram, to a socket of the group by a hash of its 4-tuple modulo the
group's size. The supervisor keeps every socket open, so the group never changes size: a
worker that dies moves no other worker's connections, its own socket goes on queueing (UDP up
to its receive buffer, TCP up to its backlog), and its restart serves from the same socket.
(Were each worker to bind its own, a death would shrink the group and rehash every other
worker's QUIC connections onto sockets that do not know them.)

A client whose address changes (a NAT rebinding, QUIC connection migration) hashes afresh: with
one chance in N it lands on its worker and carries on; otherwise the worker it lands on does
not know its connection ID and answers with a stateless reset (below), after which the client
connects again. Steering by connection ID instead (the worker's
index in the IDs it issues, read by a BPF reuseport program, as Envoy does) would carry such
clients too; it is not built.

While a worker is down and another serves, the supervisor stands in for it on its UDP socket:
it answers its clients' packets with stateless resets, from the key every worker's tokens derive
from (`transport.stateless_reset`), and refuses new connections there, so that each client
learns at once that its connection is gone and connects again, onto a worker that runs. Once the
restarted worker says it serves (a byte on a pipe, `--ready-fd`), the socket is its own again;
it too resets the connections it does not know. With no worker serving, the supervisor leaves
the socket alone: what queues there waits for the restart.

The supervisor restarts a worker that exits without being asked, after a backoff that doubles
from RESTART_FIRST_S to RESTART_MAX_S and starts again once a worker has run HEALTHY_S. SIGTERM
or SIGINT is passed on to every worker, which drains as a single server does (a second signal
cuts the drain short there too); the supervisor exits once they all have, 0 if they all did so
cleanly. Workers sit in process groups of their own, so that a terminal's Ctrl-C reaches them
once, through the supervisor, and each dies with the supervisor if it is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import FrameType

from aioquic.quic.configuration import QuicConfiguration

from transport.server import Listen
from transport.stateless_reset import ResetKey, ResetResponder
from transport.udp import MAX_DATAGRAM, BatchedDatagramTransport, widen_receive_buffer

logger = logging.getLogger(__name__)

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 10.0
HEALTHY_S = 30.0
"""A worker that ran this long before it died is restarted after RESTART_FIRST_S again."""
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="front-end processes sharing the ports, under a supervisor that restarts any that "
        "dies (default: %(default)s, one process and no supervisor)",
    )
    # What the supervisor tells a worker; not for people.
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tcp-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--udp-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def as_worker(listen: Listen, args: argparse.Namespace) -> Listen:
    """Make this process a supervised worker: it dies with its supervisor, and serves on the
    sockets handed down to it. Its `listen`."""
    die_with_parent()
    tcp = socket.socket(fileno=args.tcp_fd) if args.tcp_fd is not None else None
    udp = socket.socket(fileno=args.udp_fd) if args.udp_fd is not None else None
    return replace(
        listen,
        tcp_port=tcp.getsockname()[1] if tcp is not None else None,
        udp_port=udp.getsockname()[1] if udp is not None else None,
        tcp_socket=tcp,
        udp_socket=udp,
        ready_fd=args.ready_fd,
    )


def die_with_parent() -> None:
    """Have the kernel send this process SIGTERM (a graceful stop) when its parent dies, however
    it dies: a worker (or the engine host) must not run on, unsupervised, after a SIGKILL of its
    supervisor."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the supervisor died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class WorkerSockets:
    tcp: socket.socket | None
    udp: socket.socket | None

    def fds(self) -> list[str]:
        given = []
        if self.tcp is not None:
            given += ["--tcp-fd", str(self.tcp.fileno())]
        if self.udp is not None:
            given += ["--udp-fd", str(self.udp.fileno())]
        return given


def bind_groups(listen: Listen, workers: int) -> list[WorkerSockets]:
    """Each worker's sockets, on `listen`'s ports."""
    tcp = _group(listen.host, listen.tcp_port, socket.SOCK_STREAM, workers)
    udp = _group(listen.host, listen.udp_port, socket.SOCK_DGRAM, workers)
    return [WorkerSockets(tcp[i] if tcp else None, udp[i] if udp else None)
            for i in range(workers)]  # fmt: skip


def _group(host: str, port: int | None, kind: int, size: int) -> list[socket.socket]:
    if port is None:
        return []
    family, _, _, _, address = socket.getaddrinfo(host, port, type=kind)[0]
    group: list[socket.socket] = []
    for _ in range(size):
        sock = socket.socket(family, kind)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if kind == socket.SOCK_STREAM:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        if kind == socket.SOCK_STREAM:
            sock.listen(2048)  # as DualServer's own listener (its backlog comment says why)
        else:
            widen_receive_buffer(sock)
        sock.set_inheritable(True)
        group.append(sock)
    return group


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff_s: float = RESTART_FIRST_S
    restart_at: float | None = None
    ready: bool = False
    """It said it serves, and has not died since."""
    ready_pipe: int | None = None
    """Where it says so: the read end of its `--ready-fd`, until it has spoken or died."""
    stood_in: tuple[int, int, int] | None = None
    """Since its death: the stand-in's counts (resets, refusals, held back) when it died."""


class Supervisor:
    """Runs `python -m <module> <argv>` as N workers on the sockets of `bind_groups`."""

    def __init__(
        self,
        module: str,
        argv: Sequence[str],
        sockets: list[WorkerSockets],
        on_death: Callable[[int, int], None] = lambda index, pid: None,
        env: Mapping[str, str] | None = None,
        reset_key: ResetKey | None = None,
    ) -> None:
        """`on_death(index, pid)` runs when a worker is found dead, before its restart; `env`
        is added to the workers' environment. With `reset_key`, the workers' key (handed down
        in their environment), the supervisor stands in for a dead worker."""
        self.module = module
        self.argv = list(argv)
        self.sockets = sockets
        self.on_death = on_death
        env = {**(env or {}), **(reset_key.env() if reset_key is not None else {})}
        self.env = {**os.environ, **env} if env else None
        self.workers = [_Worker(i) for i in range(len(sockets))]
        self.responder = (
            ResetResponder(reset_key, QuicConfiguration.connection_id_length)
            if reset_key is not None
            else None
        )
        self._signals: list[int] = []

    def _start(self, worker: _Worker) -> None:
        given = self.sockets[worker.index]
        ready_read, ready_write = os.pipe()
        command = [sys.executable, "-m", self.module, *self.argv,
                   "--worker-index", str(worker.index), *given.fds(),
                   "--ready-fd", str(ready_write)]  # fmt: skip
        fds = [s.fileno() for s in (given.tcp, given.udp) if s is not None] + [ready_write]
        try:
            worker.process = subprocess.Popen(command, pass_fds=fds, process_group=0, env=self.env)
        finally:
            os.close(ready_write)
        worker.ready_pipe = ready_read
        worker.started, worker.restart_at = time.monotonic(), None
        logger.info("worker %d started (pid %d)", worker.index, worker.process.pid)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def run(self) -> int:
        """Serve until a stop signal, then until every worker has stopped; the exit status."""
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, self._on_signal)
        for worker in self.workers:
            self._start(worker)
        stopping = False
        while True:
            while self._signals:
                signum = self._signals.pop(0)
                stopping = True
                logger.info("passing %s on to the workers", signal.Signals(signum).name)
                for worker in self.workers:
                    if worker.process is not None and worker.process.poll() is None:
                        worker.process.send_signal(signum)
            if stopping and all(w.process is None or w.process.poll() is not None
                                for w in self.workers):  # fmt: skip
                return 0 if all(w.process is None or w.process.returncode == 0
                                for w in self.workers) else 1  # fmt: skip
            if not stopping:
                self._tend(time.monotonic())
            self._wait(_POLL_S, stand_in=not stopping)

    def _wait(self, timeout: float, stand_in: bool) -> None:
        """Sleep up to `timeout`, hearing the workers that say they serve, and answering on
        the sockets of those that are down."""
        pipes = {w.ready_pipe: w for w in self.workers if w.ready_pipe is not None}
        sockets = self._stood_in() if stand_in else []
        if not pipes and not sockets:
            time.sleep(timeout)
            return
        watched = [*pipes, *(sock.fileno() for sock in sockets)]
        readable, _, _ = select.select(watched, [], [], timeout)
        for fd in readable:
            if fd in pipes:
                self._heard(pipes[fd])
        for sock in self._stood_in():  # less any worker that said it serves just now
            if sock.fileno() in readable:
                self._answer(sock)

    def _heard(self, worker: _Worker) -> None:
        assert worker.ready_pipe is not None
        said = os.read(worker.ready_pipe, 1)
        os.close(worker.ready_pipe)
        worker.ready_pipe = None
        if said and worker.process is not None and worker.process.poll() is None:
            worker.ready = True
            logger.info("worker %d ready (pid %d)", worker.index, worker.process.pid)
            if worker.stood_in and self.responder is not None:
                resets, refusals, limited = worker.stood_in
                logger.info(
                    "stood in for worker %d while it was down: %d resets, %d connections "
                    "refused, %d answers held back by the rate limit",
                    worker.index,
                    self.responder.resets - resets,
                    self.responder.refusals - refusals,
                    self.responder.limited - limited,
                )
            worker.stood_in = None

    def _stood_in(self) -> list[socket.socket]:
        """The UDP sockets of the workers that are down, while another serves."""
        if self.responder is None or not any(w.ready for w in self.workers):
            return []
        given = (self.sockets[w.index].udp for w in self.workers if not w.ready)
        return [sock for sock in given if sock is not None]

    def _answer(self, sock: socket.socket) -> None:
        """A reset for each packet of a connection the dead worker had, a refusal for each new
        connection; flags, not the socket's mode, keep it from blocking: the worker that died
        had made the socket (shared with this process) non-blocking, the next will again."""
        assert self.responder is not None
        for _ in range(BatchedDatagramTransport.max_batch):
            try:
                data, addr = sock.recvfrom(MAX_DATAGRAM, socket.MSG_DONTWAIT)
            except OSError:  # nothing left, or an ICMP error queued on the socket
                return
            answer = self.responder.respond(data, time.monotonic())
            if answer is not None:
                with contextlib.suppress(OSError):  # a full socket buffer: the client asks again
                    sock.sendto(answer, socket.MSG_DONTWAIT, addr)

    def _tend(self, now: float) -> None:
        """Restart the workers that died, each after its backoff."""
        for worker in self.workers:
            if worker.restart_at is not None:
                if now >= worker.restart_at:
                    self._start(worker)
                continue
            if worker.process is None or (status := worker.process.poll()) is None:
                continue
            worker.ready = False
            if self.responder is not None and worker.stood_in is None:
                responder = self.responder
                worker.stood_in = (responder.resets, responder.refusals, responder.limited)
            if worker.ready_pipe is not None:
                os.close(worker.ready_pipe)
                worker.ready_pipe = None
            self.on_death(worker.index, worker.process.pid)
            if now - worker.started >= HEALTHY_S:
                worker.backoff_s = RESTART_FIRST_S
            logger.error(
                "worker %d (pid %d) exited with %s; restarting it in %.1f s",
                worker.index,
                worker.process.pid,
                _status(status),
                worker.backoff_s,
            )
            worker.restart_at = now + worker.backoff_s
            worker.backoff_s = min(worker.backoff_s * 2, RESTART_MAX_S)


def _status(code: int) -> str:
    if code < 0:
        return signal.Signals(-code).name
    return f"status {code}"


def supervise(
    module: str,
    argv: Sequence[str],
    listen: Listen,
    workers: int,
    on_death: Callable[[int, int], None] = lambda index, pid: None,
    env: Mapping[str, str] | None = None,
    reset_key: ResetKey | None = None,
) -> int:
    """Bind the ports for `workers` workers and supervise them until a stop signal."""
    sockets = bind_groups(listen, workers)
    ports = (("tcp", listen.tcp_port), ("udp", listen.udp_port))
    bound = [f"{kind} {listen.host}:{port}" for kind, port in ports if port]
    logger.info("%d workers on %s", workers, " and ".join(bound))
    return Supervisor(module, _without_workers(argv), sockets, on_death, env, reset_key).run()


def _without_workers(argv: Sequence[str]) -> list[str]:
    """`argv` less its `--workers N` (or `--workers=N`): a worker's own command line."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            kept.append(arg)
    return kept
