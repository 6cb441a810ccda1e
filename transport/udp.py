"""UDP socket I/O for the QUIC endpoints: every datagram waiting is read on each wake-up, and a
run of packets to one peer leaves in one `sendmsg` with UDP GSO where the kernel has it.

asyncio's own datagram transport reads one datagram per wake-up of the event loop and sends one
per `sendto`. At a few thousand token events a second the server's socket holds several ACKs at
each wake-up; reading them one pass at a time costs a loop iteration each, and with it a
transmit of the connection each, where one pass can take them all and transmit once. The stdlib
has no `recvmmsg`, and neither asyncio nor uvloop reads more than one datagram per callback, so
this module is the small transport that does (quic-go and quiche do the same in their own I/O
loops)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import struct
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
"""linux/udp.h; Python 3.11's socket module does not name it."""
MAX_SEGMENTS = 64
"""UDP_MAX_SEGMENTS in linux/udp.h: the kernel refuses a larger run."""
MAX_RUN_BYTES = 65000
"""A run is one UDP datagram to the kernel, so it must fit in one IP packet (65,535 bytes less
the headers)."""
MAX_DATAGRAM = 65536
UDP_RECEIVE_BUFFER = 4 * 2**20
"""Bytes. Linux's default (208 KiB) overflows in bursts at a few hundred packets in flight:
every datagram dropped there is a QUIC loss, recovered only after a probe timeout. QUIC stacks
ask for more (quic-go: 7 MiB); the kernel caps the request at net.core.rmem_max."""

_GSO_REFUSED = {errno.EIO, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOPROTOOPT}
"""What a socket says when it cannot segment: EIO from a device without checksum offload (as
quic-go found), EINVAL or EOPNOTSUPP from a kernel or socket type without UDP_SEGMENT."""

Address = Any
Datagram = tuple[bytes, Address]


def widen_receive_buffer(sock: socket.socket | None) -> None:
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UDP_RECEIVE_BUFFER)


def gso_supported(sock: socket.socket) -> bool:
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    try:
        sock.getsockopt(socket.SOL_UDP, UDP_SEGMENT)
    except OSError:
        return False
    return True


def gso_runs(datagrams: Iterable[Datagram]) -> Iterator[tuple[list[bytes], Address]]:
    """Consecutive datagrams to one address that the kernel can segment as one send: all of a
    run's datagrams are as long as its first, except the last, which may be shorter."""
    run: list[bytes] = []
    run_addr: Address = None
    size = total = 0
    for data, addr in datagrams:
        if run and (
            addr != run_addr
            or len(data) > size
            or len(run[-1]) < size  # a short datagram ends its run
            or len(run) == MAX_SEGMENTS
            or total + len(data) > MAX_RUN_BYTES
        ):
            yield run, run_addr
            run = []
        if not run:
            run_addr, size, total = addr, len(data), 0
        run.append(data)
        total += len(data)
    if run:
        yield run, run_addr


class BatchedDatagramTransport(asyncio.DatagramTransport):
    """An asyncio datagram transport over a bound, non-blocking UDP socket.

    `sendto` sends one datagram, as asyncio's does; `send_all` sends a transmit's worth, in GSO
    runs when the socket takes them and one `sendto` each when it does not (probed at start, and
    turned off for good the first time a send with a segment size is refused)."""

    max_batch = 256
    """Datagrams read per wake-up: bounds how long one busy socket holds the loop."""
    max_queued = 4096
    """Sends held while the socket's buffer is full. Past it a send is dropped and counted: to
    QUIC that is a loss like a full router queue, recovered by its own retransmission, where
    asyncio's transport would buffer without bound."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol: asyncio.DatagramProtocol,
    ) -> None:
        extra = {"socket": sock, "sockname": sock.getsockname()}
        with contextlib.suppress(OSError):  # not connected
            extra["peername"] = sock.getpeername()
        super().__init__(extra=extra)
        sock.setblocking(False)
        self._loop = loop
        self._sock = sock
        self._protocol = protocol
        self._queued: deque[tuple[list[bytes], Address]] = deque()
        self._closing = False
        self.gso = gso_supported(sock)
        self.dropped = 0
        """Sends dropped because `max_queued` were already waiting for the socket."""
        self.reads = 0
        """Wake-ups that found the socket readable."""
        self.received = 0
        protocol.connection_made(self)
        loop.add_reader(sock.fileno(), self._read_ready)

    # reading

    def _read_ready(self) -> None:
        self.reads += 1
        receive = self._protocol.datagram_received
        for _ in range(self.max_batch):
            try:
                data, addr = self._sock.recvfrom(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # an ICMP error queued on the socket; the next read goes on
                self._protocol.error_received(exc)
                return
            self.received += 1
            receive(data, addr)

    # sending

    def sendto(self, data: bytes | bytearray | memoryview, addr: Address = None) -> None:
        self._send([bytes(data)], addr)

    def send_all(self, datagrams: list[Datagram]) -> None:
        if not self.gso or len(datagrams) == 1:
            for data, addr in datagrams:
                self._send([data], addr)
        else:
            for run, addr in gso_runs(datagrams):
                self._send(run, addr)

    def _send(self, run: list[bytes], addr: Address) -> None:
        if self._sock.fileno() < 0:  # closed: what a closing connection still says is moot
            return
        if self._queued:  # behind what already waits, to keep the order
            self._hold(run, addr)
            return
        try:
            self._write(run, addr)
        except (BlockingIOError, InterruptedError):
            self._hold(run, addr)
            self._loop.add_writer(self._sock.fileno(), self._write_ready)
        except OSError as exc:
            self._refused(run, addr, exc)

    def _write(self, run: list[bytes], addr: Address) -> None:
        to = () if addr is None else (addr,)  # None: the connected socket's peer
        if len(run) > 1:
            segment = struct.pack("=H", len(run[0]))
            self._sock.sendmsg(run, [(socket.SOL_UDP, UDP_SEGMENT, segment)], 0, *to)
        elif to:
            self._sock.sendto(run[0], addr)
        else:
            self._sock.send(run[0])

    def _refused(self, run: list[bytes], addr: Address, exc: OSError) -> None:
        if len(run) > 1 and exc.errno in _GSO_REFUSED:
            self.gso = False
            for data in run:
                self._send([data], addr)
        else:
            self._protocol.error_received(exc)

    def _hold(self, run: list[bytes], addr: Address) -> None:
        if len(self._queued) >= self.max_queued:
            self.dropped += len(run)
        else:
            self._queued.append((run, addr))

    def _write_ready(self) -> None:
        while self._queued:
            run, addr = self._queued[0]
            try:
                self._write(run, addr)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._queued.popleft()
                self._refused(run, addr, exc)
                continue
            self._queued.popleft()
        self._loop.remove_writer(self._sock.fileno())
        if self._closing:
            self._loop.call_soon(self._finish)

    # closing

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._sock.fileno())
        if not self._queued:
            self._loop.call_soon(self._finish)

    def abort(self) -> None:
        self._queued.clear()
        if self._sock.fileno() >= 0:
            self._loop.remove_writer(self._sock.fileno())
        self.close()
        self._loop.call_soon(self._finish)

    def _finish(self) -> None:
        if self._sock.fileno() < 0:
            return
        self._sock.close()
        self._protocol.connection_lost(None)


def send_all(transport: asyncio.DatagramTransport, datagrams: list[Datagram]) -> None:
    """Send a transmit's datagrams: batched where the transport is ours, else one by one."""
    if isinstance(transport, BatchedDatagramTransport):
        transport.send_all(datagrams)
    else:
        for data, addr in datagrams:
            transport.sendto(data, addr)


async def open_udp(
    protocol: asyncio.DatagramProtocol, host: str | None, port: int, *, connect: bool = False
) -> BatchedDatagramTransport:
    """Bind a UDP socket to `host:port`, or with `connect` connect one to it, at the first
    address of `host` that takes it (as asyncio's `create_datagram_endpoint` does with
    `local_addr` or `remote_addr`), and run `protocol` on it."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.connect(address) if connect else sock.bind(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        widen_receive_buffer(sock)
        return BatchedDatagramTransport(loop, sock, protocol)
    raise error if error is not None else OSError(f"no address to bind for {host}:{port}")
