"""The schedulers' behaviours over real aioquic connections, in virtual time, through a simulated
link with delay, loss and rate (netsim.simlink). Deterministic under a seed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent, StreamDataReceived, StreamReset

from netsim.link import LinkConfig
from netsim.simlink import SimulatedPath
from transport.connection import EXPIRED_ERROR, ScheduledQuicConnection, StreamExpired
from transport.schedulers import DEFAULT_SPEC, StreamSpec
from transport.tls import ensure_certificate

LONG = 100_000
SHORT = 8_000


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return ensure_certificate(tmp_path_factory.mktemp("certs"), deterministic=True)


@dataclass
class Transfer:
    """A request stream: the client asks for `size` bytes, the server sends them tagged `spec`."""

    size: int
    spec: StreamSpec = DEFAULT_SPEC
    opened_at: float = 0.0
    done_at: float | None = None
    reset_code: int | None = None
    received: int = 0


@dataclass
class Bench:
    """A client and a server, each a ScheduledQuicConnection, over a SimulatedPath."""

    scheduler: str
    certificate: tuple[Path, Path]
    link: LinkConfig = LinkConfig(rate_bps=5e6, delay_s=0.025)
    transfers: dict[int, Transfer] = field(default_factory=dict)
    expired_at_server: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        client_config = QuicConfiguration(is_client=True, alpn_protocols=["test"])
        client_config.verify_mode = 0
        self.client = ScheduledQuicConnection(configuration=client_config, scheduler="fcfs")
        server_config = QuicConfiguration(
            is_client=False, alpn_protocols=["test"], max_data=2**24, max_stream_data=2**22
        )
        server_config.load_cert_chain(*map(str, self.certificate))
        self.server = ScheduledQuicConnection(
            configuration=server_config,
            original_destination_connection_id=self.client.original_destination_connection_id,
            scheduler=self.scheduler,
        )
        self.path = SimulatedPath(self.client, self.server, self.link, self._on_event)
        self.path.run(until=lambda: self.client._handshake_complete)

    def open(self, size: int, spec: StreamSpec = DEFAULT_SPEC) -> int:
        stream_id = self.client.get_next_available_stream_id()
        self.transfers[stream_id] = Transfer(size, spec, opened_at=self.path.now)
        self.client.send_stream_data(stream_id, size.to_bytes(8, "big"), end_stream=True)
        return stream_id

    def run(self, timeout: float = 120.0) -> None:
        self.path.run(
            until=lambda: all(
                t.done_at is not None or t.reset_code is not None for t in self.transfers.values()
            ),
            timeout=timeout,
        )

    def _on_event(self, connection: QuicConnection, event: QuicEvent, now: float) -> None:
        if connection is self.server:
            if isinstance(event, StreamDataReceived) and event.end_stream:
                transfer = self.transfers[event.stream_id]
                spec = transfer.spec
                if spec.deadline is not None:  # deadlines are relative to the request's arrival
                    spec = StreamSpec(spec.priority, now + spec.deadline, spec.high, spec.soft)
                self.server.set_stream_spec(event.stream_id, spec)
                self.server.send_stream_data(event.stream_id, b"x" * transfer.size, True)
            elif isinstance(event, StreamExpired):
                self.expired_at_server.append(event.stream_id)
        elif isinstance(event, StreamDataReceived):
            transfer = self.transfers[event.stream_id]
            transfer.received += len(event.data)
            if event.end_stream:
                transfer.done_at = now
        elif isinstance(event, StreamReset):
            self.transfers[event.stream_id].reset_code = event.error_code

    def finish_order(self) -> list[int]:
        done = [(t.done_at, sid) for sid, t in self.transfers.items() if t.done_at is not None]
        return [sid for _, sid in sorted(done)]


@pytest.mark.parametrize("scheduler", ["abs", "pifo"])
def test_a_late_high_priority_stream_overtakes_twenty_long_ones(scheduler, certificate):
    bench = Bench(scheduler, certificate)
    for _ in range(20):
        bench.open(LONG, StreamSpec(priority=1))
    bench.path.run(until=lambda: bench.path.now >= 0.3)
    in_flight = [sid for sid, t in bench.transfers.items() if t.done_at is None]
    urgent = bench.open(SHORT, StreamSpec(priority=10))
    bench.run()
    assert len(in_flight) >= 18
    # Only bytes already on the wire (the stream being served, a link queue of 64 KB, 105 ms at
    # 5 Mbit/s) can beat it: it finishes in about one RTT plus that queue, not behind 1.9 MB.
    urgent_done = bench.transfers[urgent].done_at
    beaten_by = [sid for sid in in_flight if bench.transfers[sid].done_at < urgent_done]
    assert len(beaten_by) <= 1
    assert urgent_done - bench.transfers[urgent].opened_at < 0.25
    assert all(t.received == t.size for t in bench.transfers.values())


@pytest.mark.parametrize("scheduler", ["fcfs", "rr", "edf", "abs", "pifo", "ml"])
def test_a_stream_that_sent_all_it_had_does_not_hold_up_the_next(scheduler, certificate):
    # Three streams' bytes go out together; aioquic learns that they have nothing more only when
    # it next asks each for a frame. B's write must leave in the next transmit all the same.
    bench = Bench(scheduler, certificate)
    opened = []
    for _ in range(4):  # an id is taken once the stream has data
        opened.append(bench.client.get_next_available_stream_id())
        bench.client.send_stream_data(opened[-1], b"q")
    bench.path.run(until=lambda: all(s in bench.server._streams for s in opened))
    *first, b = opened
    now = bench.path.now + 1.0  # every ACK exchanged: nothing else left to send
    for stream_id in first:
        bench.server.send_stream_data(stream_id, b"x" * 10)
    assert bench.server.datagrams_to_send(now)
    bench.server.send_stream_data(b, b"y" * 10)
    assert bench.server.datagrams_to_send(now + 0.001)
    assert bench.server._streams[b].sender.highest_offset == 10


def test_fcfs_serves_in_arrival_order(certificate):
    bench = Bench("fcfs", certificate)
    ids = [bench.open(SHORT * 4) for _ in range(5)]
    bench.run()
    assert bench.finish_order() == ids


def test_rr_shares_the_link_and_is_deterministic(certificate):
    def run_once() -> list[float]:
        bench = Bench("rr", certificate, link=LinkConfig(loss=0.01, seed=7))
        for _ in range(6):
            bench.open(LONG)
        bench.run()
        return [t.done_at for t in bench.transfers.values()]

    first = run_once()
    assert run_once() == first
    # Round-robin: equal transfers finish together, not one after another as under FCFS,
    # where the last would take about six times as long as the first.
    assert max(first) / min(first) < 1.5


def test_edf_resets_an_expired_stream_and_the_others_finish(certificate):
    bench = Bench("edf", certificate)
    for _ in range(4):
        bench.open(LONG, StreamSpec(deadline=10.0))
    # Served first (earliest deadline), it still cannot send 100 KB at 5 Mbit/s in 0.1 s.
    doomed = bench.open(LONG, StreamSpec(deadline=0.1))
    bench.run()
    assert bench.expired_at_server == [doomed]
    assert bench.transfers[doomed].reset_code == EXPIRED_ERROR
    assert bench.transfers[doomed].received < LONG
    others = [t for sid, t in bench.transfers.items() if sid != doomed]
    assert all(t.done_at is not None and t.received == LONG for t in others)


def test_edf_soft_deadline_demotes_instead_of_dropping(certificate):
    bench = Bench("edf", certificate)
    for _ in range(3):
        bench.open(LONG, StreamSpec(deadline=10.0, soft=True))
    late = bench.open(LONG, StreamSpec(deadline=0.05, soft=True))
    bench.run()
    assert bench.expired_at_server == []
    assert bench.transfers[late].received == LONG
    assert bench.finish_order()[-1] == late  # past its deadline, it went behind the others


def test_ml_high_class_first_and_low_class_fair(certificate):
    bench = Bench("ml", certificate)
    low = [bench.open(LONG, StreamSpec(high=False)) for _ in range(4)]
    high = bench.open(SHORT, StreamSpec(high=True, deadline=5.0))
    bench.run()
    assert bench.finish_order()[0] == high
    low_done = [bench.transfers[sid].done_at for sid in low]
    assert max(low_done) / min(low_done) < 1.3


def test_same_seed_same_run_under_loss(certificate):
    def run_once(seed: int) -> tuple[list[float | None], tuple[int, int]]:
        bench = Bench("ml", certificate, link=LinkConfig(loss=0.02, seed=seed))
        for i in range(8):
            bench.open(SHORT * 3, StreamSpec(high=i % 2 == 0, deadline=3.0))
        bench.run()
        return [t.done_at for t in bench.transfers.values()], bench.path.losses

    assert run_once(3) == run_once(3)
    assert run_once(3) != run_once(4)


def test_a_write_to_an_idle_connection_goes_out_at_the_next_run(certificate):
    # Right after the handshake nothing is in flight to mark the client busy: the run itself
    # must poll it, or the request waits for an unrelated timer.
    bench = Bench("fcfs", certificate, link=LinkConfig(rate_bps=1e9, delay_s=0.025))
    stream_id = bench.open(8)
    bench.run()
    transfer = bench.transfers[stream_id]
    # One way up, one way down: a round trip of 50 ms, and a little.
    assert transfer.done_at - transfer.opened_at < 0.051
