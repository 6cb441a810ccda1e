"""The load generator's closed-loop mode (`workloads.replay.closed_loop`, `--max-concurrency`,
`--conversations`): exactly N requests in flight while any wait, and a conversation's next turn
only after its previous answer. The logic with a stand-in sender whose answers the test releases
one by one; the whole client against a live twin below."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.servers import PYTHON, ROOT, Server
from workloads import Request
from workloads.replay import closed_loop
from workloads.summary import Outcome


def _requests(n: int, sessions: int = 0) -> list[Request]:
    out = []
    for i in range(n):
        session = f"s{i % sessions}" if sessions else None
        out.append(Request(f"r{i}", 0.0, "x", 4, "free-tier", session_id=session))
    return out


class _Gated:
    """A sender whose requests end only when the test says."""

    def __init__(self) -> None:
        self.in_flight: dict[str, asyncio.Event] = {}
        self.sent: list[str] = []
        self.ended: list[str] = []

    async def send(self, request: Request) -> Outcome:
        gate = self.in_flight[request.request_id] = asyncio.Event()
        self.sent.append(request.request_id)
        await gate.wait()
        del self.in_flight[request.request_id]
        self.ended.append(request.request_id)
        return Outcome(request.request_id, request.qos_class, request.task, request.arrival)

    def end_one(self) -> None:
        next(iter(self.in_flight.values())).set()


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_exactly_n_requests_are_in_flight_while_any_wait(n: int) -> None:
    async def run() -> None:
        sender = _Gated()
        total = 20
        driver = asyncio.create_task(
            closed_loop(_requests(total), sender.send, time.perf_counter(), n, ordered=False)
        )
        for ended in range(total):
            await _settle()
            assert len(sender.in_flight) == min(n, total - ended)
            sender.end_one()
        outcomes = await driver
        assert len(outcomes) == total and sender.sent == [f"r{i}" for i in range(total)]

    asyncio.run(run())


def test_a_conversations_next_turn_waits_for_its_previous_answer() -> None:
    async def run() -> None:
        sender = _Gated()
        requests = _requests(12, sessions=3)  # s0: r0, r3, r6, r9 ...
        driver = asyncio.create_task(
            closed_loop(requests, sender.send, time.perf_counter(), None, ordered=True)
        )
        for _ in range(12):
            await _settle()
            sessions = [r.session_id for r in requests if r.request_id in sender.in_flight]
            assert len(sessions) == len(set(sessions)), "two turns of one conversation at once"
            sender.end_one()
        await driver
        for i, request_id in enumerate(sender.sent):
            turn = int(request_id[1:])
            if turn >= 3:  # its previous turn ended before it was sent
                assert sender.ended.index(f"r{turn - 3}") < i

    asyncio.run(run())


def test_the_client_runs_conversations_closed_loop_against_a_twin(
    twin_server: Server, tmp_path: Path
) -> None:
    out = tmp_path / "closed.json"
    command = [
        PYTHON, "-m", "workloads.replay", "--proto", "h1", "--url", twin_server.url,
        "--conversations", "lmsys-chat", "--num-conversations", "6", "--max-concurrency", "3",
        "--max-output-tokens", "8", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.exists(), done.stderr[-3000:]
    record = json.loads(out.read_text())
    rows = record["requests"]
    assert record["summary"]["errored"] == 0, record["summary"]["errors"]
    sessions = {r["request_id"].rpartition("t")[0] for r in rows}
    assert len(sessions) == 6 and len(rows) >= 6
    spans = [(r["arrival_s"], r["arrival_s"] + r["e2el_s"]) for r in rows]
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert most <= 3
