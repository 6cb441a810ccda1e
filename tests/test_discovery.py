"""Engine hosts found through DNS (`serving.discovery`): the slots a name's addresses fill and
free, a host that leaves while it serves, and a host gone silent. Here the answers come from a
list the test changes, and the hosts are link servers in this test's loop on loopback addresses
of their own; tests/test_multi_host.py asks a real DNS server, of processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from config import Deployment, load_deployment
from serving.discovery import Discovery
from serving.engine_host import link_server
from serving.engines import engine_link
from serving.engines.base import Sampling, TokenDelta, UpstreamLost
from serving.engines.engine_link import EngineLink, HostSlot, LinkedEngine, frame
from serving.launch import free_port
from serving.replicas import ReplicaSet
from tests.support.servers import write_test_config
from workloads import Message, Request

TOKEN = "the-fleets-link-token-0123456789"
NAME = "engines.fleet.test"
EXACT = Sampling(ignore_eos=True)


def request(request_id: str, max_tokens: int = 8) -> Request:
    return Request(request_id, 0.0, (Message("user", "Hello"),), max_tokens, "free-tier")


class Answers:
    """A DNS name's addresses, as the test sets them; None: the server does not answer."""

    def __init__(self, *addresses: str) -> None:
        self.addresses: list[str] | None = list(addresses)
        self.asked = 0

    async def __call__(self, name: str) -> list[str] | None:
        assert name == NAME
        self.asked += 1
        return None if self.addresses is None else sorted(self.addresses)


def discovery(answers: Answers, slots: int = 2, port: int = 7070) -> Discovery:
    return Discovery(f"{NAME}:{port}", [HostSlot() for _ in range(slots)], TOKEN, answers)


def held(found: Discovery) -> list[str | None]:
    return [None if s.link is None else s.link.path for s in found.slots]


def test_addresses_fill_free_slots_in_order_and_keep_theirs() -> None:
    found = discovery(Answers())
    found.update(["10.0.0.2", "10.0.0.1"])
    assert held(found) == ["10.0.0.1:7070", "10.0.0.2:7070"]
    found.update(["10.0.0.2", "10.0.0.3"])  # .1 left: .3 takes its slot, .2 keeps its own
    assert held(found) == ["10.0.0.3:7070", "10.0.0.2:7070"]
    assert found.draining == ["10.0.0.1:7070"]
    found.update(["fd00::5"])
    assert held(found) == ["[fd00::5]:7070", None]


def test_more_hosts_than_slots_leave_the_rest_unused_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    found = discovery(Answers(), slots=1)
    with caplog.at_level(logging.WARNING):
        found.update(["10.0.0.1", "10.0.0.2"])
    assert held(found) == ["10.0.0.1:7070"]
    assert "more engine hosts than its 1 slots" in caplog.text


async def test_a_failed_answer_changes_nothing_and_an_empty_one_frees_every_slot() -> None:
    answers = Answers("10.0.0.1")
    found = discovery(answers)
    found.update(["10.0.0.1"])
    answers.addresses = None
    await found.refresh()
    assert held(found) == ["10.0.0.1:7070", None]
    answers.addresses = []
    await found.refresh()
    assert held(found) == [None, None]
    assert found.draining == []  # nothing was in flight there: its link closed at once


@dataclass
class Fleet:
    deployment: Deployment
    hosts: dict[str, ReplicaSet]
    """Loopback address -> the engines it runs."""


def fleet_deployment(tmp_path: Path, port: int) -> Deployment:
    entry = {"model": "tiny-s", "device": "cpu", "engine_host": f"{NAME}:{port}", "hosts": 2}
    deployment = {"placement": "dns", "profile": "embedded-measured", "engine": "simulated",
                  "simulation": {"tokenizer": "tiny-s"}, "policy": {"name": "round-robin"},
                  "admission": {"rule": "none"},
                  "engine_args": {"max_model_len": 2048, "max_num_seqs": 64}}  # fmt: skip
    config = write_test_config(tmp_path, dns=([entry], deployment))
    return load_deployment(config, "dns").with_time_scale(0.1)


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path, *addresses: str) -> AsyncIterator[Fleet]:
    """An engine host on each loopback address, all on one port, as a headless Service's pods."""
    port = free_port()
    deployment = fleet_deployment(tmp_path, port)
    mine = deployment.run_by(f"{NAME}:{port}")
    async with contextlib.AsyncExitStack() as stack:
        hosts = {}
        for address in addresses:
            replicas = ReplicaSet.from_deployment(mine)
            await replicas.start()
            stack.push_async_callback(replicas.close)
            await stack.enter_async_context(link_server(replicas, f"{address}:{port}", TOKEN))
            hosts[address] = replicas
        yield Fleet(deployment, hosts)


async def collect(engine: LinkedEngine, req: Request) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(req, EXACT)]


async def test_a_front_end_routes_to_a_host_that_joins_and_lets_one_that_leaves_finish(
    tmp_path: Path,
) -> None:
    async with fleet(tmp_path, "127.0.0.2", "127.0.0.3") as hosts:
        answers = Answers("127.0.0.2")
        front = ReplicaSet.from_deployment(hosts.deployment, link_token=TOKEN, resolve=answers)
        assert [r.name for r in front] == [
            f"{NAME}:{port}#{slot}/cpu/tiny-s"
            for port in [front.discoveries[0].port]
            for slot in (0, 1)
        ]
        await front.start()
        try:
            found = front.discoveries[0]
            first, second = (r.engine for r in front)
            assert isinstance(first, LinkedEngine) and isinstance(second, LinkedEngine)
            assert first.healthy() and not second.healthy()

            answers.addresses = ["127.0.0.2", "127.0.0.3"]
            await found.refresh()
            assert second.healthy()
            assert len(await collect(second, request("on-the-newcomer"))) == 8
            newcomer = hosts.hosts["127.0.0.3"][0].engine
            assert newcomer.unfinished() == 0  # it ran there, and ended

            # A long stream on the first host; the host leaves DNS while it runs.
            streaming = asyncio.create_task(collect(first, request("long", 300)))
            async with asyncio.timeout(10):
                while not hosts.hosts["127.0.0.2"][0].engine.unfinished():
                    await asyncio.sleep(0.01)
            answers.addresses = ["127.0.0.3"]
            await found.refresh()
            assert first.healthy()  # one answer without a host whose link answers: kept...
            await found.refresh()
            assert not first.healthy()  # ...two: let go. No new request goes there...
            assert found.draining == [f"127.0.0.2:{found.port}"]
            deltas = await streaming  # ...and the one in flight finishes
            assert sum(d.tokens for d in deltas) == 300
            assert deltas[-1].finish_reason == "length"
            await found.refresh()
            assert found.draining == []  # then its link closes
        finally:
            await front.close()


async def test_a_host_gone_silent_is_taken_for_lost(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A crashed node sends no FIN: a host that says nothing past SILENT_S counts as lost, and
    what was in flight there fails."""
    monkeypatch.setattr(engine_link, "SILENT_S", 0.3)
    port = free_port()
    deployment = fleet_deployment(tmp_path, port)
    config = deployment.replicas[0]

    async def mute_host(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(["load", {config.host_name: [0, 0, 0, True]}]))
        await reader.read()  # and then nothing, as a host whose node is gone

    server = await asyncio.start_server(mute_host, "127.0.0.2", port)
    async with server:
        engine = LinkedEngine(config, HostSlot(EngineLink(f"127.0.0.2:{port}", TOKEN)))
        await engine.start()
        assert engine.healthy()
        stream = asyncio.create_task(collect(engine, request("stranded")))
        await asyncio.sleep(0.5)
        assert not engine.healthy()
        with pytest.raises(UpstreamLost):
            await asyncio.wait_for(stream, 5)
