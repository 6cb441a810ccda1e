"""Stream schedulers: which QUIC streams get room in the next packet, and in what order.

For every packet it builds, the connection asks its scheduler for streams one at a time
(`pop`). Each stream in turn fills what it can of the packet, so the first stream fills the
packet before the next one gets any room; the connection stops popping when the packet is
full or the scheduler is empty. After the packet it gives every popped stream back with
`requeue(id, sent, now)`, in pop order, or `remove(id)` for those that finished. Between two
packets the queue therefore hands out the same order again, except for the changes each policy
documents (round-robin rotates the streams that sent, EDF demotes or drops the late ones).
Popping everything and requeueing everything with `sent=0` leaves the order unchanged in every
policy.

A stream with nothing to send is `park`ed: it leaves the queue, so `pop` never hands it out, but
it keeps everything its place depends on (its arrival, its round-robin position, its rank, its
deadline, which still expires). `unpark` puts it back exactly where it would be had it stayed
queued and been popped and given back with nothing sent in every packet meanwhile. A connection
with a thousand open streams and three with bytes therefore pops three streams a packet, not the
idle ones ahead of them in the order.

Streams are plain ints (QUIC stream ids) tagged with a `StreamSpec`. The server learns a
request's class only after its headers arrive, so `update` re-tags a stream in place.

Time is virtual: every method that needs it takes `now` (seconds, the clock the deadlines are
on, never decreasing); nothing here reads a clock, so tests and simulations are exact.

Policies, by registry name:
  fcfs  arrival order; a stream keeps its place until it ends.
  rr    deterministic round-robin. aioquic's own scheduler collects the streams with data in a
        set, so its order varies from run to run; this one does not.
  edf   earliest deadline first; hard deadlines that pass are dropped, soft ones demoted.
  abs   absolute priority over a sorted list (bisect.insort, list.pop(0)): the baseline "sorted
        list ABS" of Chuppala (2024), chapter 2. Inserting and popping cost O(n) (the list shifts).
  ml    multi-level: the high class in EDF order always before the low class in round-robin.
  pifo  the same order as abs over a heap (push-in-first-out queue): O(log n) insert and pop;
        a pop and the requeue of the same stream make one heapreplace (none if its rank holds).
  abs and pifo share a leaner bookkeeping than the others (`_RankScheduler`): one packed int
  rank per stream, computed when it is added or re-tagged, so that both compare only the
  data structures.

Stdlib only: no aioquic import, so the policies are unit-testable alone.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from dataclasses import dataclass
from heapq import heapify, heappop, heappush, heapreplace
from typing import Any, ClassVar

__all__ = [
    "SCHEDULERS",
    "AbsScheduler",
    "EdfScheduler",
    "FcfsScheduler",
    "MultiLevelScheduler",
    "PifoScheduler",
    "RoundRobinScheduler",
    "Scheduler",
    "StreamSpec",
    "make_scheduler",
]


@dataclass(frozen=True)
class StreamSpec:
    """How a stream should be scheduled. Each policy reads only the fields it cares about."""

    priority: int = 0
    """Larger is more urgent (Chuppala (2024) used 1..10, 10 highest). Read by abs and pifo."""
    deadline: float | None = None
    """Absolute time on the clock of `now`; None: no deadline. Read by edf and ml's high class."""
    high: bool = False
    """Member of ml's high class."""
    soft: bool = False
    """A soft deadline demotes the stream once it passes; a hard one drops it (see `expired`)."""


DEFAULT_SPEC = StreamSpec()

Key = tuple[float, ...]
"""A heap key: compared element by element, smallest served first."""


class _LazyHeap:
    """A min-heap of streams by key, with O(1) lazy deletion.

    Deleting from the middle of a heap costs O(n), so `discard` only forgets the stream; its
    entry stays in the heap, stale, and is skipped when it reaches the top. Each push gets a
    fresh generation number and an entry is live only if it carries its stream's current one,
    so a stream discarded and pushed again under the same key is never served twice. When
    stale entries outnumber half the heap it is rebuilt without them, which bounds the memory
    and keeps pop at O(log n) amortised.
    """

    __slots__ = ("_heap", "_live", "_generations", "_stale")

    def __init__(self) -> None:
        # Entries are flat tuples (*key, generation, id): a heap compares entries at every level
        # it sifts through, and flat tuples compare about twice as fast as ((key), gen, id).
        # Keys are unique among live entries, so the generation and id only break ties with
        # stale entries.
        self._heap: list[tuple[Any, ...]] = []
        self._live: dict[int, int] = {}  # stream id -> generation of its live entry
        self._generations = itertools.count()
        self._stale = 0

    def push(self, stream_id: int, key: Key) -> None:
        if stream_id in self._live:
            self.discard(stream_id)
        generation = next(self._generations)
        self._live[stream_id] = generation
        heapq.heappush(self._heap, (*key, generation, stream_id))

    def discard(self, stream_id: int) -> None:
        if self._live.pop(stream_id, None) is None:
            return
        self._stale += 1
        if self._stale > len(self._heap) // 2:
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[-1]) == e[-2]]
            heapq.heapify(self._heap)
            self._stale = 0

    def _prune(self) -> None:
        """Drop stale entries from the top."""
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][-1]) != heap[0][-2]:
            heapq.heappop(heap)
            self._stale -= 1

    def peek(self) -> tuple[Key, int] | None:
        """(key, id) of the smallest live entry, or None."""
        self._prune()
        if not self._heap:
            return None
        entry = self._heap[0]
        return entry[:-2], entry[-1]

    def pop(self) -> int | None:
        heap, live = self._heap, self._live
        while heap:
            entry = heapq.heappop(heap)
            stream_id = entry[-1]
            if live.get(stream_id) == entry[-2]:
                del live[stream_id]
                return stream_id
            self._stale -= 1
        return None

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._live

    def __len__(self) -> int:
        return len(self._live)


class _RoundRobinQueue:
    """Round-robin order: streams by position; a stream that sent goes to a new tail position.

    A stream keeps its position while popped, so one given back with nothing sent returns to
    exactly where it was (the head, since it was popped). Positions are handed out in requeue
    order, which is pop order, so the rotation is the same on every run.
    """

    def __init__(self) -> None:
        self._heap = _LazyHeap()
        self._position: dict[int, int] = {}
        self._tail = itertools.count()

    def insert(self, stream_id: int) -> None:
        position = self._position.get(stream_id)
        if position is None:
            position = self._position[stream_id] = next(self._tail)
        self._heap.push(stream_id, (position,))

    def rotate(self, stream_id: int) -> None:
        """Send the stream to the tail at its next insert."""
        self._position[stream_id] = next(self._tail)

    def delete(self, stream_id: int) -> None:
        """Out of the queue, position kept."""
        self._heap.discard(stream_id)

    def forget(self, stream_id: int) -> None:
        """The stream left this queue for good (ended or changed class): drop its position."""
        self._heap.discard(stream_id)
        self._position.pop(stream_id, None)

    def pop(self) -> int | None:
        return self._heap.pop()


class _EdfQueue:
    """Earliest deadline first, ties by arrival; streams without a deadline after all others.

    Three heaps, served in order: `on_time` (deadline not passed at the last sweep), `late`
    (soft deadline passed: demoted behind every on-time stream, still in deadline order) and
    `no_deadline` (arrival order). A sweep moves the streams at the top of `on_time` whose
    deadline is <= now: soft ones to `late`, hard ones to `dead`, where they wait, never
    served, for `take_expired`. The passed deadlines are the smallest, so the sweep only ever
    looks at the top: O(log n) per stream that falls late. A fourth heap, `hard`, holds every
    queued hard-deadline stream (dead ones included) so the next drop time is its top.
    """

    def __init__(self) -> None:
        self._on_time = _LazyHeap()
        self._late = _LazyHeap()
        self._no_deadline = _LazyHeap()
        self._soft: dict[int, bool] = {}
        self._dead: dict[int, Key] = {}  # hard-expired id -> (deadline, seq)
        self._hard = _LazyHeap()

    def insert(self, stream_id: int, spec: StreamSpec, seq: int) -> None:
        if spec.deadline is None:
            self._no_deadline.push(stream_id, (seq,))
        else:
            self._soft[stream_id] = spec.soft
            self._on_time.push(stream_id, (spec.deadline, seq))
            if not spec.soft:
                self._hard.push(stream_id, (spec.deadline, seq))

    def delete(self, stream_id: int) -> None:
        self._on_time.discard(stream_id)
        self._late.discard(stream_id)
        self._no_deadline.discard(stream_id)
        self._soft.pop(stream_id, None)
        self._dead.pop(stream_id, None)
        self._hard.discard(stream_id)

    def _sweep(self, now: float) -> None:
        while (top := self._on_time.peek()) is not None and top[0][0] <= now:
            key, stream_id = top
            self._on_time.pop()
            if self._soft[stream_id]:
                self._late.push(stream_id, key)
            else:
                self._dead[stream_id] = key

    def pop(self, now: float) -> int | None:
        self._sweep(now)
        for heap in (self._on_time, self._late, self._no_deadline):
            stream_id = heap.pop()
            if stream_id is not None:
                # A popped stream is out of the queue: it may end without coming back, and
                # `insert` records its flag again if it does.
                self._hard.discard(stream_id)
                self._soft.pop(stream_id, None)
                return stream_id
        return None

    def next_deadline(self) -> float | None:
        """The earliest hard deadline among the queued streams, passed or not."""
        top = self._hard.peek()
        return None if top is None else top[0][0]

    def take_expired(self, now: float) -> list[int]:
        """The queued streams whose hard deadline is <= now, earliest first, out of the queue."""
        self._sweep(now)
        dead = sorted(self._dead, key=self._dead.__getitem__)
        for stream_id in dead:
            self.delete(stream_id)
        return dead


class Scheduler(ABC):
    """Bookkeeping shared by every policy; subclasses supply the queue. (abs and pifo replace it
    with a leaner one of their own, `_RankScheduler`, that keeps the same interface.)

    A stream is held from `add` to `remove` (or until `expired` returns it). While held it is
    either queued or popped (handed to the connection, waiting for `requeue`). Subclasses
    implement the queue through four hooks over queued streams only: `_insert`, `_delete`,
    `_pop_next`, and optionally `_requeued`, `_forget`, `_take_expired` and `_drops`.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._specs: dict[int, StreamSpec] = {}
        self._seq: dict[int, int] = {}  # arrival order, from add(); update() keeps it
        self._popped: set[int] = set()
        self._parked: set[int] = set()
        # The parked streams whose deadline drops them (`_drops`), by (deadline, arrival): the
        # queue no longer sees them, so expiry looks here.
        self._parked_deadlines = _LazyHeap()
        self._arrivals = itertools.count()

    # -- the interface ----------------------------------------------------------------------

    def add(self, stream_id: int, spec: StreamSpec = DEFAULT_SPEC) -> None:
        """A new stream. ValueError if the id is already held."""
        if stream_id in self._specs:
            raise ValueError(f"stream {stream_id} is already scheduled")
        self._specs[stream_id] = spec
        self._seq[stream_id] = next(self._arrivals)
        self._insert(stream_id)

    def update(self, stream_id: int, spec: StreamSpec) -> None:
        """Re-tag a held stream; it keeps its arrival order. KeyError if the id is not held.

        A queued stream moves at once; a popped one takes its new place when requeued.
        """
        if stream_id not in self._specs:
            raise KeyError(stream_id)
        if stream_id in self._parked:
            # In and out of the queue under the new spec, as a queued stream is re-tagged, so
            # that what a class change does happens now (ml's low class puts it at its tail).
            self._specs[stream_id] = spec
            self._insert(stream_id)
            self._delete(stream_id)
            self._parked_deadlines.discard(stream_id)
            self._watch_parked(stream_id)
            return
        queued = stream_id not in self._popped
        if queued:
            self._delete(stream_id)
        self._specs[stream_id] = spec
        if queued:
            self._insert(stream_id)

    def remove(self, stream_id: int) -> None:
        """The stream ended (queued or popped). An id not held is a no-op."""
        if stream_id not in self._specs:
            return
        if stream_id in self._popped:
            self._popped.discard(stream_id)
        elif stream_id in self._parked:
            self._parked.discard(stream_id)
            self._parked_deadlines.discard(stream_id)
        else:
            self._delete(stream_id)
        self._drop(stream_id)

    def park(self, stream_id: int) -> None:
        """The queued stream has nothing to send: out of the queue until `unpark`, keeping its
        place. A stream not held, or already parked, is a no-op; a popped one is a ValueError
        (give it back with `requeue` first)."""
        if stream_id not in self._specs or stream_id in self._parked:
            return
        if stream_id in self._popped:
            raise ValueError(f"stream {stream_id} is popped: requeue it before parking it")
        self._delete(stream_id)
        self._parked.add(stream_id)
        self._watch_parked(stream_id)

    def unpark(self, stream_id: int) -> None:
        """The parked stream has bytes again: back in the queue at its place. A stream that is
        not parked is a no-op."""
        if stream_id not in self._parked:
            return
        self._parked.discard(stream_id)
        self._parked_deadlines.discard(stream_id)
        self._insert(stream_id)

    def _watch_parked(self, stream_id: int) -> None:
        spec = self._specs[stream_id]
        if spec.deadline is not None and self._drops(spec):
            self._parked_deadlines.push(stream_id, (spec.deadline, self._seq[stream_id]))

    def pop(self, now: float) -> int | None:
        """The next stream to offer room in the packet being built, or None when none is queued.

        The stream leaves the queue until `requeue` or `remove`.
        """
        stream_id = self._pop_next(now)
        if stream_id is not None:
            self._popped.add(stream_id)
        return stream_id

    def requeue(self, stream_id: int, sent: int, now: float) -> None:
        """Give back a popped stream; `sent` is the bytes it put in the packet (0: nothing to send
        or no room left).

        An id no longer held (removed, or expired, since it was popped) is a no-op, like
        `remove`; one held but not popped is a ValueError, as is a negative `sent`.
        """
        if stream_id not in self._specs:
            return
        if stream_id not in self._popped:
            raise ValueError(f"stream {stream_id} was not popped")
        if sent < 0:
            raise ValueError(f"sent must be >= 0, got {sent}")
        self._popped.discard(stream_id)
        self._requeued(stream_id, sent)
        self._insert(stream_id)

    def expired(self, now: float) -> list[int]:
        """Held streams whose hard deadline is <= now, earliest deadline first (ties by arrival).

        They leave the scheduler; the caller resets them. Only policies that drop (edf, and ml's
        high class) return any; popped streams count too.
        """
        gone = self._take_expired(now)
        parked = self._parked_deadlines
        while (top := parked.peek()) is not None and top[0][0] <= now:
            gone.append(top[1])
            parked.pop()
            self._parked.discard(top[1])
        for stream_id in self._popped:
            spec = self._specs[stream_id]
            if self._drops(spec) and spec.deadline is not None and spec.deadline <= now:
                gone.append(stream_id)
        if not gone:
            return gone
        gone.sort(key=lambda s: (self._specs[s].deadline, self._seq[s]))
        for stream_id in gone:
            self._popped.discard(stream_id)
            self._drop(stream_id)
        return gone

    def next_deadline(self) -> float | None:
        """When `expired` will next return something: the earliest hard deadline among the held
        streams this policy drops (it may have passed already), or None. For the connection's
        timer, so that expiry does not wait for the next packet. Soft deadlines do not count:
        demotion happens by itself at the next `pop`.
        """
        deadlines = [
            spec.deadline
            for spec in (self._specs[s] for s in self._popped)
            if self._drops(spec) and spec.deadline is not None
        ]
        queued = self._next_queued_deadline()
        if queued is not None:
            deadlines.append(queued)
        parked = self._parked_deadlines.peek()
        if parked is not None:
            deadlines.append(parked[0][0])
        return min(deadlines, default=None)

    def __len__(self) -> int:
        """Streams held: queued, parked, and popped and not yet given back."""
        return len(self._specs)

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._specs

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}: {len(self)} streams>"

    # -- hooks ------------------------------------------------------------------------------

    @abstractmethod
    def _insert(self, stream_id: int) -> None:
        """Put a held stream that is not queued into the queue, by its current spec (and, for a
        stream that was queued before, at the place its state keeps)."""

    @abstractmethod
    def _delete(self, stream_id: int) -> None:
        """Take a queued stream out of the queue, keeping its place (a round-robin position)."""

    @abstractmethod
    def _pop_next(self, now: float) -> int | None:
        """Take the head of the queue out of it."""

    def _requeued(self, stream_id: int, sent: int) -> None:
        """Called on requeue, before `_insert`: policy state that depends on `sent`."""
        return None

    def _forget(self, stream_id: int) -> None:
        """The stream is no longer held: drop any state the policy keeps beyond the queue."""
        return None

    def _take_expired(self, now: float) -> list[int]:
        """Queued streams past their hard deadline, taken out of the queue."""
        return []

    def _drops(self, spec: StreamSpec) -> bool:
        """Whether a stream with this spec is dropped once its deadline passes."""
        return False

    def _next_queued_deadline(self) -> float | None:
        """The earliest deadline among the queued streams that `_drops`."""
        return None

    def _drop(self, stream_id: int) -> None:
        self._forget(stream_id)
        del self._specs[stream_id]
        del self._seq[stream_id]


class FcfsScheduler(Scheduler):
    """First come, first served: arrival order. A requeued stream goes back to its arrival
    position, so the oldest stream fills every packet until it has nothing left to send."""

    name = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self._heap = _LazyHeap()

    def _insert(self, stream_id: int) -> None:
        self._heap.push(stream_id, (self._seq[stream_id],))

    def _delete(self, stream_id: int) -> None:
        self._heap.discard(stream_id)

    def _pop_next(self, now: float) -> int | None:
        return self._heap.pop()


class RoundRobinScheduler(Scheduler):
    """Deterministic round-robin, new streams at the tail.

    A requeued stream that sent moves to the tail; one that sent nothing keeps its place, so a
    stream that found no room in a full packet goes first in the next one.
    """

    name = "rr"

    def __init__(self) -> None:
        super().__init__()
        self._queue = _RoundRobinQueue()

    def _insert(self, stream_id: int) -> None:
        self._queue.insert(stream_id)

    def _delete(self, stream_id: int) -> None:
        self._queue.delete(stream_id)

    def _pop_next(self, now: float) -> int | None:
        return self._queue.pop()

    def _requeued(self, stream_id: int, sent: int) -> None:
        if sent > 0:
            self._queue.rotate(stream_id)

    def _forget(self, stream_id: int) -> None:
        self._queue.forget(stream_id)


class EdfScheduler(Scheduler):
    """Earliest deadline first, ties by arrival; streams without a deadline come after all the
    streams with one, in arrival order.

    Once `now` reaches a hard deadline the stream is never served again: `expired(now)` removes
    and returns it, since a late answer is worth nothing and its bytes would delay the streams
    that can still make theirs. A soft-deadline stream that is late is demoted behind every
    stream still on time (EDF among the late ones) but still finishes.
    """

    name = "edf"

    def __init__(self) -> None:
        super().__init__()
        self._queue = _EdfQueue()

    def _insert(self, stream_id: int) -> None:
        self._queue.insert(stream_id, self._specs[stream_id], self._seq[stream_id])

    def _delete(self, stream_id: int) -> None:
        self._queue.delete(stream_id)

    def _pop_next(self, now: float) -> int | None:
        return self._queue.pop(now)

    def _take_expired(self, now: float) -> list[int]:
        return self._queue.take_expired(now)

    def _next_queued_deadline(self) -> float | None:
        return self._queue.next_deadline()

    def _drops(self, spec: StreamSpec) -> bool:
        return spec.deadline is not None and not spec.soft


_SEQ_BITS = 64
_SEQ_MASK = (1 << _SEQ_BITS) - 1


class _RankScheduler(Scheduler):
    """The bookkeeping abs and pifo share, kept off the per-call path.

    Both order streams by one rank, (-priority, arrival). It is computed once per stream, at
    `add` and `update`, and packed into a single int, `(-priority << 64) + arrival`, so a
    queue compares one int instead of a tuple and nothing re-reads the spec or the arrival
    order on `pop` or `requeue`. Arrivals are numbered from 0 and stay below 2**64 for as long
    as any connection lives, so the packed order is exactly the tuple order. A rank is unique
    among held streams, so `_queued` maps each queued rank back to its stream.

    What the generic `Scheduler` does on every call and this does not:
    - look up the spec and the arrival order to build a key (`_specs`, `_seq`): the rank is
      built once and kept; abs and pifo read nothing else of the spec;
    - keep a set of popped streams (`_popped`: an add on every pop, a remove on every
      requeue): a held stream is popped exactly when its rank is not in `_queued` and it is not
      parked (`_parked`, which changes only when a stream runs out of bytes or gets more), so
      requeue and remove ask those two;
    - call hooks that do nothing here (`_requeued`, `_forget`).
    Neither policy drops streams, so `expired` and `next_deadline` have nothing to look at.
    Both policies run this same code; only the queue differs: `pop`, `_enqueue` and `_unqueue`,
    and `requeue`, which is the same checks followed by `_enqueue` written out in place (one
    Python call is about a quarter of a requeue once the rest is gone), in both.
    """

    def __init__(self) -> None:
        super().__init__()
        self._rank: dict[int, int] = {}  # held id -> its packed rank
        self._queued: dict[int, int] = {}  # rank of a queued stream -> its id

    # -- the interface, over ranks ---------------------------------------------------------

    def add(self, stream_id: int, spec: StreamSpec = DEFAULT_SPEC) -> None:
        rank = self._rank
        if stream_id in rank:
            raise ValueError(f"stream {stream_id} is already scheduled")
        entry = rank[stream_id] = (-spec.priority << _SEQ_BITS) + next(self._arrivals)
        self._enqueue(stream_id, entry)

    def update(self, stream_id: int, spec: StreamSpec) -> None:
        old = self._rank.get(stream_id)
        if old is None:
            raise KeyError(stream_id)
        entry = self._rank[stream_id] = (-spec.priority << _SEQ_BITS) + (old & _SEQ_MASK)
        if old in self._queued:
            self._unqueue(stream_id, old)
            self._enqueue(stream_id, entry)

    def remove(self, stream_id: int) -> None:
        entry = self._rank.pop(stream_id, None)
        if entry is not None and entry in self._queued:
            self._unqueue(stream_id, entry)
        self._parked.discard(stream_id)

    def park(self, stream_id: int) -> None:
        entry = self._rank.get(stream_id)
        if entry is None or stream_id in self._parked:
            return
        if entry not in self._queued:
            raise ValueError(f"stream {stream_id} is popped: requeue it before parking it")
        self._unqueue(stream_id, entry)
        self._parked.add(stream_id)

    def unpark(self, stream_id: int) -> None:
        if stream_id in self._parked:
            self._parked.discard(stream_id)
            self._enqueue(stream_id, self._rank[stream_id])

    @abstractmethod
    def pop(self, now: float) -> int | None:
        """The queue's pop: the queued stream of smallest rank, out of `_queued`."""

    @abstractmethod
    def requeue(self, stream_id: int, sent: int, now: float) -> None:
        """The queue's requeue, `_enqueue` written out in place, after the same checks:

        entry = self._rank.get(stream_id)
        if entry is None:
            return  # not held: a no-op
        if entry in self._queued or sent < 0 or stream_id in self._parked:
            self._refuse(stream_id, sent)
        """

    def _refuse(self, stream_id: int, sent: int) -> None:
        """Why a requeue of a held stream is refused."""
        if self._rank[stream_id] in self._queued or stream_id in self._parked:
            raise ValueError(f"stream {stream_id} was not popped")
        raise ValueError(f"sent must be >= 0, got {sent}")

    def expired(self, now: float) -> list[int]:
        return []

    def next_deadline(self) -> float | None:
        return None

    def __len__(self) -> int:
        return len(self._rank)

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._rank

    # -- the queue --------------------------------------------------------------------------

    @abstractmethod
    def _enqueue(self, stream_id: int, entry: int) -> None:
        """Queue a held stream that is not queued, under its rank."""

    @abstractmethod
    def _unqueue(self, stream_id: int, entry: int) -> None:
        """Take a queued stream out of the queue."""

    # The generic hooks are not used: the interface above goes straight to the queue.
    def _insert(self, stream_id: int) -> None:
        self._enqueue(stream_id, self._rank[stream_id])

    def _delete(self, stream_id: int) -> None:
        self._unqueue(stream_id, self._rank[stream_id])

    def _pop_next(self, now: float) -> int | None:
        return self.pop(now)


class AbsScheduler(_RankScheduler):
    """Absolute priority: higher `priority` first, first come first served within a level.

    A Python list of packed ranks kept sorted with `bisect.insort`; pop is `list.pop(0)`. Both
    shift the list, O(n): this is the sorted-list baseline of Chuppala (2024), chapter 2, kept to
    measure `pifo` against.
    """

    name = "abs"

    def __init__(self) -> None:
        super().__init__()
        self._queue: list[int] = []  # packed ranks, sorted

    def _enqueue(self, stream_id: int, entry: int) -> None:
        self._queued[entry] = stream_id
        insort(self._queue, entry)

    def pop(self, now: float) -> int | None:
        return self._queued.pop(self._queue.pop(0)) if self._queue else None

    def requeue(self, stream_id: int, sent: int, now: float) -> None:
        entry = self._rank.get(stream_id)
        if entry is None:
            return
        queued = self._queued
        if entry in queued or sent < 0 or stream_id in self._parked:
            self._refuse(stream_id, sent)
        queued[entry] = stream_id
        insort(self._queue, entry)

    def _unqueue(self, stream_id: int, entry: int) -> None:
        del self._queued[entry]
        i = bisect_left(self._queue, entry)
        assert self._queue[i] == entry
        del self._queue[i]


class _RankHeap:
    """The list of packed ranks a `PifoScheduler` keeps in heap order. It is always the same
    list (rebuilt in place), so the scheduler holds it directly too."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[int] = []


class PifoScheduler(_RankScheduler):
    """Absolute priority like `abs` (higher first, FCFS within a level) over a heap.

    A push-in-first-out queue (Sivaraman et al.) ranks each stream on entry and serves only the
    head; in software it is a binary heap of packed ranks (see `_RankScheduler`): O(log n)
    insert and pop.

    Pop and requeue as one heapreplace. `pop` takes the top stream out of the queue but leaves
    its entry at the top of the list, marked taken; the next change to the list settles it. A
    requeue of that stream puts its rank back: unchanged (the usual case: the head filled a
    packet and keeps its place), the entry is simply live again, with no sift at all; changed
    (re-tagged while popped), one `heapreplace` swaps it in. Anything else first pops the taken
    entry off the list, as a plain pop would have. The list holds the same live ranks either
    way, and ranks are unique, so the order served is the same.

    Removing or re-tagging a queued stream only forgets its rank in `_queued` (lazy deletion,
    O(1)); the entry left in the heap is stale and skipped when it reaches the top. A stream
    re-tagged to its own rank leaves a stale copy equal to its live one: either copy serves it,
    and the other is then skipped, so the order is the same. Once stale entries outnumber half
    the heap it is rebuilt from `_queued`, which bounds the memory and keeps pop at O(log n)
    amortised.
    """

    name = "pifo"

    def __init__(self) -> None:
        super().__init__()
        self._heap = _RankHeap()
        self._entries = self._heap._heap
        self._stale = 0  # entries in the list that are neither queued nor taken
        self._taken = False  # the top entry's stream has been popped

    def _enqueue(self, stream_id: int, entry: int) -> None:
        self._queued[entry] = stream_id
        heap = self._entries
        if self._taken:
            self._taken = False
            if heap[0] != entry:
                heapreplace(heap, entry)
        else:
            heappush(heap, entry)

    def requeue(self, stream_id: int, sent: int, now: float) -> None:
        entry = self._rank.get(stream_id)
        if entry is None:
            return
        queued = self._queued
        if entry in queued or sent < 0 or stream_id in self._parked:
            self._refuse(stream_id, sent)
        queued[entry] = stream_id
        heap = self._entries
        if self._taken:
            self._taken = False
            if heap[0] != entry:
                heapreplace(heap, entry)
        else:
            heappush(heap, entry)

    def pop(self, now: float) -> int | None:
        heap, queued = self._entries, self._queued
        if self._taken:
            heappop(heap)
        while heap:
            stream_id = queued.pop(heap[0], None)
            if stream_id is not None:
                self._taken = True
                return stream_id
            heappop(heap)
            self._stale -= 1
        self._taken = False
        return None

    def _unqueue(self, stream_id: int, entry: int) -> None:
        del self._queued[entry]
        self._stale += 1
        heap = self._entries
        if self._stale > len(heap) // 2:
            heap[:] = self._queued
            heapify(heap)
            self._stale = 0
            self._taken = False


class MultiLevelScheduler(Scheduler):
    """Two classes: streams with `spec.high` in EDF order (hard deadlines dropped through
    `expired`, soft ones demoted, as in `edf`) always before the low class, which runs
    round-robin as in `rr`. Low-class deadlines are ignored.

    Interactive requests get the link as soon as they have bytes, while batch requests share
    what is left fairly. A stream re-tagged into the low class joins it at the tail.
    """

    name = "ml"

    def __init__(self) -> None:
        super().__init__()
        self._high = _EdfQueue()
        self._low = _RoundRobinQueue()

    def _insert(self, stream_id: int) -> None:
        spec = self._specs[stream_id]
        if spec.high:
            self._low.forget(stream_id)
            self._high.insert(stream_id, spec, self._seq[stream_id])
        else:
            self._low.insert(stream_id)

    def _delete(self, stream_id: int) -> None:
        self._high.delete(stream_id)
        self._low.delete(stream_id)

    def _pop_next(self, now: float) -> int | None:
        stream_id = self._high.pop(now)
        return stream_id if stream_id is not None else self._low.pop()

    def _requeued(self, stream_id: int, sent: int) -> None:
        if sent > 0 and not self._specs[stream_id].high:
            self._low.rotate(stream_id)

    def _forget(self, stream_id: int) -> None:
        self._low.forget(stream_id)

    def _take_expired(self, now: float) -> list[int]:
        return self._high.take_expired(now)

    def _next_queued_deadline(self) -> float | None:
        return self._high.next_deadline()

    def _drops(self, spec: StreamSpec) -> bool:
        return spec.high and spec.deadline is not None and not spec.soft


SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls
    for cls in (
        FcfsScheduler,
        RoundRobinScheduler,
        EdfScheduler,
        AbsScheduler,
        MultiLevelScheduler,
        PifoScheduler,
    )
}


def make_scheduler(name: str) -> Scheduler:
    """A new scheduler of the named policy. ValueError naming the valid ones otherwise."""
    try:
        cls = SCHEDULERS[name]
    except KeyError:
        raise ValueError(
            f"unknown scheduler {name!r}; valid names: {', '.join(SCHEDULERS)}"
        ) from None
    return cls()
