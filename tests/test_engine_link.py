"""The engine link: the embedded twin's engines served by `serving.engine_host`'s link server in
this test's loop, reached by `LinkedEngine`s as a front-end worker reaches them. Streams arrive
as the engine made them, aborts and failures cross both ways, and each link sees the load the
others put on a replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from config import load_deployment
from serving.engine_host import EngineHost, link_server
from serving.engines.base import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
)
from serving.engines.engine_link import (
    EngineLink,
    HostSlot,
    LinkedEngine,
    link_address,
    read_link_token,
)
from serving.launch import ROOT, free_port
from serving.replicas import ReplicaSet
from workloads import Message, Request

EXACT = Sampling(ignore_eos=True)
HELLO = (Message("user", "Hello there"),)


def request(request_id: str, max_tokens: int = 8) -> Request:
    return Request(request_id, 0.0, HELLO, max_tokens, "free-tier")


@dataclass
class Hosted:
    host: EngineHost
    replicas: ReplicaSet
    path: str

    def linked(self, index: int = 0) -> LinkedEngine:
        """A replica's engine as a new worker reaches it: over a link of its own."""
        return LinkedEngine(self.replicas[index].config, HostSlot(EngineLink(self.path)))


@contextlib.asynccontextmanager
async def engines(tmp_path: Path) -> AsyncIterator[ReplicaSet]:
    """The embedded twin's replicas, running, ten times faster than its profile."""
    deployment = load_deployment(ROOT / "models.yaml", "embedded-sim").with_time_scale(0.1)
    replicas = ReplicaSet.from_deployment(deployment)
    await replicas.start()
    try:
        yield replicas
    finally:
        await replicas.close()


@pytest.fixture
async def hosted(tmp_path: Path) -> AsyncIterator[Hosted]:
    path = str(tmp_path / "link.sock")
    async with engines(tmp_path) as replicas, link_server(replicas, path) as host:
        yield Hosted(host, replicas, path)


async def collect(engine: LinkedEngine, req: Request, sampling: Sampling) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(req, sampling)]


async def until(predicate: object, what: str) -> None:
    async with asyncio.timeout(10):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.01)


async def test_a_stream_over_the_link_is_the_engines_own(hosted: Hosted) -> None:
    linked = hosted.linked()
    await linked.start()
    assert linked.healthy()
    over_link = await collect(linked, request("same", 12), EXACT)
    # The same request again, from the engine itself: its words are drawn from the request id.
    direct = [d async for d in hosted.replicas[0].engine.generate(request("same", 12), EXACT)]
    assert "".join(d.text for d in over_link) == "".join(d.text for d in direct)
    assert sum(d.tokens for d in over_link) == 12 and over_link[-1].finish_reason == "length"
    assert over_link[-1].prompt_tokens == direct[-1].prompt_tokens > 0
    assert linked.unfinished() == 0
    # A long prompt twice: the second is told what the engine's prefix cache held.
    long = (Message("user", "Hello there " * 100),)
    told = [
        [
            d.cached_tokens
            for d in await collect(linked, Request(f"long{i}", 0.0, long, 3, "free-tier"), EXACT)
        ]
        for i in range(2)
    ]
    # Said once, on the first delta (how many deltas three tokens make depends on timing).
    assert told[0][0] == 0 and told[1][0] > 0
    assert set(told[0][1:] + told[1][1:]) <= {None}
    await linked.close()


async def test_closing_a_stream_early_frees_the_hosts_slot(hosted: Hosted) -> None:
    linked = hosted.linked()
    await linked.start()
    stream = linked.generate(request("long", 1_500), EXACT)
    await anext(stream)
    engine = hosted.replicas[0].engine
    assert engine.unfinished() == 1
    (worker,) = hosted.host.workers
    serving = worker.tasks["long"]
    await stream.aclose()
    await until(serving.done, "the host to abort it")
    assert serving.cancelled() and engine.unfinished() == 0
    await linked.close()


async def test_a_draining_host_reports_down_and_finishes_what_it_serves(hosted: Hosted) -> None:
    """SIGTERM's drain (a pod leaving its Service): the front-ends stop sending at the next
    load report, and the requests in flight run to their end."""
    linked = hosted.linked()
    await linked.start()
    streaming = asyncio.create_task(collect(linked, request("long", 300), EXACT))
    await until(lambda: hosted.host.in_flight == 1, "the request to start")
    draining = asyncio.create_task(hosted.host.drain(30))
    await until(lambda: not linked.healthy(), "the report that the replica is down")
    assert not draining.done()
    deltas = await streaming
    assert sum(d.tokens for d in deltas) == 300 and deltas[-1].finish_reason == "length"
    await asyncio.wait_for(draining, 5)
    await linked.close()


async def test_each_link_sees_the_load_the_others_put_on_a_replica(hosted: Hosted) -> None:
    mine, other = hosted.linked(), hosted.linked()
    await mine.start()
    await other.start()
    stream = other.generate(request("theirs", 1_500), EXACT)
    await anext(stream)
    await until(lambda: (load := mine.load()) is not None and load.others == 1, "the report")
    assert (theirs := other.load()) is not None and theirs.others == 0  # its own, not another's
    await stream.aclose()
    await until(lambda: (load := mine.load()) is not None and load.others == 0, "the next one")
    await mine.close()
    await other.close()


async def test_what_the_engine_refuses_crosses_the_link_as_it_was(hosted: Hosted) -> None:
    linked = hosted.linked()
    await linked.start()
    with pytest.raises(InvalidRequest) as refused:
        await collect(linked, request("lp"), Sampling(logprobs=2))
    assert refused.value.param == "logprobs" and "simulated replica" in refused.value.message
    await linked.close()


async def test_a_lost_host_ends_open_streams_in_engine_errors(tmp_path: Path) -> None:
    path = str(tmp_path / "link.sock")
    async with engines(tmp_path) as replicas:
        async with link_server(replicas, path) as host:
            linked = LinkedEngine(replicas[0].config, HostSlot(EngineLink(path)))
            await linked.start()
            stream = linked.generate(request("cut", 1_500), EXACT)
            await anext(stream)
            assert host.workers
        with pytest.raises(EngineError, match="lost the engine host"):
            async for _ in stream:
                pass
        assert not linked.healthy()


TOKEN = "a-link-token-of-some-length"


async def test_over_tcp_a_front_end_with_the_token_is_served(tmp_path: Path) -> None:
    """The link of another host: TCP, and the shared token first."""
    address = f"127.0.0.1:{free_port()}"
    async with engines(tmp_path) as replicas, link_server(replicas, address, TOKEN) as host:
        linked = LinkedEngine(replicas[0].config, HostSlot(EngineLink(address, TOKEN)))
        await linked.start()
        assert linked.healthy() and len(host.workers) == 1
        out = await collect(linked, request("tcp", 12), EXACT)
        assert sum(d.tokens for d in out) == 12 and out[-1].finish_reason == "length"
        await linked.close()


@pytest.mark.parametrize("token", ["not-the-link-token-at-all", None])
async def test_a_wrong_or_missing_token_is_refused_with_a_line_that_says_so(
    tmp_path: Path, token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    address = f"127.0.0.1:{free_port()}"
    async with engines(tmp_path) as replicas, link_server(replicas, address, TOKEN) as host:
        linked = LinkedEngine(replicas[0].config, HostSlot(EngineLink(address, token)))
        with pytest.raises(EngineUnavailable, match="refused this front-end") as refused:
            await linked.start()
        why = "wrong link token" if token else "no link token"
        assert why in str(refused.value) and not linked.healthy()
        # Nothing it sends is served: it is not among the host's workers, and the engine idle.
        assert not host.workers and replicas[0].engine.unfinished() == 0
        with pytest.raises(EngineUnavailable):
            await collect(linked, request("refused"), EXACT)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(line.startswith("refused a front-end at 127.0.0.1:") and why in line
               for line in lines), lines  # fmt: skip


def test_the_link_is_at_a_path_or_a_host_and_port() -> None:
    assert link_address("/tmp/x/link.sock") == "/tmp/x/link.sock"
    assert link_address("10.0.0.5:7000") == ("10.0.0.5", 7000)
    assert link_address("engines-0.engines.default.svc:7000") == (
        "engines-0.engines.default.svc", 7000
    )  # fmt: skip
    assert link_address("[fd00::5]:7000") == ("fd00::5", 7000)


def test_a_short_link_token_is_refused(tmp_path: Path) -> None:
    (tmp_path / "short").write_text("secret\n")
    (tmp_path / "long").write_text(TOKEN + "\n")
    with pytest.raises(ValueError, match="16 characters"):
        read_link_token(str(tmp_path / "short"))
    assert read_link_token(str(tmp_path / "long")) == TOKEN


async def test_a_strangers_bytes_are_refused_and_the_host_serves_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A port scanner, an HTTP client, a flood: none is read past its first bytes."""
    address = f"127.0.0.1:{free_port()}"
    host_name, port = address.split(":")
    async with engines(tmp_path) as replicas, link_server(replicas, address, TOKEN) as host:
        for junk in (
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"\xff" * 10_000,
            b"\x00\x00\x00\x02\xc1\xc1",
        ):
            reader, writer = await asyncio.open_connection(host_name, int(port))
            writer.write(junk)
            async with asyncio.timeout(5):
                await reader.read()  # until the host closes it
            writer.close()
        assert not host.workers
        linked = LinkedEngine(replicas[0].config, HostSlot(EngineLink(address, TOKEN)))
        await linked.start()
        assert sum(d.tokens for d in await collect(linked, request("after", 5), EXACT)) == 5
        await linked.close()
    refused = [r.getMessage() for r in caplog.records if "refused a front-end" in r.getMessage()]
    assert len(refused) == 3 and all("not the engine link" in line for line in refused), refused
