"""Stream schedulers, alone: no network, virtual time.

A tiny simulated link drives them the way the QUIC connection does: per packet it pops streams,
lets each write what fits, then gives them all back in pop order with the bytes they sent.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from transport.schedulers import (
    SCHEDULERS,
    PifoScheduler,
    Scheduler,
    StreamSpec,
    make_scheduler,
)

PACKET = 1200  # bytes
RATE = PACKET * 1024  # bytes/s: a packet every 1/1024 s, so virtual times add up exactly
TICK = PACKET / RATE


@dataclass
class Link:
    """One packet of `size` bytes every `size / rate` seconds, filled by the scheduler's streams.

    Per packet: drop what `expired(now)` returns, pop streams until the packet is full (or, with
    `pop_all`, until the scheduler is empty, the late ones getting 0 bytes of room), each writing
    min(room left, its bytes left); advance the clock; requeue the popped streams in pop order
    with what they sent, removing those that finished.
    """

    scheduler: Scheduler
    size: int = PACKET
    rate: float = RATE
    pop_all: bool = False
    now: float = 0.0
    left: dict[int, int] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)
    done: dict[int, float] = field(default_factory=dict)  # id -> completion time
    dropped: dict[int, float] = field(default_factory=dict)  # id -> time expired() returned it
    packets: list[list[tuple[int, int]]] = field(default_factory=list)  # (id, bytes) per packet

    def add(self, stream_id: int, nbytes: int, spec: StreamSpec = StreamSpec()) -> None:  # noqa: B008
        self.scheduler.add(stream_id, spec)
        self.left[stream_id] = nbytes
        self.sent[stream_id] = 0

    def step(self) -> bool:
        """Send one packet; False if no stream had anything to send."""
        for stream_id in self.scheduler.expired(self.now):
            self.dropped[stream_id] = self.now
            del self.left[stream_id]
        room, popped = self.size, []
        while self.pop_all or room > 0:
            stream_id = self.scheduler.pop(self.now)
            if stream_id is None:
                break
            n = min(room, self.left[stream_id])
            room -= n
            self.left[stream_id] -= n
            self.sent[stream_id] += n
            popped.append((stream_id, n))
        if not popped:
            return False
        self.now += self.size / self.rate
        self.packets.append([(s, n) for s, n in popped if n])
        for stream_id, n in popped:
            if self.left[stream_id] == 0:
                self.scheduler.remove(stream_id)
                self.done[stream_id] = self.now
                del self.left[stream_id]
            else:
                self.scheduler.requeue(stream_id, n, self.now)
        return True

    def run(self, packets: int | None = None) -> None:
        """Until every stream is done or dropped, or for `packets` packets."""
        count = 0
        while (packets is None or count < packets) and self.step():
            count += 1

    def finish_order(self) -> list[int]:
        return sorted(self.done, key=lambda s: (self.done[s], s))


def mixed_specs(n: int, seed: int = 0) -> list[StreamSpec]:
    """Specs touching every field: priorities, future deadlines (hard and soft), both classes."""
    rng = random.Random(seed)
    return [
        StreamSpec(
            priority=rng.randint(1, 10),
            deadline=rng.choice([None, rng.uniform(10.0, 20.0), 15.0]),
            high=rng.random() < 0.5,
            soft=rng.random() < 0.5,
        )
        for _ in range(n)
    ]


def pop_all(scheduler: Scheduler, now: float = 0.0) -> list[int]:
    order = []
    while (stream_id := scheduler.pop(now)) is not None:
        order.append(stream_id)
    return order


# -- the interface, every policy ------------------------------------------------------------------

ALL = sorted(SCHEDULERS)


def test_make_scheduler() -> None:
    assert set(SCHEDULERS) == {"fcfs", "rr", "edf", "abs", "ml", "pifo"}
    for name, cls in SCHEDULERS.items():
        scheduler = make_scheduler(name)
        assert type(scheduler) is cls and scheduler.name == name and len(scheduler) == 0


def test_make_scheduler_unknown_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown scheduler 'wfq'") as info:
        make_scheduler("wfq")
    for name in SCHEDULERS:
        assert name in str(info.value)


@pytest.mark.parametrize("name", ALL)
def test_add_duplicate_raises(name: str) -> None:
    scheduler = make_scheduler(name)
    scheduler.add(4)
    with pytest.raises(ValueError, match="already"):
        scheduler.add(4, StreamSpec(priority=3))
    assert scheduler.pop(0.0) == 4
    with pytest.raises(ValueError):  # popped streams are still held
        scheduler.add(4)


@pytest.mark.parametrize("name", ALL)
def test_remove_is_idempotent_and_len_counts_popped(name: str) -> None:
    scheduler = make_scheduler(name)
    scheduler.remove(99)  # never added
    for stream_id in (0, 4, 8):
        scheduler.add(stream_id)
    popped = scheduler.pop(0.0)
    assert popped is not None
    assert len(scheduler) == 3 and popped in scheduler
    scheduler.remove(popped)
    scheduler.remove(popped)
    scheduler.requeue(popped, 100, 0.0)  # removed since it was popped: a no-op
    queued = [s for s in (0, 4, 8) if s != popped]
    scheduler.remove(queued[0])
    scheduler.remove(queued[0])
    assert len(scheduler) == 1 and popped not in scheduler and queued[0] not in scheduler
    assert pop_all(scheduler) == [queued[1]]


@pytest.mark.parametrize("name", ALL)
def test_update_unknown_raises_and_requeue_checks(name: str) -> None:
    scheduler = make_scheduler(name)
    with pytest.raises(KeyError):
        scheduler.update(1, StreamSpec())
    scheduler.add(1)
    with pytest.raises(ValueError, match="not popped"):
        scheduler.requeue(1, 0, 0.0)
    assert scheduler.pop(0.0) == 1
    with pytest.raises(ValueError):
        scheduler.requeue(1, -1, 0.0)


@pytest.mark.parametrize("name", ALL)
def test_pop_then_requeue_all_with_zero_keeps_the_order(name: str) -> None:
    scheduler = make_scheduler(name)
    for stream_id, spec in enumerate(mixed_specs(60)):
        scheduler.add(stream_id * 4, spec)
    order = pop_all(scheduler, 1.0)
    assert sorted(order) == [s * 4 for s in range(60)] and len(scheduler) == 60
    for _ in range(3):
        for stream_id in order:
            scheduler.requeue(stream_id, 0, 1.0)
        assert pop_all(scheduler, 1.0) == order
    # Part of the queue, as when the packet fills up: the same order again.
    for stream_id in order:
        scheduler.requeue(stream_id, 0, 1.0)
    head = [scheduler.pop(1.0) for _ in range(7)]
    for stream_id in head:
        scheduler.requeue(stream_id, 0, 1.0)
    assert pop_all(scheduler, 1.0) == order


@pytest.mark.parametrize("name", ALL)
def test_update_of_a_popped_stream_applies_at_requeue(name: str) -> None:
    scheduler = make_scheduler(name)
    scheduler.add(0, StreamSpec(priority=1))
    scheduler.add(4, StreamSpec(priority=1))
    assert scheduler.pop(0.0) == 0
    scheduler.update(0, StreamSpec(priority=5, high=True, deadline=9.0))
    scheduler.requeue(0, 0, 0.0)
    assert sorted(pop_all(scheduler)) == [0, 4] and len(scheduler) == 2


@pytest.mark.parametrize("name", ALL)
def test_every_stream_finishes_on_the_link(name: str) -> None:
    for pop_everything in (False, True):
        link = Link(make_scheduler(name), pop_all=pop_everything)
        rng = random.Random(1)
        for stream_id, spec in enumerate(mixed_specs(30)):
            link.add(stream_id, rng.randint(1, 9000), spec)
        link.run()
        assert sorted(link.done) == list(range(30)) and not link.dropped
        assert len(link.scheduler) == 0
        # Every packet but the last is full.
        assert all(sum(n for _, n in p) == PACKET for p in link.packets[:-1])


# -- fcfs -----------------------------------------------------------------------------------------


def test_fcfs_finishes_in_arrival_order_and_the_first_fills_the_packet() -> None:
    link = Link(make_scheduler("fcfs"))
    for stream_id in (8, 0, 4):  # arrival order, not id order
        link.add(stream_id, 3000)
    link.run()
    assert link.finish_order() == [8, 0, 4]
    assert link.packets[:4] == [[(8, 1200)], [(8, 1200)], [(8, 600), (0, 600)], [(0, 1200)]]


# -- rr -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pop_everything", [False, True])
def test_rr_shares_the_link_fairly(pop_everything: bool) -> None:
    n, size = 10, 30_000
    link = Link(make_scheduler("rr"), pop_all=pop_everything)
    for stream_id in range(n):
        link.add(stream_id, size)
    while link.left:
        link.step()
        active = [link.sent[s] for s in range(n)]
        assert max(active) - min(active) <= PACKET
    # All finish within one round (n packets) of each other; FCFS would spread them over the
    # whole transfer.
    times = sorted(link.done.values())
    assert times[-1] - times[0] <= n * TICK + 1e-9
    fcfs = Link(make_scheduler("fcfs"))
    for stream_id in range(n):
        fcfs.add(stream_id, size)
    fcfs.run()
    assert max(fcfs.done.values()) - min(fcfs.done.values()) > 5 * n * TICK


def test_rr_is_deterministic() -> None:
    def run() -> list[list[tuple[int, int]]]:
        link = Link(make_scheduler("rr"))
        rng = random.Random(7)
        for stream_id in rng.sample(range(0, 4000, 4), 50):
            link.add(stream_id, rng.randint(500, 20_000))
        link.run()
        return link.packets

    assert run() == run()


def test_rr_stream_that_sent_nothing_keeps_its_place() -> None:
    scheduler = make_scheduler("rr")
    for stream_id in "abcd":
        scheduler.add(ord(stream_id))
    a, b = scheduler.pop(0.0), scheduler.pop(0.0)
    scheduler.requeue(a, 1200, 0.0)  # sent: to the tail
    scheduler.requeue(b, 0, 0.0)  # no room: stays at the head
    assert [chr(s) for s in pop_all(scheduler)] == ["b", "c", "d", "a"]


# -- edf ------------------------------------------------------------------------------------------


def test_edf_orders_by_deadline_then_arrival_then_no_deadline() -> None:
    scheduler = make_scheduler("edf")
    scheduler.add(1, StreamSpec())
    scheduler.add(2, StreamSpec(deadline=5.0))
    scheduler.add(3, StreamSpec(deadline=1.0))
    scheduler.add(4, StreamSpec(deadline=3.0, soft=True))
    scheduler.add(5, StreamSpec())
    scheduler.add(6, StreamSpec(deadline=3.0))
    assert pop_all(scheduler) == [3, 4, 6, 2, 1, 5]

    link = Link(make_scheduler("edf"))
    link.add(0, 5000, StreamSpec(deadline=1.0))
    link.add(1, 5000, StreamSpec(deadline=0.5))
    link.add(2, 5000)
    link.add(3, 5000, StreamSpec(deadline=0.1))
    link.run()
    assert link.finish_order() == [3, 1, 0, 2]


def test_edf_drops_a_stream_past_its_hard_deadline() -> None:
    link = Link(make_scheduler("edf"))
    link.add(0, 12_000, StreamSpec(deadline=5 * TICK))  # needs 10 packets, has 5
    link.add(1, 12_000, StreamSpec(deadline=20 * TICK))
    link.add(2, 12_000, StreamSpec(deadline=40 * TICK))
    link.run()
    assert link.dropped == {0: pytest.approx(5 * TICK)}
    assert link.sent[0] == 5 * PACKET
    assert link.done == {1: pytest.approx(15 * TICK), 2: pytest.approx(25 * TICK)}
    assert all(link.done[s] <= spec for s, spec in ((1, 20 * TICK), (2, 40 * TICK)))


def test_edf_soft_deadline_demotes_but_finishes() -> None:
    link = Link(make_scheduler("edf"))
    link.add(0, 12_000, StreamSpec(deadline=5 * TICK, soft=True))
    link.add(1, 12_000, StreamSpec(deadline=20 * TICK))
    link.add(2, 12_000, StreamSpec(deadline=40 * TICK))
    link.add(3, 1200)  # no deadline: after the late one too
    link.run()
    assert not link.dropped
    assert link.finish_order() == [1, 2, 0, 3]
    assert link.done[0] == pytest.approx(30 * TICK)


def test_edf_pop_never_returns_a_hard_expired_stream() -> None:
    scheduler = make_scheduler("edf")
    scheduler.add(0, StreamSpec(deadline=1.0))
    scheduler.add(1, StreamSpec(deadline=3.0))
    scheduler.add(2, StreamSpec(deadline=0.5))
    assert scheduler.pop(2.0) == 1  # 0 and 2 are past theirs: skipped, kept for expired()
    assert scheduler.pop(2.0) is None
    assert len(scheduler) == 3
    assert scheduler.expired(2.0) == [2, 0]
    assert len(scheduler) == 1 and 0 not in scheduler
    assert scheduler.expired(2.0) == []
    # A popped stream past its deadline is returned too; its requeue is then a no-op.
    assert scheduler.expired(3.0) == [1]
    scheduler.requeue(1, 0, 3.0)
    assert len(scheduler) == 0 and scheduler.pop(3.0) is None


def test_edf_update_can_revive_a_stream() -> None:
    scheduler = make_scheduler("edf")
    scheduler.add(0, StreamSpec(deadline=1.0))
    assert scheduler.pop(2.0) is None
    scheduler.update(0, StreamSpec(deadline=5.0))
    assert scheduler.expired(2.0) == [] and scheduler.pop(2.0) == 0


def test_next_deadline_is_the_next_drop_time() -> None:
    scheduler = make_scheduler("edf")
    assert scheduler.next_deadline() is None
    scheduler.add(0, StreamSpec(deadline=4.0))
    scheduler.add(1, StreamSpec(deadline=1.0, soft=True))  # soft: demoted, never dropped
    scheduler.add(2, StreamSpec(deadline=3.0))
    scheduler.add(3, StreamSpec())
    assert scheduler.next_deadline() == 3.0
    assert scheduler.pop(0.0) == 1 and scheduler.pop(0.0) == 2
    assert scheduler.next_deadline() == 3.0  # popped streams count too
    scheduler.requeue(1, 10, 0.0)
    scheduler.remove(2)
    assert scheduler.next_deadline() == 4.0
    assert scheduler.pop(5.0) == 1  # 0 is past its deadline: still the next drop, due now
    assert scheduler.next_deadline() == 4.0
    assert scheduler.expired(5.0) == [0] and scheduler.next_deadline() is None
    scheduler.update(3, StreamSpec(deadline=9.0))
    assert scheduler.next_deadline() == 9.0

    ml = make_scheduler("ml")
    ml.add(0, StreamSpec(deadline=1.0))  # low class: not dropped
    assert ml.next_deadline() is None
    ml.add(1, StreamSpec(deadline=2.0, high=True))
    assert ml.next_deadline() == 2.0
    ml.update(1, StreamSpec(deadline=2.0))  # moved to the low class
    assert ml.next_deadline() is None


@pytest.mark.parametrize("name", ["fcfs", "rr", "abs", "pifo"])
def test_policies_without_deadlines_never_drop(name: str) -> None:
    scheduler = make_scheduler(name)
    scheduler.add(0, StreamSpec(deadline=1.0, high=True))
    assert scheduler.next_deadline() is None
    assert scheduler.expired(5.0) == [] and scheduler.pop(5.0) == 0


# -- ml -------------------------------------------------------------------------------------------


def test_ml_high_class_beats_the_low_class_which_shares_fairly() -> None:
    link = Link(make_scheduler("ml"))
    for stream_id in range(5):
        link.add(stream_id, 100_000)
    for _ in range(50):
        link.step()
        sent = [link.sent[s] for s in range(5)]
        assert max(sent) - min(sent) <= PACKET
    start = link.now
    link.add(100, 12_000, StreamSpec(high=True, deadline=start + 1.0))
    link.add(101, 12_000, StreamSpec(high=True, deadline=start + 0.5))  # earlier: first
    link.run(20)
    assert link.done == {
        101: pytest.approx(start + 10 * TICK),
        100: pytest.approx(start + 20 * TICK),
    }
    assert [link.sent[s] for s in range(5)] == [10 * PACKET] * 5  # none sent meanwhile
    while link.left:
        link.step()
        sent = [link.sent[s] for s in range(5) if s in link.left]
        if len(sent) == 5:
            assert max(sent) - min(sent) <= PACKET
    assert sorted(link.done) == [0, 1, 2, 3, 4, 100, 101]


def test_ml_high_class_hard_deadline_is_dropped_low_class_deadline_ignored() -> None:
    link = Link(make_scheduler("ml"))
    link.add(0, 12_000, StreamSpec(deadline=TICK))  # low class: its deadline means nothing
    link.add(1, 12_000, StreamSpec(high=True, deadline=5 * TICK))
    link.add(2, 12_000, StreamSpec(high=True, deadline=3 * TICK, soft=True))
    link.run()
    assert link.dropped == {1: pytest.approx(5 * TICK)}
    # 2 first (earliest deadline), demoted at 3 ticks behind 1 (still on time), back when 1 is gone
    assert link.packets[:5] == [[(2, 1200)]] * 3 + [[(1, 1200)]] * 2
    assert link.finish_order() == [2, 0]


def test_ml_retag_moves_between_classes() -> None:
    scheduler = make_scheduler("ml")
    for stream_id in range(4):
        scheduler.add(stream_id)
    scheduler.update(2, StreamSpec(high=True))  # headers arrived: interactive
    assert pop_all(scheduler) == [2, 0, 1, 3]
    for stream_id in (2, 0, 1, 3):
        scheduler.requeue(stream_id, 0, 0.0)
    scheduler.update(2, StreamSpec())  # back to low: joins at the tail
    assert pop_all(scheduler) == [0, 1, 3, 2]


# -- abs and pifo ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["abs", "pifo"])
def test_priority_stream_added_late_finishes_first(name: str) -> None:
    link = Link(make_scheduler(name))
    for stream_id in range(20):
        link.add(stream_id, 100_000, StreamSpec(priority=1 + stream_id % 2))
    link.run(5)
    start = link.now
    link.add(1000, 12_000, StreamSpec(priority=10))
    link.run()
    assert link.finish_order()[0] == 1000
    assert link.done[1000] == pytest.approx(start + 10 * TICK)
    # Level 2 (odd ids) before level 1, arrival order within each level.
    assert link.finish_order()[1:] == list(range(1, 20, 2)) + list(range(0, 20, 2))


def test_pifo_and_abs_pop_the_same_sequence_on_a_random_workload() -> None:
    for seed in range(5):
        rng = random.Random(seed)
        pifo, abs_ = make_scheduler("pifo"), make_scheduler("abs")
        held: list[int] = []
        next_id = 0
        for _ in range(1500):
            op = rng.random()
            if op < 0.3 or not held:
                spec = StreamSpec(priority=rng.randint(1, 10))
                pifo.add(next_id, spec)
                abs_.add(next_id, spec)
                held.append(next_id)
                next_id += 4
            elif op < 0.45:
                stream_id = held.pop(rng.randrange(len(held)))
                pifo.remove(stream_id)
                abs_.remove(stream_id)
            elif op < 0.6:
                stream_id = rng.choice(held)
                spec = StreamSpec(priority=rng.randint(1, 10))
                pifo.update(stream_id, spec)
                abs_.update(stream_id, spec)
            else:  # one packet: pop a few, requeue or finish them
                popped = []
                for _ in range(rng.randint(1, 5)):
                    a, b = pifo.pop(0.0), abs_.pop(0.0)
                    assert a == b
                    if a is None:
                        break
                    popped.append(a)
                if popped and rng.random() < 0.3:  # re-tag one while it is popped
                    stream_id = rng.choice(popped)
                    spec = StreamSpec(priority=rng.randint(1, 10))
                    pifo.update(stream_id, spec)
                    abs_.update(stream_id, spec)
                for stream_id in popped:
                    if rng.random() < 0.2:
                        pifo.remove(stream_id)
                        abs_.remove(stream_id)
                        held.remove(stream_id)
                    else:
                        sent = rng.choice([0, 600, 1200])
                        pifo.requeue(stream_id, sent, 0.0)
                        abs_.requeue(stream_id, sent, 0.0)
            assert len(pifo) == len(abs_) == len(held)
        assert pop_all(pifo) == pop_all(abs_)


def test_pifo_lazy_deletion_is_compacted() -> None:
    scheduler = PifoScheduler()
    for stream_id in range(1000):
        scheduler.add(stream_id, StreamSpec(priority=stream_id % 10))
    for round_ in range(10):
        for stream_id in range(1000):
            scheduler.update(stream_id, StreamSpec(priority=(stream_id + round_) % 10))
        assert len(scheduler._heap._heap) <= 2 * 1000 + 1
    for stream_id in range(0, 1000, 2):
        scheduler.remove(stream_id)
    assert len(scheduler._heap._heap) <= 2 * 500 + 1
    order = pop_all(scheduler)
    assert len(order) == 500 and len(set(order)) == 500


def containers(obj: object, path: str = "") -> dict[str, int]:
    """The size of every dict, set and list the scheduler keeps, by attribute path, through
    its queues (any object of transport.schedulers it holds)."""
    names = getattr(obj, "__slots__", None) or vars(obj)
    sizes: dict[str, int] = {}
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, dict | set | list):
            sizes[f"{path}{name}"] = len(value)
        elif type(value).__module__ == "transport.schedulers":
            sizes |= containers(value, f"{path}{name}.")
    return sizes


@pytest.mark.parametrize("name", ALL)
def test_nothing_is_kept_once_every_stream_has_gone(name: str) -> None:
    # Streams end every way a connection ends them: finished while popped (the usual way),
    # reset while queued or popped, re-tagged between classes while popped, expired queued or
    # popped (edf, ml's high class). A long-lived connection must not keep anything for them.
    rng = random.Random(3)
    link = Link(make_scheduler(name), pop_all=True)
    scheduler = link.scheduler
    for stream_id in range(400):
        spec = StreamSpec(
            priority=rng.randint(1, 10),
            deadline=rng.choice([None, rng.uniform(0.01, 1.0)]),
            high=rng.random() < 0.7,
            soft=rng.random() < 0.3,
        )
        link.add(stream_id, rng.randint(100, 4000), spec)
    for k in range(60):
        stream_id = scheduler.pop(0.0)
        assert stream_id is not None
        if k % 3 == 0:
            scheduler.remove(stream_id)
            del link.left[stream_id]
        else:
            if k % 3 == 1:
                spec = StreamSpec(high=rng.random() < 0.5, deadline=rng.uniform(0.01, 1.0))
                scheduler.update(stream_id, spec)
            scheduler.requeue(stream_id, 0, 0.0)
    for stream_id in rng.sample(sorted(link.left), 20):
        scheduler.remove(stream_id)
        del link.left[stream_id]
    link.run()
    assert not link.left and len(scheduler) == 0
    assert {path: n for path, n in containers(scheduler).items() if n} == {}


class RankModel:
    """abs and pifo's order, written the obvious way: the queued stream of highest priority,
    earliest arrival first, with arrival kept across re-tags."""

    def __init__(self) -> None:
        self.arrival: dict[int, int] = {}
        self.priority: dict[int, int] = {}
        self.queued: set[int] = set()
        self.count = 0

    def add(self, stream_id: int, spec: StreamSpec) -> None:
        self.arrival[stream_id], self.count = self.count, self.count + 1
        self.priority[stream_id] = spec.priority
        self.queued.add(stream_id)

    def pop(self) -> int | None:
        if not self.queued:
            return None
        head = min(self.queued, key=lambda s: (-self.priority[s], self.arrival[s]))
        self.queued.discard(head)
        return head


def test_pifo_and_abs_follow_the_obvious_order_through_every_path() -> None:
    # Every way in and out of the queue, against a model: pops left pending across an add, an
    # update, a remove and the next pop; a head re-tagged while popped, to the same priority or
    # another; requeues with nothing sent; many re-tags, so that pifo's heap is compacted while
    # its top is popped; the error paths, which must leave everything as it was.
    for seed in range(8):
        rng = random.Random(seed)
        model = RankModel()
        schedulers = [make_scheduler("pifo"), make_scheduler("abs")]
        popped: list[int] = []
        next_id = 0
        for _ in range(3000):
            op = rng.random()
            held = sorted(model.arrival)
            if op < 0.2 or not held:
                spec = StreamSpec(priority=rng.randint(-2, 4))
                for s in schedulers:
                    s.add(next_id, spec)
                model.add(next_id, spec)
                next_id += 1
            elif op < 0.45:
                stream_id = model.pop()
                for s in schedulers:
                    assert s.pop(0.0) == stream_id
                if stream_id is not None:
                    popped.append(stream_id)
            elif op < 0.65 and popped:
                stream_id = popped.pop(rng.randrange(len(popped)))
                for s in schedulers:
                    s.requeue(stream_id, rng.choice([0, 1200]), 0.0)
                model.queued.add(stream_id)
            elif op < 0.8:
                stream_id = rng.choice(held)
                priority = rng.choice([model.priority[stream_id], rng.randint(-2, 4)])
                for s in schedulers:
                    s.update(stream_id, StreamSpec(priority=priority))
                model.priority[stream_id] = priority
            elif op < 0.9:
                stream_id = rng.choice(held)
                for s in schedulers:
                    s.remove(stream_id)
                del model.arrival[stream_id], model.priority[stream_id]
                model.queued.discard(stream_id)
                if stream_id in popped:
                    popped.remove(stream_id)
            else:
                stream_id = rng.choice(held)
                for s in schedulers:
                    if stream_id in popped:
                        with pytest.raises(ValueError):
                            s.requeue(stream_id, -1, 0.0)
                    else:
                        with pytest.raises(ValueError):
                            s.requeue(stream_id, 0, 0.0)
                    with pytest.raises(ValueError):
                        s.add(stream_id, StreamSpec())
                    s.requeue(next_id + 1, 0, 0.0)  # not held: a no-op
                    with pytest.raises(KeyError):
                        s.update(next_id + 1, StreamSpec())
            for s in schedulers:
                assert len(s) == len(model.arrival)
                assert all(stream_id in s for stream_id in sorted(model.arrival)[:3])
        for stream_id in popped:
            for s in schedulers:
                s.requeue(stream_id, 0, 0.0)
            model.queued.add(stream_id)
        expected = []
        while (stream_id := model.pop()) is not None:
            expected.append(stream_id)
        for s in schedulers:
            assert pop_all(s) == expected


@pytest.mark.parametrize("name", ALL)
def test_parking_idle_streams_serves_the_same_order_as_skipping_them(name: str) -> None:
    # The connection parks a stream with nothing to send instead of popping it and giving it
    # back with 0 bytes sent in every packet. Against a twin that keeps every stream queued and
    # skips the idle ones, the streams served, packet by packet, and those expired must be the
    # same, through adds, removes, re-tags (parked ones too), deadlines passing while parked and
    # streams running out of bytes after sending.
    for seed in range(6):
        rng = random.Random(seed)
        parking, skipping = make_scheduler(name), make_scheduler(name)
        ready: dict[int, bool] = {}
        next_id, now = 0, 0.0

        def spec(rng: random.Random, now: float) -> StreamSpec:
            return StreamSpec(
                priority=rng.randint(1, 10),
                deadline=rng.choice([None, now + rng.uniform(0.0, 0.5)]),
                high=rng.random() < 0.5,
                soft=rng.random() < 0.5,
            )

        for _ in range(800):
            op = rng.random()
            if op < 0.15 or not ready:
                tag = spec(rng, now)
                parking.add(next_id, tag)
                skipping.add(next_id, tag)
                ready[next_id] = rng.random() < 0.3
                if not ready[next_id]:
                    parking.park(next_id)
                next_id += 4
            elif op < 0.22:
                stream_id = rng.choice(sorted(ready))
                parking.remove(stream_id)
                skipping.remove(stream_id)
                del ready[stream_id]
            elif op < 0.32:
                stream_id = rng.choice(sorted(ready))
                tag = spec(rng, now)
                parking.update(stream_id, tag)
                skipping.update(stream_id, tag)
            elif op < 0.55:
                stream_id = rng.choice(sorted(ready))
                ready[stream_id] = not ready[stream_id]
                (parking.unpark if ready[stream_id] else parking.park)(stream_id)
            else:  # one packet
                now += rng.uniform(0.0, 0.05)
                gone = parking.expired(now)
                assert gone == skipping.expired(now)
                for stream_id in gone:
                    del ready[stream_id]
                room = rng.randint(1, 4)
                served, popped = [], []
                while len(served) < room and (stream_id := skipping.pop(now)) is not None:
                    popped.append(stream_id)
                    if ready[stream_id]:
                        served.append(stream_id)
                assert [parking.pop(now) for _ in served] == served
                if len(served) < room:
                    assert parking.pop(now) is None
                sent = {stream_id: rng.choice([0, 600, 1200]) for stream_id in served}
                for stream_id in popped:
                    skipping.requeue(stream_id, sent.get(stream_id, 0), now)
                for stream_id in served:
                    parking.requeue(stream_id, sent[stream_id], now)
                    if sent[stream_id] and rng.random() < 0.5:  # its last bytes went out
                        ready[stream_id] = False
                        parking.park(stream_id)
            assert len(parking) == len(skipping) == len(ready)
        for stream_id in ready:
            parking.unpark(stream_id)
        assert pop_all(parking, now) == pop_all(skipping, now)
