"""What the workers of one server (`--workers N`) share through shared memory: a row per worker,
which only that worker writes and every worker reads, with no locks.

A row holds the worker's arrival-rate level (`router.features.ArrivalRateEstimator`) and when
it last changed. The estimator's level is a sum of one decaying term per arrival, so the levels
of all rows, each decayed to the same moment, add up to exactly the estimate one process would
make from every arrival: each worker routes on the whole server's arrival rate. (The replicas'
loads are shared another way: each worker counts its own requests exactly and hears the others'
from the engines, over the engine link or a server's /metrics.)

A row is written under a sequence count, odd while the write is under way (a seqlock): a reader
that finds it odd, or changed across its read, reads again, so that it never combines one
write's level with another's time. The supervisor clears a dead worker's row before its
restart: its arrivals leave the estimate, as they would have within the horizon anyway.
"""

from __future__ import annotations

import math
from multiprocessing import shared_memory

from router.features import ArrivalRateEstimator

_FIELDS = 3
"""A row: its sequence count, the level, and the time the level was set (`time.monotonic()`,
one clock for every process of the host), 8 bytes each. They are read and written one 8-byte
item at a time through typed views of the block: `struct.pack_into` would not do, since it
zeroes the whole field before it writes it, and a reader could take the zeroed count for an
even one."""


_READ_TRIES = 10_000
"""A live writer holds a row odd for a few hundred nanoseconds; far longer, it died there."""


class WorkerRows:
    def __init__(self, memory: shared_memory.SharedMemory, workers: int) -> None:
        self.memory = memory
        self.workers = workers
        assert memory.buf is not None and len(memory.buf) >= 8 * _FIELDS * workers
        self._counts = memory.buf.cast("q")
        self._values = memory.buf.cast("d")

    @classmethod
    def create(cls, workers: int) -> WorkerRows:
        """New rows, all clear, for the supervisor to hand down by `name`."""
        memory = shared_memory.SharedMemory(create=True, size=8 * _FIELDS * workers)
        rows = cls(memory, workers)
        for index in range(workers):
            rows.clear(index)
        return rows

    @classmethod
    def attach(cls, name: str, workers: int) -> WorkerRows:
        # track=False (3.13) is not here: the resource tracker would unlink the block when the
        # first worker exits; the supervisor owns it, so a worker's tracker must not.
        memory = shared_memory.SharedMemory(name=name)
        _untrack(memory)
        return cls(memory, workers)

    @property
    def name(self) -> str:
        return self.memory.name

    def write(self, index: int, level: float, at: float) -> None:
        row = index * _FIELDS
        # Odd while written; odd already if a writer was killed mid-write (the supervisor's
        # clear then ends even all the same).
        sequence = self._counts[row] | 1
        self._counts[row] = sequence
        self._values[row + 1] = level
        self._values[row + 2] = at
        self._counts[row] = sequence + 1

    def read(self, index: int) -> tuple[float, float]:
        """The row's level and time; (0, 0) for a row that stays mid-write, whose worker died
        writing it (its supervisor clears it)."""
        row = index * _FIELDS
        for _ in range(_READ_TRIES):
            sequence = self._counts[row]
            if sequence % 2:
                continue
            level, at = self._values[row + 1], self._values[row + 2]
            if self._counts[row] == sequence:
                return level, at
        return 0.0, 0.0

    def clear(self, index: int) -> None:
        self.write(index, 0.0, 0.0)

    def close(self, unlink: bool = False) -> None:
        self._counts.release()
        self._values.release()
        self.memory.close()
        if unlink:
            self.memory.unlink()


def _untrack(memory: shared_memory.SharedMemory) -> None:
    from multiprocessing import resource_tracker

    resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]


class SharedArrivalRate(ArrivalRateEstimator):
    """The arrival rate over every worker's arrivals: this worker's own estimate, published in
    its row, plus the other rows' levels decayed to now."""

    def __init__(self, rows: WorkerRows, index: int, horizon_s: float = 10.0) -> None:
        super().__init__(horizon_s)
        self.rows = rows
        self.index = index

    def observe(self, now: float) -> float:
        before = super().observe(now) + self._others(now)
        self.rows.write(self.index, self.level(now), now)
        return before

    def value(self, now: float) -> float:
        return super().value(now) + self._others(now)

    def _others(self, now: float) -> float:
        total = 0.0
        for index in range(self.rows.workers):
            if index != self.index:
                level, at = self.rows.read(index)
                if level:
                    total += level * math.exp(-max(0.0, now - at) / self.horizon_s)
        return total
