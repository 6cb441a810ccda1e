"""A QUIC client and server connection in memory, sans IO, for tests that carry the
datagrams between them themselves."""

from __future__ import annotations

from aioquic.quic.configuration import QuicConfiguration

from transport.connection import ScheduledQuicConnection
from transport.http3 import Http3Settings
from transport.tls import ensure_certificate


def quic_pair(scheduler: str = "fcfs") -> tuple[ScheduledQuicConnection, ScheduledQuicConnection]:
    """A client (FCFS) and a server connection (sans IO, `scheduler`, the server's HTTP/3
    settings), for tests that carry their datagrams themselves."""
    config = QuicConfiguration(is_client=True, alpn_protocols=["h3"])
    config.verify_mode = 0
    client = ScheduledQuicConnection(configuration=config, scheduler="fcfs")
    cert, key = ensure_certificate()
    server = ScheduledQuicConnection(
        configuration=Http3Settings(str(cert), str(key)).quic_configuration(),
        original_destination_connection_id=client.original_destination_connection_id,
        scheduler=scheduler,
    )
    return client, server
