"""transport.udp on real loopback sockets: every datagram waiting is read on one wake-up, GSO runs
arrive as the datagrams they were made of, and a socket that refuses GSO or is full loses
nothing."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

import pytest

from transport.udp import MAX_SEGMENTS, BatchedDatagramTransport, gso_runs


class Recorder(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.errors: list[Exception] = []
        self.lost = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.received.append(data)

    def error_received(self, exc: Exception) -> None:
        self.errors.append(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)


class CountingSocket(socket.socket):
    """A UDP socket that counts its sends and can refuse them as a kernel would."""

    def __init__(self, refuse_gso: bool = False, full_for: int = 0) -> None:
        super().__init__(socket.AF_INET, socket.SOCK_DGRAM)
        self.bind(("127.0.0.1", 0))
        self.refuse_gso = refuse_gso
        self.full_for = full_for  # sends refused with EAGAIN before the buffer "drains"
        self.sendtos = 0
        self.sendmsgs = 0

    def _maybe_full(self) -> None:
        if self.full_for:
            self.full_for -= 1
            raise BlockingIOError(errno.EAGAIN, "full")

    def sendto(self, data: Any, addr: Any) -> int:  # type: ignore[override]
        self._maybe_full()
        self.sendtos += 1
        return super().sendto(data, addr)

    def sendmsg(self, buffers: Any, ancdata: Any = (), flags: int = 0, address: Any = None) -> int:
        self._maybe_full()
        if self.refuse_gso:
            raise OSError(errno.EIO, "no checksum offload")
        self.sendmsgs += 1
        return super().sendmsg(buffers, ancdata, flags, address)


async def receiver(max_batch: int = 256) -> tuple[BatchedDatagramTransport, Recorder]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    recorder = Recorder()
    transport = BatchedDatagramTransport(asyncio.get_running_loop(), sock, recorder)
    transport.max_batch = max_batch
    return transport, recorder


async def until(condition: Any) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def datagrams(sizes: list[int], addr: Any = ("127.0.0.1", 9)) -> list[tuple[bytes, Any]]:
    return [(bytes([i % 256]) * size, addr) for i, size in enumerate(sizes)]


def test_runs_are_equal_sized_datagrams_to_one_peer_ending_at_a_short_one() -> None:
    a, b = ("127.0.0.1", 1), ("127.0.0.1", 2)
    sizes = [1200, 1200, 900, 1200, 1200, 1200, 1300, 40]
    batch = datagrams(sizes, a) + datagrams([1200, 1200], b)
    runs = [([len(d) for d in run], addr) for run, addr in gso_runs(batch)]
    assert runs == [
        ([1200, 1200, 900], a),
        ([1200, 1200, 1200], a),
        ([1300, 40], a),
        ([1200, 1200], b),
    ]
    many = ((bytes(100), a) for _ in range(MAX_SEGMENTS + 1))
    assert [len(run) for run, _ in gso_runs(many)] == [MAX_SEGMENTS, 1]
    # and every datagram exactly once, in order
    assert [d for run, _ in gso_runs(batch) for d in run] == [d for d, _ in batch]


async def test_a_burst_larger_than_one_read_arrives_whole_and_in_order() -> None:
    transport, recorder = await receiver(max_batch=8)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    address = transport.get_extra_info("sockname")
    sent = [f"datagram {i}".encode() for i in range(50)]
    for data in sent:  # all queued in the kernel before the loop looks at the socket
        sender.sendto(data, address)
    await until(lambda: len(recorder.received) == len(sent))
    assert recorder.received == sent
    # more than one datagram per wake-up (asyncio's transport reads one), and no more than a batch
    assert transport.reads < len(sent) / 2
    assert transport.reads >= len(sent) / 8
    sender.close()
    transport.close()
    await recorder.lost


async def test_a_read_that_finds_nothing_returns_quietly() -> None:
    transport, recorder = await receiver()
    transport._read_ready()  # EAGAIN at once: nothing received, nothing raised
    assert recorder.received == [] and recorder.errors == []
    transport.close()
    await recorder.lost


async def test_gso_sends_a_run_in_one_syscall_and_the_peer_gets_each_datagram() -> None:
    destination, recorder = await receiver()
    address = destination.get_extra_info("sockname")
    sock = CountingSocket()
    transport = BatchedDatagramTransport(asyncio.get_running_loop(), sock, Recorder())
    if not transport.gso:
        pytest.skip("this kernel has no UDP_SEGMENT")
    batch = datagrams([1200, 1200, 1200, 1200, 300], address)
    transport.send_all(batch)
    await until(lambda: len(recorder.received) == len(batch))
    assert recorder.received == [d for d, _ in batch]
    assert (sock.sendmsgs, sock.sendtos) == (1, 0)
    transport.close()
    destination.close()


async def test_a_socket_that_refuses_gso_sends_one_by_one_from_then_on() -> None:
    destination, recorder = await receiver()
    address = destination.get_extra_info("sockname")
    sock = CountingSocket(refuse_gso=True)
    own = Recorder()
    transport = BatchedDatagramTransport(asyncio.get_running_loop(), sock, own)
    transport.gso = True  # as if the probe had said yes
    first, second = datagrams([1200] * 3, address), datagrams([1200, 1200, 500], address)
    transport.send_all(first)
    assert transport.gso is False
    transport.send_all(second)
    await until(lambda: len(recorder.received) == 6)
    assert recorder.received == [d for d, _ in first + second]
    assert (sock.sendmsgs, sock.sendtos) == (0, 6) and own.errors == []
    transport.close()
    destination.close()


async def test_a_full_socket_holds_sends_in_order_and_drops_only_past_its_bound() -> None:
    destination, recorder = await receiver()
    address = destination.get_extra_info("sockname")
    sock = CountingSocket(full_for=1)
    transport = BatchedDatagramTransport(asyncio.get_running_loop(), sock, Recorder())
    transport.gso = False
    transport.max_queued = 3
    batch = datagrams([10, 20, 30, 40], address)
    transport.send_all(batch)  # the first finds the socket full: three are held, one dropped
    assert transport.dropped == 1
    await until(lambda: len(recorder.received) == 3)
    assert recorder.received == [d for d, _ in batch[:3]]
    transport.close()
    destination.close()
