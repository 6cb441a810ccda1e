"""What one token's packet and one ACK cost a server connection: ours against bare aioquic.

A client and a server connection (`tests.support.quic.quic_pair`'s settings), sans IO, in one
process, with a given number of open request streams. Per round the server writes one token
event (260 bytes) on the next stream in turn and builds its packets (`datagrams_to_send`, timed);
the client takes them, and every second round acknowledges them (the server's
`receive_datagram` of that ACK, timed). Nothing else runs between the calls, so the figures are
the floor of what the live server pays per packet and per ACK (which measured 2-3x these, with
the app between the calls: docs/results/http3-vs-http1.md).

    python -m benchmarks.quic_per_packet                  # 8 and 256 open streams
    python -m benchmarks.quic_per_packet --streams 8,256,1024 --rounds 20000
"""

from __future__ import annotations

import argparse
import time

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from transport.connection import ScheduledQuicConnection
from transport.http3 import Http3Settings
from transport.tls import ensure_certificate

CLIENT_ADDR = ("10.0.0.1", 40000)
SERVER_ADDR = ("10.0.0.2", 443)
EVENT = b"x" * 260
"""About one chat-completion chunk's server-sent event."""


def pair(ours: bool) -> tuple[QuicConnection, QuicConnection]:
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


def measure(ours: bool, streams: int, rounds: int) -> tuple[float, float]:
    """µs per server `datagrams_to_send` (one packet) and per ACK received."""
    client, server = pair(ours)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="8,256", help="open streams, comma-separated")
    p.add_argument("--rounds", type=int, default=20000, help="packets per measurement")
    args = p.parse_args(argv)
    print("| open streams | connection | µs per packet built | µs per ACK received |")
    print("|---|---|---|---|")
    for streams in (int(s) for s in args.streams.split(",")):
        for ours in (False, True):
            send, receive = measure(ours, streams, args.rounds)
            name = "ours (ScheduledQuicConnection)" if ours else "bare aioquic"
            print(f"| {streams} | {name} | {send:.1f} | {receive:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
