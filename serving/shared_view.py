"""What the workers of one server (`--workers N`) share: a directory the supervisor makes before
it starts them (on tmpfs, where the host has one) and removes after the last has stopped.

- `rows`: a row per worker, which only that worker writes and every worker reads, with no
  locks (`WorkerRows`): its arrival-rate level, and its requests at each replica.
- `keys`: the API keys' accounts, for limits that hold across workers
  (`serving.key_limits.SharedAccounts`).
- `metrics/`: prometheus_client's multiprocess files, one set per worker process, merged at
  each scrape (`serving.metrics`).
- `worker-<i>.sock`: where worker i answers the others' questions (`serving.peers`).

The supervisor clears what a dead worker leaves (`SharedView.clear`) before its restart.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
import tempfile
from pathlib import Path

from config import Deployment
from router.features import ArrivalRateEstimator
from serving.key_limits import SharedAccounts, key_slots

_ROW_HEAD = 3
"""A row starts with its sequence count, the level, and the time the level was set
(`time.monotonic()`, one clock for every process of the host); then each replica's running,
waiting and owed (`serving.replicas.Replica`); then, per QoS class, the requests the worker's
gateway holds open (`serving.metrics.Metrics.opened`). 8 bytes each, read and written one
8-byte item at a time through typed views of the block: `struct.pack_into` would not do, since
it zeroes the whole field before it writes it, and a reader could take the zeroed count for an
even one."""
_PER_REPLICA = 3

_READ_TRIES = 10_000
"""A live writer holds a row odd for a few hundred nanoseconds; far longer, it died there."""


def _mapped(path: Path, size: int, create: bool) -> mmap.mmap:
    with open(path, "w+b" if create else "r+b") as file:
        if create:
            file.truncate(size)
        return mmap.mmap(file.fileno(), size)


class WorkerRows:
    """The arrival level is written under a sequence count, odd while the write is under way (a
    seqlock): a reader that finds it odd, or changed across its read, reads again, so that it
    never combines one write's level with another's time. The replica counts are single words
    read one at a time: a reader may see a request in one worker's running and not yet in its
    owed, which is off by one request for a moment, never torn."""

    def __init__(self, block: mmap.mmap, workers: int, replicas: int, classes: int) -> None:
        self.block = block
        self.workers = workers
        self.replicas = replicas
        self.classes = classes
        self.width = _ROW_HEAD + _PER_REPLICA * replicas + classes
        self._open = _ROW_HEAD + _PER_REPLICA * replicas
        assert len(block) >= 8 * self.width * workers
        self._counts = memoryview(block).cast("q")
        self._values = memoryview(block).cast("d")

    @staticmethod
    def size(workers: int, replicas: int, classes: int) -> int:
        return 8 * (_ROW_HEAD + _PER_REPLICA * replicas + classes) * workers

    def write(self, index: int, level: float, at: float) -> None:
        row = index * self.width
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
        row = index * self.width
        for _ in range(_READ_TRIES):
            sequence = self._counts[row]
            if sequence % 2:
                continue
            level, at = self._values[row + 1], self._values[row + 2]
            if self._counts[row] == sequence:
                return level, at
        return 0.0, 0.0

    def publish(self, index: int, replica: int, running: int, waiting: int, owed: int) -> None:
        cell = index * self.width + _ROW_HEAD + _PER_REPLICA * replica
        self._counts[cell] = running
        self._counts[cell + 1] = waiting
        self._counts[cell + 2] = owed

    def others(self, index: int, replica: int) -> tuple[int, int, int]:
        """The running, waiting and owed of every other worker at `replica`, summed."""
        running = waiting = owed = 0
        cell = _ROW_HEAD + _PER_REPLICA * replica
        for other in range(self.workers):
            if other != index:
                at = other * self.width + cell
                running += self._counts[at]
                waiting += self._counts[at + 1]
                owed += self._counts[at + 2]
        return running, waiting, owed

    def add_open(self, index: int, qos_class: int, change: int) -> None:
        self._counts[index * self.width + self._open + qos_class] += change

    def open(self, index: int) -> list[int]:
        """Worker `index`'s open requests, by class."""
        at = index * self.width + self._open
        return list(self._counts[at : at + self.classes])

    def clear(self, index: int) -> None:
        self.write(index, 0.0, 0.0)
        for replica in range(self.replicas):
            self.publish(index, replica, 0, 0, 0)
        at = index * self.width + self._open
        for qos_class in range(self.classes):
            self._counts[at + qos_class] = 0

    def close(self) -> None:
        self._counts.release()
        self._values.release()
        self.block.close()


class SharedView:
    def __init__(self, folder: Path, workers: int, deployment: Deployment) -> None:
        """Map the view in `folder` of `workers` workers of `deployment` (every worker runs the
        same deployment, so each lays the rows and the keys' accounts out the same way)."""
        self.folder = folder
        self.workers = workers
        self.classes = list(deployment.qos_classes)
        create = not (folder / "rows").exists()
        shape = (workers, len(deployment.replicas), len(self.classes))
        self.rows = WorkerRows(_mapped(folder / "rows", WorkerRows.size(*shape), create), *shape)
        self.keys = SharedAccounts(folder / "keys", key_slots(deployment), workers, create)

    @classmethod
    def create(cls, deployment: Deployment, workers: int) -> SharedView:
        """A new view, all clear, for the supervisor: a private folder (mkdtemp's 0700). The
        folders of supervisors that died without removing theirs (SIGKILL) are removed first:
        on tmpfs they would hold memory until the host restarts."""
        base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        for old in base.glob("serving-*"):
            if not _alive(old / "owner"):
                shutil.rmtree(old, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(prefix="serving-", dir=base))
        (folder / "owner").write_text(str(os.getpid()))
        (folder / "metrics").mkdir()
        (folder / "workers").write_text(str(workers))
        return cls(folder, workers, deployment)

    @classmethod
    def attach(cls, folder: str, deployment: Deployment) -> SharedView:
        return cls(Path(folder), int((Path(folder) / "workers").read_text()), deployment)

    @property
    def metrics(self) -> Path:
        """prometheus_client's multiprocess folder (PROMETHEUS_MULTIPROC_DIR)."""
        return self.folder / "metrics"

    def socket(self, index: int) -> Path:
        return self.folder / f"worker-{index}.sock"

    def clear(self, index: int) -> dict[str, int]:
        """Forget what worker `index`, now dead, held: its arrivals leave the estimate (as they
        would have within the horizon anyway), its requests leave the replicas' counts and its
        keys' in-flight counts. Returns how many requests of each class it held open, for the
        supervisor to count as ended with it (`serving.metrics.count_lost`): this module
        keeps the shared rows, and knows nothing of /metrics."""
        lost = dict(zip(self.classes, self.rows.open(index), strict=True))
        self.rows.clear(index)
        self.keys.clear(index)
        self.socket(index).unlink(missing_ok=True)
        return lost

    def close(self, remove: bool = False) -> None:
        self.rows.close()
        self.keys.close()
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)


def _alive(owner: Path) -> bool:
    """Whether the supervisor that `owner` names still runs. A folder with no owner is one
    that is being made (it is written first), or one left before owners were written: the
    latter, once the folder's layout is there."""
    try:
        pid = int(owner.read_text())
    except FileNotFoundError:
        return not (owner.parent / "workers").exists()
    except ValueError:
        return True  # being written at this moment
    except OSError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: alive, and not ours to remove
    return True


class SharedArrivalRate(ArrivalRateEstimator):
    """The arrival rate over every worker's arrivals: this worker's own estimate, published in
    its row, plus the other rows' levels decayed to now.

    The estimator's level is a sum of one decaying term per arrival, so the levels of all rows,
    each decayed to the same moment, add up to exactly the estimate one process would make from
    every arrival: each worker routes on the whole server's arrival rate."""

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
