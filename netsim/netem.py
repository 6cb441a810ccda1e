"""A link emulator between network namespaces, for real kernel TCP and UDP alike.

The development VM's kernel has no `sch_netem`, so the link is emulated in user space: each link
is a pair of TUN devices, one in the namespace at either end, and `netsim.forwarder` copies the
IP packets between them through `netsim.link`'s model (rate or delivery trace, delay, loss).

Topologies:
- `pair`: a client and a server;
- `chain`: client → middle → server, the middle forwarding (or proxying) between two links;
- `star`: several clients, each on its own link, and one server.

The server answers at one address from every client (`Netem.server_address`, on its loopback);
in a chain the middle is at `Netem.middle_address`. Every address is in 10.77.0.0/16 inside the
namespaces made here, and the forwarder drops anything addressed elsewhere.

As a shell, like Mahimahi's `mm-link`:

    python -m netsim.netem --rate-mbps 5 --delay-ms 25 --loss 0.005 \\
        --server-cmd 'python -m serving --host 0.0.0.0' -- python -m workloads.chat ...

runs the server command in the server's namespace and CMD in the client's, with `NETEM_SERVER`
set to the server's address, and tears everything down when CMD exits or on a signal. Each
emulator holds a lock file while it lives; at start, namespaces whose owner is gone (killed, even
by SIGKILL) are removed with whatever still runs in them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import pickle
import signal
import struct
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, TypedDict, Unpack

from netsim.forwarder import LinkFds, Spec
from netsim.link import DeliveryTrace, GilbertElliott, LinkConfig

Topology = Literal["pair", "chain", "star"]
TOPOLOGIES: tuple[Topology, ...] = ("pair", "chain", "star")

PREFIX = "qnetem-"
"""Every namespace made here is named qnetem-<instance>-<role>."""
LOCKS = Path("/run/qnetem")
SERVER_ADDRESS = "10.77.255.1"
NETWORK = "10.77.0.0/16"

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000


class PopenOptions(TypedDict, total=False):
    """What `Netem.popen` passes on to `subprocess.Popen` (bytes mode), besides `env`."""

    cwd: str | os.PathLike[str]
    stdin: int | IO[Any] | None
    stdout: int | IO[Any] | None
    stderr: int | IO[Any] | None


class NetemError(Exception):
    """The emulator cannot be set up as asked; the message says why."""


def check_can_run() -> None:
    if os.geteuid() != 0:
        raise NetemError("the link emulator makes network namespaces and TUN devices: run as root")
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        raise NetemError("/dev/net/tun is missing or not writable: the kernel has no TUN devices")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NetemError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _remove_namespace(name: str) -> None:
    """Kill what runs in it, then delete it. Its TUN devices went with the forwarder."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _held(lock: Path) -> bool:
    """Whether a live emulator holds this lock (the kernel frees a lock when its owner dies)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def clean_stale() -> list[str]:
    """Remove the namespaces of emulators that are gone; returns their names."""
    removed = []
    for name in _namespaces():
        if not name.startswith(PREFIX):
            continue
        instance = name[len(PREFIX) :].split("-")[0]
        lock = LOCKS / f"{instance}.lock"
        if not _held(lock):
            _remove_namespace(name)
            lock.unlink(missing_ok=True)
            removed.append(name)
    return removed


class Netem:
    """`with Netem(LinkConfig(...)) as net:` then `net.popen(net.client, [...])`.

    `links`: one `LinkConfig` for every link, or one each (a chain has two links, a star one per
    client)."""

    def __init__(
        self,
        links: LinkConfig | Sequence[LinkConfig],
        topology: Topology = "pair",
        clients: int = 1,
        stats_path: str | Path | None = None,
    ) -> None:
        if topology not in TOPOLOGIES:
            raise NetemError(f"unknown topology {topology!r}; choose from {', '.join(TOPOLOGIES)}")
        if clients < 1 or (clients > 1 and topology != "star"):
            raise NetemError("several clients need the star topology; give at least one")
        count = {"pair": 1, "chain": 2, "star": clients}[topology]
        configs = [links] * count if isinstance(links, LinkConfig) else list(links)
        if len(configs) != count:
            raise NetemError(f"a {topology} of {clients} client(s) has {count} link(s)")
        self.configs = configs
        self.topology = topology
        self.instance = uuid.uuid4().hex[:8]
        self.server = self._name("server")
        self.clients = [self._name(f"client{i}") for i in range(count if topology == "star" else 1)]
        self.middle = self._name("middle") if topology == "chain" else None
        self.server_address = SERVER_ADDRESS
        self.middle_address = "10.77.0.2" if topology == "chain" else None
        self.stats_path = str(stats_path) if stats_path is not None else None
        self._lock: int | None = None
        self._forwarder: subprocess.Popen[bytes] | None = None
        self._children: list[subprocess.Popen[bytes]] = []

    @property
    def client(self) -> str:
        return self.clients[0]

    @property
    def namespaces(self) -> list[str]:
        return [*self.clients, *([self.middle] if self.middle else []), self.server]

    def _name(self, role: str) -> str:
        return f"{PREFIX}{self.instance}-{role}"

    def __enter__(self) -> Netem:
        check_can_run()
        clean_stale()
        LOCKS.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(LOCKS / f"{self.instance}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def _build(self) -> None:
        for name in self.namespaces:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", self.server, "addr", "add", f"{SERVER_ADDRESS}/32", "dev", "lo")
        by_topology: dict[Topology, list[tuple[str | None, str | None]]] = {
            "pair": [(self.client, self.server)],
            "chain": [(self.client, self.middle), (self.middle, self.server)],
            "star": [(client, self.server) for client in self.clients],
        }
        ends = by_topology[self.topology]
        fds: list[int] = []
        links = []
        try:
            for i, ((near, far), config) in enumerate(zip(ends, self.configs, strict=True)):
                assert near is not None and far is not None
                pair = []
                for side, namespace, here, there in (
                    ("a", near, f"10.77.{i}.1", f"10.77.{i}.2"),
                    ("b", far, f"10.77.{i}.2", f"10.77.{i}.1"),
                ):
                    device = f"qn{self.instance}{i}{side}"
                    fds.append(_open_tun(device))
                    pair.append(fds[-1])
                    _ip("link", "set", device, "netns", namespace)
                    _ip("-n", namespace, "addr", "add", here, "peer", there, "dev", device)
                    # A long device queue, so that a forwarder briefly starved of a core
                    # delays packets instead of dropping them: loss is the link model's alone.
                    _ip("-n", namespace, "link", "set", device, "up", "txqueuelen", "10000")
                    if namespace == self.server:
                        # Replies leave from the server's address: a server bound to 0.0.0.0
                        # answers UDP from the route's source, and a QUIC client takes a reply
                        # from any other address for a stranger's.
                        _ip("-n", namespace, "route", "replace", there, "dev", device,
                            "src", SERVER_ADDRESS)  # fmt: skip
                links.append(LinkFds(pair[0], pair[1], config))
                client_device = f"qn{self.instance}{i}a"
                _ip("-n", near, "route", "add", NETWORK, "dev", client_device)
            if self.topology == "chain":
                assert self.middle is not None
                _ip("-n", self.server, "route", "add", NETWORK, "dev", f"qn{self.instance}1b",
                    "src", SERVER_ADDRESS)  # fmt: skip
                _ip("-n", self.middle, "route", "del", NETWORK)
                _ip(
                    "-n",
                    self.middle,
                    "route",
                    "add",
                    f"{SERVER_ADDRESS}/32",
                    "dev",
                    f"qn{self.instance}1a",
                )
                subprocess.run(
                    ["ip", "netns", "exec", self.middle, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                    check=True,
                )
            spec = pickle.dumps(Spec(tuple(links), self.stats_path))
            self._forwarder = subprocess.Popen(
                [sys.executable, "-m", "netsim.forwarder"],
                stdin=subprocess.PIPE,
                pass_fds=fds,
                cwd=Path(__file__).resolve().parent.parent,
            )
            assert self._forwarder.stdin is not None
            self._forwarder.stdin.write(b"%d\n" % len(spec) + spec)
            self._forwarder.stdin.flush()
        finally:
            for fd in fds:  # the forwarder has its own copies now
                os.close(fd)

    def popen(
        self,
        namespace: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: Unpack[PopenOptions],
    ) -> subprocess.Popen[bytes]:
        """Start `argv` in one of the namespaces; it is killed at teardown if still running."""
        env = {**os.environ, "NETEM_SERVER": self.server_address, **(env or {})}
        process = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], env=env, **kwargs)
        self._children.append(process)
        return process

    def close(self) -> None:
        for child in self._children:
            if child.poll() is None:
                child.terminate()
        for child in self._children:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if self._forwarder is not None:
            assert self._forwarder.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                self._forwarder.stdin.close()  # its stop signal
            self._forwarder.wait()
            self._forwarder = None
        for name in self.namespaces:
            _remove_namespace(name)
        if self._lock is not None:
            (LOCKS / f"{self.instance}.lock").unlink(missing_ok=True)
            os.close(self._lock)
            self._lock = None


def link_from_arguments(args: argparse.Namespace) -> LinkConfig:
    """The link the shell's flags describe; NetemError (before anything is made) if they are bad."""
    trace = None
    if args.trace is not None:
        try:
            trace = DeliveryTrace.read(args.trace)
        except ValueError as error:
            raise NetemError(str(error)) from None
    try:
        bursts = None
        if args.ge_good_slots is not None:
            bursts = GilbertElliott(
                good_slots=args.ge_good_slots,
                bad_slots=args.ge_bad_slots,
                bad_loss=args.ge_bad_loss,
                good_loss=args.ge_good_loss,
                slot_s=args.ge_slot_ms / 1000,
            )
        up = LinkConfig(
            rate_bps=args.rate_mbps * 1e6,
            delay_s=args.delay_ms / 1000,
            loss=args.loss,
            bursts=bursts,
            trace=trace,
            queue_bytes=args.queue_kb * 1024,
            seed=args.seed,
        )
        down = None
        if args.down_rate_mbps is not None or args.down_delay_ms is not None:
            down = up.replace(
                rate_bps=(args.down_rate_mbps or args.rate_mbps) * 1e6,
                delay_s=(args.down_delay_ms if args.down_delay_ms is not None else args.delay_ms)
                / 1000,
            )
        return up.replace(downlink=down) if down is not None else up
    except ValueError as error:
        raise NetemError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m netsim.netem",
        description="Run CMD behind an emulated link (rate, delay, loss) to a server namespace.",
    )
    link = parser.add_argument_group("the link (each direction, unless --down-* says otherwise)")
    link.add_argument("--rate-mbps", type=float, default=5.0)
    link.add_argument("--delay-ms", type=float, default=25.0, help="one way")
    link.add_argument("--loss", type=float, default=0.0, help="i.i.d. loss rate, in [0, 1]")
    link.add_argument("--queue-kb", type=int, default=64, help="drop-tail buffer")
    link.add_argument("--trace", help="a Mahimahi delivery trace: deliver at its opportunities")
    link.add_argument("--down-rate-mbps", type=float, help="server to client, where it differs")
    link.add_argument("--down-delay-ms", type=float, help="server to client, where it differs")
    link.add_argument("--ge-good-slots", type=float, help="Gilbert-Elliott: mean good period")
    link.add_argument("--ge-bad-slots", type=float, default=2.0, help="mean bad period")
    link.add_argument("--ge-bad-loss", type=float, default=0.9)
    link.add_argument("--ge-good-loss", type=float, default=0.0)
    link.add_argument("--ge-slot-ms", type=float, default=100.0)
    link.add_argument("--seed", type=int, default=0)
    parser.add_argument("--topology", choices=TOPOLOGIES, default="pair")
    parser.add_argument("--clients", type=int, default=1, help="star: how many client namespaces")
    parser.add_argument("--server-cmd", help="a shell command to run on the server side")
    parser.add_argument("--middle-cmd", help="chain: a shell command to run in the middle")
    parser.add_argument("--stats", help="write the link's counters and timing here (JSON)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD...: run in each client")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        if not command:
            raise NetemError("give a command to run behind the link: ... -- CMD")
        if args.middle_cmd and args.topology != "chain":
            raise NetemError("--middle-cmd needs --topology chain")
        link = link_from_arguments(args)
        check_can_run()
        emulator = Netem(link, args.topology, args.clients, args.stats)
    except NetemError as error:
        print(f"netem: {error}", file=sys.stderr)
        return 2

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    with emulator as net:
        where = f"netem: server at {net.server_address} (namespace {net.server})"
        if net.middle_address:
            where += f", middle at {net.middle_address}"
        print(where, file=sys.stderr, flush=True)
        if args.server_cmd:
            net.popen(net.server, ["sh", "-c", args.server_cmd])
        if args.middle_cmd and net.middle:
            net.popen(net.middle, ["sh", "-c", args.middle_cmd])
        runs = [
            net.popen(client, command, env={"NETEM_CLIENT": str(i)})
            for i, client in enumerate(net.clients)
        ]
        codes = [run.wait() for run in runs]
    # As a shell reports it: a command killed by signal N exited with 128 + N.
    return max(128 - code if code < 0 else code for code in codes)


if __name__ == "__main__":
    sys.exit(main())
