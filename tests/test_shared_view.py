"""The workers' shared rows: the arrival rate every worker reads is the one a single process
would estimate from all arrivals, a dead worker's row leaves it, and no read ever combines two
writes (a writer in another process, read while it writes)."""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Iterator

import pytest

from router.features import ArrivalRateEstimator
from serving.shared_view import SharedArrivalRate, WorkerRows


@pytest.fixture
def rows() -> Iterator[WorkerRows]:
    made = WorkerRows.create(3)
    yield made
    made.close(unlink=True)


def test_the_workers_rates_add_up_to_one_estimate_over_every_arrival(rows: WorkerRows) -> None:
    workers = [SharedArrivalRate(rows, i) for i in range(3)]
    whole = ArrivalRateEstimator()
    rng = random.Random(7)
    now = 100.0
    for _ in range(2_500):  # 50 req/s in virtual time, each arrival at a worker drawn at random
        now += rng.expovariate(50.0)
        found = rng.choice(workers).observe(now)
        assert found == pytest.approx(whole.observe(now), rel=1e-9)
    later = now + 3.0
    for worker in workers:
        assert worker.value(later) == pytest.approx(whole.value(later), rel=1e-9)
    assert 40 < whole.value(now) < 60


def test_a_cleared_row_leaves_the_estimate(rows: WorkerRows) -> None:
    mine, theirs = SharedArrivalRate(rows, 0), SharedArrivalRate(rows, 1)
    for t in range(100):
        theirs.observe(10.0 + t / 10)
    assert mine.value(20.0) > 5
    rows.clear(1)  # the supervisor, on worker 1's death
    assert mine.value(20.0) == 0.0


def _write(name: str, writes: int) -> None:
    rows = WorkerRows.attach(name, 3)
    for i in range(1, writes + 1):
        rows.write(2, float(i), float(i))
    rows.close()


def test_no_read_mixes_two_writes(rows: WorkerRows) -> None:
    writer = multiprocessing.get_context("spawn").Process(target=_write, args=(rows.name, 200_000))
    writer.start()
    seen = 0
    while writer.is_alive() or seen == 0:
        level, at = rows.read(2)
        assert level == at, (level, at)  # a level from one write, a time from another: torn
        seen += 1
    writer.join()
    assert writer.exitcode == 0 and rows.read(2) == (200_000.0, 200_000.0)


def test_a_row_left_mid_write_reads_empty_until_cleared(rows: WorkerRows) -> None:
    rows.write(1, 5.0, 1.0)
    rows._counts[1 * 3] += 1  # a worker killed between its two counts
    assert rows.read(1) == (0.0, 0.0)
    rows.clear(1)
    rows.write(1, 2.0, 3.0)
    assert rows.read(1) == (2.0, 3.0)
