"""The serving system end to end in virtual time: the router's simulator behind real aioquic
connections over the simulated link (§5.3 of Chuppala (2024), `experiments.transport_macro`).

A request leaves the client at its arrival time and crosses the uplink in its stack's way: a
stream of the one QUIC connection, a TLS/TCP connection of its own, or the one TLS/TCP
connection that every request shares. It reaches the gateway when its last byte does, and is
routed there and then, as `router.env` routes it: admission control, the arrival-rate estimate
and the policy. The simulated engines make its tokens; each is written to the response the moment
its iteration ends, as the server writes an SSE event, and crosses the downlink behind whatever
the stack's scheduler sends first. The client times it: a request meets its SLO if its last
token arrived within 40 ms per token of its sending.

TLS/TCP is modelled with aioquic too. One stream is an ordered byte stream with loss recovery
and congestion control like TCP's (CUBIC, Linux's default), so a lost packet holds back every
byte behind it, as on TCP. TCP's own handshake, a round trip before TLS's, delays a new
connection's first flight by one RTT. Left out: TCP/TLS header and record overheads (a few
percent of the bytes), and HTTP/2's per-stream flow control windows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamDataReceived

from config import Deployment
from experiments.transport_micro import CONGESTION_CONTROL, QUIC_STACKS, STACKS
from netsim.link import LinkConfig
from netsim.simlink import SimulatedPath
from router.paths import END_BYTES, HEAD_BYTES, PROMPT_BYTES_PER_TOKEN, TOKEN_BYTES
from router.policies import Policy
from router.route import Router
from router.sim import DEADLINE, Finished, Job, Simulator
from transport.connection import ScheduledQuicConnection
from transport.http3 import Http3Settings
from transport.qos import StreamDeadline, stream_spec
from workloads import Request

ERROR_BYTES = 160
"""A whole error response (504 at the first-token deadline, 429 at admission)."""
H2_MAX_STREAMS = 100
"""Requests in flight at once on the HTTP/2 connection: hypercorn's SETTINGS_MAX_CONCURRENT_STREAMS
(`h2_max_concurrent_streams`), as HTTP/3's MAX_STREAMS (128) holds the QUIC client. Past it a
request waits at its client, as httpx makes it wait."""


@dataclass
class Delivery:
    """One request as its client saw it."""

    request: Request
    arrived: float | None = None
    """At the gateway."""
    model: str | None = None
    tokens: int = 0
    status: int | None = None
    """200, or the gateway's error (504: first-token deadline, 429: shed); None: not done."""
    first_token: float | None = None
    """At the client."""
    done: float | None = None
    """At the client: its last byte."""
    server_slo_met: bool = False
    """The SLO as the gateway counts it, from arrival at the gateway to the last token made."""

    @property
    def sent(self) -> float:
        """The request's arrival in the workload: when its client sent it, or began to wait for
        a stream to send it on."""
        return self.request.arrival


class _Pipe:
    """One direction of an ordered byte stream, with marks: what its reader learns when the
    bytes up to each mark have arrived."""

    def __init__(self) -> None:
        self.written = 0
        self.read = 0
        self._marks: deque[tuple[int, Callable[[float], None]]] = deque()

    def write(self, size: int, mark: Callable[[float], None] | None = None) -> None:
        self.written += size
        if mark is not None:
            self._marks.append((self.written, mark))

    def arrived(self, size: int, now: float) -> None:
        self.read += size
        while self._marks and self._marks[0][0] <= self.read:
            self._marks.popleft()[1](now)


@dataclass
class _Channel:
    """A bidirectional stream between a client and a server connection, as a pair of pipes."""

    client: QuicConnection
    server: QuicConnection
    stream_id: int
    up: _Pipe
    down: _Pipe
    shared: bool
    """Every request's bytes in one stream (HTTP/2 over TCP); else a stream per request."""


class VirtualGateway:
    """The gateway's routing in virtual time (`router.route.Router`) in front of the simulated
    engines, driven by arrivals at the server instead of a workload's own clock."""

    def __init__(self, deployment: Deployment, policy: Policy) -> None:
        self.sim = Simulator.from_deployment(deployment)
        self.router = Router(deployment, policy)

    def arrive(
        self, request: Request, now: float
    ) -> tuple[list[Finished], str | None, float | None]:
        """Route `request`, arrived now (with its client's path as the server measured it).
        Returns what ended on the way here, the model it went to (None: shed at the door), and
        when its last token must be written, where the router computed its budget."""
        ended = self.advance(now)
        replica = self.router(request, self.sim.view(), now)
        if replica is None:
            return ended, None, None
        self.sim.submit(request, replica)
        left = self.router.encoder.budget(request)
        due = None if left is None else now + left.answer_s
        return ended, self.sim.replicas[replica].model, due

    def advance(self, now: float) -> list[Finished]:
        """Run the engines to `now`; what ended, which the router hears."""
        ended = self.sim.advance(now)
        self.router.served(ended)
        return ended


class CoSimulation:
    """One run: a stack, a policy and a workload's requests, over one simulated link."""

    def __init__(
        self,
        stack: str,
        deployment: Deployment,
        policy: Policy,
        requests: Sequence[Request],
        link: LinkConfig,
        certificate: tuple[Path, Path],
    ) -> None:
        if stack not in STACKS:
            raise ValueError(f"unknown stack {stack!r}; choose from {', '.join(STACKS)}")
        self.stack, self.deployment, self.link = stack, deployment, link
        self.gateway = VirtualGateway(deployment, policy)
        self.gateway.sim.on_tokens = self._tokens
        self.certificate = certificate
        self.deliveries = {r.request_id: Delivery(r) for r in requests}
        self._open = len(self.deliveries)
        self._channels: dict[str, _Channel] = {}  # request id -> its response's channel
        self._by_stream: dict[tuple[int, int], _Channel] = {}  # (id(connection), stream id)
        self._waiting: deque[Request] = deque()  # for a stream of the HTTP/2 connection
        self._armed: set[float] = set()  # times of the calls pending for the engines
        client, server = self._pair()
        self.path = SimulatedPath(client, server, link, self._on_event)
        self.path.run(until=lambda: client._handshake_complete)  # the readiness check
        self._shared: _Channel | None = None
        if stack == "h2-tls":
            self._shared = self._channel(client, server, shared=True)
        elif stack == "h1-tls":  # its first connection was the readiness check's alone
            self.path.disconnect(client, server)
        for request in requests:
            self.path.call_at(max(request.arrival, self.path.now), self._send(request))

    def run(self, horizon: float) -> list[Delivery]:
        """Until every request has ended at its client, or `horizon` (virtual seconds), after
        which none could still meet its SLO: what is left is not done."""
        self.path.run(until=lambda: self._open == 0 or self.path.now >= horizon, timeout=1e9)
        return list(self.deliveries.values())

    # -- connections --------------------------------------------------------------------------

    def _pair(self) -> tuple[QuicConnection, QuicConnection]:
        scheduler = self.stack if self.stack in QUIC_STACKS else "fcfs"
        config = QuicConfiguration(
            is_client=True, alpn_protocols=["h3"], congestion_control_algorithm=CONGESTION_CONTROL
        )
        config.verify_mode = 0
        client = ScheduledQuicConnection(configuration=config, scheduler=scheduler)
        cert, key = self.certificate
        settings = Http3Settings(str(cert), str(key), congestion_control=CONGESTION_CONTROL)
        server = ScheduledQuicConnection(
            configuration=settings.quic_configuration(),
            original_destination_connection_id=client.original_destination_connection_id,
            scheduler=scheduler,
        )
        return client, server

    def _channel(self, client: QuicConnection, server: QuicConnection, shared: bool) -> _Channel:
        stream_id = client.get_next_available_stream_id()
        channel = _Channel(client, server, stream_id, _Pipe(), _Pipe(), shared)
        self._by_stream[id(client), stream_id] = channel
        self._by_stream[id(server), stream_id] = channel
        return channel

    # -- the client ---------------------------------------------------------------------------

    def _send(self, request: Request) -> Callable[[float], None]:
        def send(now: float) -> None:
            if self.stack == "h1-tls":  # a connection of its own, after TCP's handshake
                client, server = self._pair()
                rtt = 2 * self.link.delay_s
                self.path.call_at(
                    now + rtt, lambda at: self._connect_and_send(request, client, server)
                )
                return
            if self._shared is None:
                self._write_request(
                    request, self._channel(self.path.client, self.path.server, False), now
                )
            elif len(self._channels) < H2_MAX_STREAMS:
                self._write_request(request, self._shared, now)
            else:
                self._waiting.append(request)

        return send

    def _connect_and_send(
        self, request: Request, client: QuicConnection, server: QuicConnection
    ) -> None:
        self.path.connect(client, server)
        self._write_request(request, self._channel(client, server, False), self.path.now)

    def _write_request(self, request: Request, channel: _Channel, now: float) -> None:
        self._channels[request.request_id] = channel
        qos = self.deployment.qos_classes[request.qos_class]
        if isinstance(channel.client, ScheduledQuicConnection) and not channel.shared:
            channel.client.set_stream_spec(channel.stream_id, stream_spec(qos, now))
        prompt = request.prompt_tokens or 0
        size = HEAD_BYTES + round(prompt * PROMPT_BYTES_PER_TOKEN)
        channel.up.write(size, lambda at: self._arrive(request, channel, at))
        channel.client.send_stream_data(channel.stream_id, bytes(size), not channel.shared)
        self.path.touch(channel.client)

    def _on_event(self, connection: QuicConnection, event: QuicEvent, now: float) -> None:
        if isinstance(event, StreamDataReceived):
            channel = self._by_stream.get((id(connection), event.stream_id))
            if channel is not None:
                pipe = channel.up if connection is channel.server else channel.down
                pipe.arrived(len(event.data), now)
        elif isinstance(event, ConnectionTerminated):
            # No connection should die in these runs (no silence comes near the idle timeout):
            # one that does fails every request it carried, as its client would see.
            for rid, channel in list(self._channels.items()):
                if connection in (channel.client, channel.server):
                    self._finish(rid, now, status=0)

    # -- the server ---------------------------------------------------------------------------

    def _arrive(self, request: Request, channel: _Channel, now: float) -> None:
        delivery = self.deliveries[request.request_id]
        delivery.arrived = now
        server = channel.server
        scheduled = (
            server if isinstance(server, ScheduledQuicConnection) and not channel.shared else None
        )
        if scheduled is not None:
            spec = stream_spec(self.deployment.qos_classes[request.qos_class], now)
            scheduled.set_stream_spec(channel.stream_id, spec)
        path = server.path_estimate() if isinstance(server, ScheduledQuicConnection) else None
        ended, model, due = self.gateway.arrive(replace(request, path=path), now)
        if scheduled is not None and due is not None:  # one budget for both halves, as live
            StreamDeadline(spec, partial(scheduled.set_stream_spec, channel.stream_id))(due)
        self._ended(ended)
        if model is None:
            self._error(request.request_id, 429)
        delivery.model = model
        self._arm()

    def _tokens(self, jobs: list[Job]) -> None:
        for job in jobs:
            rid = job.request.request_id
            delivery = self.deliveries[rid]
            first, last = delivery.tokens == 0, job.remaining == 0
            delivery.tokens += 1
            size = TOKEN_BYTES + (HEAD_BYTES if first else 0) + (END_BYTES if last else 0)
            marks: list[Callable[[float], None]] = (
                [partial(setattr, delivery, "first_token")] if first else []
            )
            if last:
                marks.append(self._done(rid, 200))
            self._write(rid, size, last, *marks)

    def _ended(self, finished: list[Finished]) -> None:
        for f in finished:
            rid = f.request.request_id
            self.deliveries[rid].server_slo_met = f.slo_met
            if f.outcome == DEADLINE:
                self._error(rid, 504)

    def _error(self, rid: str, status: int) -> None:
        self._write(rid, ERROR_BYTES, True, self._done(rid, status))

    def _write(self, rid: str, size: int, last: bool, *marks: Callable[[float], None]) -> None:
        """Write `size` bytes of `rid`'s response; the client runs `marks` once they are in."""
        channel = self._channels[rid]

        def marked(at: float) -> None:
            for mark in marks:
                mark(at)

        channel.down.write(size, marked if marks else None)
        end = last and not channel.shared
        channel.server.send_stream_data(channel.stream_id, bytes(size), end)
        self.path.touch(channel.server)

    def _done(self, rid: str, status: int) -> Callable[[float], None]:
        return lambda now: self._finish(rid, now, status)

    def _finish(self, rid: str, now: float, status: int) -> None:
        delivery = self.deliveries[rid]
        if delivery.status is not None:
            return
        delivery.status, delivery.done = status, now
        self._open -= 1
        channel = self._channels.pop(rid, None)
        if channel is not None and not channel.shared:
            for connection in (channel.client, channel.server):
                self._by_stream.pop((id(connection), channel.stream_id), None)
            if self.stack == "h1-tls":
                self.path.disconnect(channel.client, channel.server)
        if self._waiting and self._shared is not None:
            self._write_request(self._waiting.popleft(), self._shared, now)

    # -- the engines' clock -------------------------------------------------------------------

    def _arm(self) -> None:
        """Keep a call pending at the simulator's next iteration end (one per time: a stale
        call would poll every connection for nothing)."""
        due = self.gateway.sim.next_event()
        if due is None or due in self._armed:
            return
        self._armed.add(due)
        self.path.call_at(due, lambda now: self._tick(due, now))

    def _tick(self, due: float, now: float) -> None:
        self._armed.discard(due)
        self._ended(self.gateway.advance(now))
        self._arm()
