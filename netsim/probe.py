"""Measure a network path, as ping and iperf would: round-trip time, TCP goodput, UDP loss.

Tools for checking an emulated link (`netsim.netem`), from either end of it:

    python -m netsim.probe serve                      # on the server side: answers all three
    python -m netsim.probe rtt --to 10.77.255.1       # UDP echo, median of --count
    python -m netsim.probe goodput --to ... --bytes 2000000
    python -m netsim.probe loss --to ... --count 20000 --rate 5000   # datagrams a second

Each client command prints one JSON object. Loss is counted by the receiver: the client sends
numbered datagrams, paced, then asks the server over TCP how many of them it saw.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Sequence

PORT = 9400
"""UDP: echo (datagrams starting with b'E') and loss counting (b'L'); TCP: goodput and counts."""
_SO_RCVBUFFORCE = 33  # Linux's value; Python's socket module does not export it


def serve(port: int = PORT) -> None:
    """Answer probes until killed."""
    seen: dict[int, set[int]] = {}  # loss run id -> sequence numbers received
    lock = threading.Lock()

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # FORCE, as root may: SO_RCVBUF is capped at net.core.rmem_max (208 KiB on many hosts),
    # which holds only ~20 ms of a loss run, and a busy machine that starves the reading thread
    # that long would count the socket's drops as the link's.
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 8 << 20)
    except PermissionError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("0.0.0.0", port))

    def read_up(limit_s: float = 5.0) -> None:
        """Wait until the UDP socket holds nothing unread (three looks 10 ms apart): a
        datagram still in its buffer when the count is asked arrived in time, and only the
        reading thread, starved of the CPU or the GIL on a busy machine, was late to it. Such
        datagrams were counted as lost: 0.7 and 3.8 points on a 2% link, in a suite's runs."""
        quiet, give_up = 0, time.monotonic() + limit_s
        while quiet < 3 and time.monotonic() < give_up:
            try:
                sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                quiet = 0
            except BlockingIOError:
                quiet += 1
            time.sleep(0.01)

    def udp() -> None:
        while True:
            data, address = sock.recvfrom(65535)
            if data[:1] == b"E":
                sock.sendto(data, address)
            elif data[:1] == b"L" and len(data) >= 9:
                run, number = struct.unpack_from("!II", data, 1)
                with lock:
                    seen.setdefault(run, set()).add(number)

    def tcp_client(connection: socket.socket) -> None:
        with connection:
            kind = connection.recv(1)
            if kind == b"G":  # goodput: count bytes to EOF, answer the count
                total = 0
                while data := connection.recv(1 << 16):
                    total += len(data)
                connection.sendall(str(total).encode())
            elif kind == b"C":  # how many datagrams of a loss run arrived
                run = struct.unpack("!I", connection.recv(4))[0]
                read_up()
                with lock:
                    count = len(seen.pop(run, set()))
                connection.sendall(str(count).encode())

    threading.Thread(target=udp, daemon=True).start()
    listener = socket.create_server(("0.0.0.0", port), reuse_port=True)
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=tcp_client, args=(connection,), daemon=True).start()


def rtt(host: str, count: int = 20, size: int = 100, port: int = PORT) -> dict[str, float]:
    """Round-trip times of UDP echoes, one at a time, in milliseconds; an echo not back within
    a second counts as lost."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    # Connected, as QUIC and most UDP clients are: an echo from any other address is not seen.
    sock.connect((host, port))
    times = []
    for i in range(count):
        payload = b"E" + struct.pack("!I", i) + bytes(size)
        start = time.monotonic()
        sock.send(payload)
        # A connected socket hears the ICMP refusal of a server not up yet: a lost echo too.
        with contextlib.suppress(TimeoutError, ConnectionRefusedError):
            while (left := start + 1.0 - time.monotonic()) > 0:
                sock.settimeout(left)
                if sock.recv(65535) == payload:
                    times.append((time.monotonic() - start) * 1000)
                    break
        if not times and i + 1 >= min(count, 3):
            raise TimeoutError(f"no echo came back from {host}:{port}")
        time.sleep(0.005)
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "lost": count - len(times),
    }


def goodput(host: str, size: int, port: int = PORT) -> dict[str, float]:
    """Send `size` bytes over one TCP connection; Mbit/s from connect to the server's count."""
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=60) as connection:
        connection.sendall(b"G" + bytes(size))
        connection.shutdown(socket.SHUT_WR)
        received = int(connection.recv(64))
    seconds = time.monotonic() - start
    return {"bytes": received, "seconds": seconds, "mbps": received * 8 / seconds / 1e6}


def loss(
    host: str, count: int, size: int = 200, burst: int = 20, gap_s: float = 0.001, port: int = PORT
) -> dict[str, float]:
    """Send `count` numbered datagrams, `burst` at a time every `gap_s` (so that neither the
    sender's socket nor the TUN device's queue drops them), and ask how many arrived."""
    run = int(time.time_ns() & 0xFFFFFFFF)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    next_burst = time.monotonic()
    for i in range(count):
        sock.sendto(b"L" + struct.pack("!II", run, i) + bytes(size), (host, port))
        if (i + 1) % burst == 0:
            next_burst += gap_s
            time.sleep(max(0.0, next_burst - time.monotonic()))
    time.sleep(1.0)  # what is still crossing the link
    with socket.create_connection((host, port), timeout=30) as connection:
        connection.sendall(b"C" + struct.pack("!I", run))
        arrived = int(connection.recv(64))
    return {"sent": count, "arrived": arrived, "loss": 1 - arrived / count}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m netsim.probe", description=__doc__)
    parser.add_argument("what", choices=["serve", "rtt", "goodput", "loss"])
    parser.add_argument("--to", help="the server's address")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--count", type=int, default=20, help="rtt: echoes; loss: datagrams")
    parser.add_argument("--bytes", type=int, default=2_000_000, help="goodput: bytes to send")
    parser.add_argument(
        "--rate", type=float, default=20_000, help="loss: datagrams a second (in bursts of 20)"
    )
    args = parser.parse_args(argv)
    if args.what == "serve":
        serve(args.port)
        return
    if args.to is None:
        parser.error(f"{args.what} needs --to")
    if not 0 < args.rate < float("inf"):
        parser.error("--rate must be a number above 0")
    if args.what == "rtt":
        result = rtt(args.to, args.count, port=args.port)
    elif args.what == "goodput":
        result = goodput(args.to, args.bytes, port=args.port)
    else:
        result = loss(args.to, args.count, gap_s=20 / args.rate, port=args.port)
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
