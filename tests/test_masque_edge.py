"""The edge front-end as a MASQUE proxy (`python -m transport.frontend --masque PORT`), with the
keys, tiers and allowed targets of models.yaml: an inner HTTP/3 chat request to the real server
(vLLM CPU engines) through a CONNECT-UDP tunnel, and the tiers enforced.

The test config gives tier `tunnel` (TUNNEL_KEY) the targets `127.0.0.1:*` and `localhost:*`;
premium has no `tunnels:`, so its key may open none."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.servers import CERT, PREMIUM_KEY, TUNNEL_KEY, Server
from transport.client import Http3Client
from transport.masque.tunnel import MasqueClient, TunnelRefused

CHAT = {
    "model": "tiny-s",
    "messages": [{"role": "user", "content": "Hello through the tunnel"}],
    "max_tokens": 8,
    "temperature": 0.0,
    "ignore_eos": True,
}


def _masque(frontend: Server, key: str | None) -> MasqueClient:
    assert frontend.masque_port is not None
    return MasqueClient(
        "127.0.0.1", frontend.masque_port, key=key, verify=str(CERT), server_name="localhost"
    )


@pytest.mark.parametrize("mode", ["capsule", "datagram"])
async def test_an_http3_chat_request_runs_through_the_edges_masque_proxy(
    frontend: Server, server: Server, mode: str
) -> None:
    assert server.h3_port is not None

    async def run() -> None:
        # A larger outer packet leaves room for the inner connection's 1,200-byte packets as
        # HTTP/3 datagrams; with capsules it makes no difference.
        async with MasqueClient(
            "127.0.0.1", frontend.masque_port or 0, key=TUNNEL_KEY, verify=str(CERT),
            server_name="localhost", max_datagram_size=1452,
        ) as client:  # fmt: skip
            target = server.h3_port or 0
            tunnel = await client.open_tunnel("127.0.0.1", target, urgency=1, mode=mode)
            host, port = tunnel.local_address
            async with Http3Client(host, port, verify=str(CERT), server_name="localhost") as inner:
                response = await inner.request(
                    "POST", "/v1/chat/completions", {"content-type": "application/json"},
                    json.dumps(CHAT).encode(),
                )  # fmt: skip
                body = json.loads(await response.read())
            assert response.status == 200, body
            assert body["usage"]["completion_tokens"] == 8
            assert body["choices"][0]["message"]["content"]
            # The inner QUIC packets crossed the tunnel, in the mode asked for.
            if mode == "datagram":
                assert tunnel.sent_datagrams > 0 and tunnel.received_datagrams > 0
            else:
                assert tunnel.sent_capsules > 0 and tunnel.received_capsules > 0
                assert tunnel.sent_datagrams == 0
            line = server.logged(response.headers["x-request-id"])
            assert line["outcome"] == "ok"

    await asyncio.wait_for(run(), 60)


@pytest.mark.parametrize(
    ("key", "target", "status"),
    [
        (None, "h3", 401),
        ("not-a-key", "h3", 401),
        (PREMIUM_KEY, "h3", 403),  # a real key, but its tier has no `tunnels:`
        (TUNNEL_KEY, "elsewhere", 403),  # outside the tier's allowed targets
    ],
)
async def test_the_edge_proxy_enforces_the_tiers_of_models_yaml(
    frontend: Server, server: Server, key: str | None, target: str, status: int
) -> None:
    host = "127.0.0.1" if target == "h3" else "10.0.0.1"

    async def run() -> None:
        async with _masque(frontend, key) as client:
            with pytest.raises(TunnelRefused) as refused:
                await client.open_tunnel(host, server.h3_port or 0)
            assert refused.value.status == status

    await asyncio.wait_for(run(), 30)
