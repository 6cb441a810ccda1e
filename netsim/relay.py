"""A UDP relay on localhost that carries live QUIC traffic over a simulated link, in real time.

The development VM's kernel has no netem (`sch_netem`), so live lossy runs go through this
instead: the client talks to the relay's port, and the relay forwards each datagram to the
server (and each reply back) after the link's serialisation and propagation delay, or drops it,
with the same `netsim.link` model, rate, delay, uniform or Gilbert-Elliott loss, that the
virtual-time experiments use. One relay serves one client address.
"""

from __future__ import annotations

import asyncio
from typing import Any

from netsim.link import LinkConfig, LinkDirection


class _Side(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Any) -> None:
        self.on_datagram = on_datagram
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.on_datagram(data, addr)


class LossyRelay:
    """`port = await relay.start()`; point the client at 127.0.0.1:port; `relay.close()`."""

    def __init__(self, target: tuple[str, int], link: LinkConfig) -> None:
        self.target = target
        self.link = link
        self.up, self.down = link.directions()
        self._client_addr: Any = None
        self._front: _Side | None = None
        self._back: _Side | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        _, self._front = await loop.create_datagram_endpoint(
            lambda: _Side(self._from_client), local_addr=(host, port)
        )
        _, self._back = await loop.create_datagram_endpoint(
            lambda: _Side(self._from_server), remote_addr=self.target
        )
        assert self._front.transport is not None
        return int(self._front.transport.get_extra_info("sockname")[1])

    def close(self) -> None:
        for side in (self._front, self._back):
            if side is not None and side.transport is not None:
                side.transport.close()

    def _from_client(self, data: bytes, addr: Any) -> None:
        self._client_addr = addr
        self._carry(self.up, data, lambda: self._back, None)

    def _from_server(self, data: bytes, addr: Any) -> None:
        if self._client_addr is not None:
            self._carry(self.down, data, lambda: self._front, self._client_addr)

    def _carry(self, direction: LinkDirection, data: bytes, side: Any, addr: Any) -> None:
        loop = asyncio.get_running_loop()
        arrival = direction.admit(len(data), loop.time())
        if arrival is not None:
            loop.call_at(arrival, self._deliver, side, data, addr)

    @staticmethod
    def _deliver(side: Any, data: bytes, addr: Any) -> None:
        endpoint = side()
        # A datagram still on the link when the relay closes goes nowhere.
        transport = endpoint.transport if endpoint is not None else None
        if transport is not None and not transport.is_closing():
            transport.sendto(data, addr)
