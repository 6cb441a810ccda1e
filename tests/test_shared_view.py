"""What the workers share: the arrival rate every worker reads is the one a single process would
estimate from all arrivals, a dead worker's row leaves it, and no read ever combines two writes
(a writer in another process, read while it writes); each worker sees the others' requests at
each replica; and a key's limits hold over every worker, with workers in processes of their own
taking the last slot at once."""

from __future__ import annotations

import multiprocessing
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from config import Deployment, load_deployment
from router.features import ArrivalRateEstimator
from serving.key_limits import CONCURRENT, RATE, KeyLimiter, OverLimit
from serving.shared_view import SharedArrivalRate, SharedView, WorkerRows
from tests.support.servers import METERED_KEY, SINGLE_KEY
from tests.support.servers import write_test_config as write_config


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    return load_deployment(write_config(tmp_path_factory.mktemp("shared")), "embedded-sim")


@pytest.fixture
def view(deployment: Deployment) -> Iterator[SharedView]:
    made = SharedView.create(deployment, 3)
    yield made
    made.close(remove=True)


@pytest.fixture
def rows(view: SharedView) -> WorkerRows:
    return view.rows


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


def _write(folder: Path, deployment: Deployment, writes: int) -> None:
    view = SharedView.attach(str(folder), deployment)
    for i in range(1, writes + 1):
        view.rows.write(2, float(i), float(i))
    view.close()


def test_no_read_mixes_two_writes(view: SharedView, deployment: Deployment) -> None:
    rows = view.rows
    writer = multiprocessing.get_context("spawn").Process(
        target=_write, args=(view.folder, deployment, 200_000)
    )
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
    rows._counts[1 * rows.width] += 1  # a worker killed between its two counts
    assert rows.read(1) == (0.0, 0.0)
    rows.clear(1)
    rows.write(1, 2.0, 3.0)
    assert rows.read(1) == (2.0, 3.0)


def test_each_worker_counts_the_others_requests_at_each_replica(rows: WorkerRows) -> None:
    rows.publish(0, 1, running=4, waiting=1, owed=400)
    rows.publish(1, 1, running=2, waiting=2, owed=100)
    rows.publish(2, 0, running=7, waiting=0, owed=70)
    assert rows.others(0, 1) == (2, 2, 100)
    assert rows.others(1, 1) == (4, 1, 400)
    assert rows.others(2, 1) == (6, 3, 500)
    assert rows.others(0, 0) == (7, 0, 70)
    rows.clear(1)  # the supervisor, on worker 1's death
    assert rows.others(0, 1) == (0, 0, 0)
    assert rows.others(1, 0) == (7, 0, 70)  # another worker's count at another replica stays


def limiter(view: SharedView, deployment: Deployment, worker: int) -> KeyLimiter:
    accounts = SharedView.attach(str(view.folder), deployment).keys.for_worker(worker)
    return KeyLimiter(lambda key: deployment.key_limits[key], accounts)


def test_a_keys_limits_hold_over_every_worker(view: SharedView, deployment: Deployment) -> None:
    a, b = limiter(view, deployment, 0), limiter(view, deployment, 1)
    # Concurrency 1: held at one worker, refused at the other, until released there.
    a.acquire(SINGLE_KEY, now=1.0)
    with pytest.raises(OverLimit) as over:
        b.acquire(SINGLE_KEY, now=1.0)
    assert over.value.limit == CONCURRENT
    a.release(SINGLE_KEY)
    b.acquire(SINGLE_KEY, now=1.0)
    # A dead worker's requests leave the count.
    view.keys.clear(1)
    a.acquire(SINGLE_KEY, now=1.0)
    # A burst of 2 at 0.01 req/s: two requests in all, whichever workers take them.
    a.acquire(METERED_KEY, now=2.0)
    b.acquire(METERED_KEY, now=2.5)
    for worker in (a, b):
        with pytest.raises(OverLimit) as over:
            worker.acquire(METERED_KEY, now=3.0)
        assert over.value.limit == RATE


def _race(folder: Path, deployment: Deployment, worker: int, tries: int, out: Path) -> None:
    view = SharedView.attach(str(folder), deployment)
    keys = limiter(view, deployment, worker)
    held = both = 0
    for _ in range(tries):
        try:
            keys.acquire(SINGLE_KEY, now=1.0)
        except OverLimit:
            continue
        held += 1
        # While this one holds the slot, the other cannot take it: its cell stays 0 throughout.
        both += view.keys.in_flight(SINGLE_KEY) != 1
        keys.release(SINGLE_KEY)
    out.write_text(f"{held} {both}")


def test_workers_racing_for_one_slot_never_both_hold_it(
    view: SharedView, deployment: Deployment, tmp_path: Path
) -> None:
    """Two processes take and give back a concurrency-1 key as fast as they can; neither ever
    finds the other holding it while it does."""
    spawn = multiprocessing.get_context("spawn")
    racers = [
        spawn.Process(target=_race, args=(view.folder, deployment, i, 50_000, tmp_path / str(i)))
        for i in (0, 1)
    ]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
        assert racer.exitcode == 0
    counts = [[int(n) for n in (tmp_path / str(i)).read_text().split()] for i in (0, 1)]
    held, both = [c[0] for c in counts], [c[1] for c in counts]
    assert all(h > 0 for h in held), held  # both took the slot, in turns
    assert both == [0, 0]
    assert view.keys.in_flight(SINGLE_KEY) == 0


def test_a_dead_supervisors_folder_is_removed_by_the_next(deployment: Deployment) -> None:
    dead = SharedView.create(deployment, 2)
    live = SharedView.create(deployment, 2)
    child = subprocess.Popen(["true"])
    child.wait()
    (dead.folder / "owner").write_text(str(child.pid))  # its supervisor was SIGKILLed
    after = SharedView.create(deployment, 2)
    try:
        assert not dead.folder.exists()
        assert live.folder.exists()  # this process still runs
    finally:
        for view in (dead, live, after):
            view.close(remove=True)
