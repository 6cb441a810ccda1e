"""`python -m serving --loop uvloop`: the twin served over both protocols on uvloop's event loop,
which the server's own UDP transport (`transport/udp.py`) and its timers must work on too, with
the engines in the worker and in an engine host of their own (the engine link's Unix socket)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving.launch import free_port
from tests.support.servers import CERT, Server, launch, serving_command, write_test_config
from tests.support.tiers import starts
from transport.client import Http3Client
from transport.process_tree import tree
from workloads.chat import chat_body, chat_h3

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["in-worker", "separate-engines"])
@starts("twin")
def on_uvloop(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    folder: Path = tmp_path_factory.mktemp("uvloop")
    port, h3_port = free_port(), free_port(socket.SOCK_DGRAM)
    command = serving_command(write_test_config(folder), "embedded-sim", port,
                              "--h3-port", str(h3_port), "--loop", "uvloop")  # fmt: skip
    if request.param == "separate-engines":
        command.append("--separate-engines")
    server = launch("uvloop", command, port, "/readyz", folder, h3_port=h3_port)
    yield server.wait_ready()
    server.stop()


def test_the_server_runs_on_uvloop_over_both_protocols(on_uvloop: Server) -> None:
    # With separate engines the process started is a supervisor; its worker runs the loop.
    maps = [Path(f"/proc/{pid}/maps").read_text() for pid in tree(on_uvloop.process.pid)]
    assert any("uvloop" in text for text in maps)
    body = {"model": "tiny-s", "messages": HI, "max_tokens": 8, "ignore_eos": True}
    answer = httpx.post(on_uvloop.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 8

    async def over_h3() -> None:
        assert on_uvloop.h3_port is not None
        async with Http3Client("localhost", on_uvloop.h3_port, verify=str(CERT)) as client:
            for _ in range(3):  # one connection, several streams: the timers and ACKs run
                result = await chat_h3(client, chat_body(HI, "tiny-s", 16, ignore_eos=True))
                assert result.status == 200 and result.error is None, result.error
                assert result.usage is not None and result.usage["completion_tokens"] == 16

    asyncio.run(over_h3())
