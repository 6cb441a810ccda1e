"""Several routers over one fleet, in the simulator: what each sees when it knows its own
requests exactly and the others' only from a snapshot refreshed every `interval_s`.

That is the view of front-end workers that share no memory (on several hosts: see
docs/multi-host.md): a worker counts its own requests exactly and hears the others' from the
engines (a `vllm serve`'s /metrics is read every 100 ms). The workers of one host
(`python -m serving --workers N`) share exact counts instead (`serving.shared_view`).

Each arriving request is taken by one router drawn at random, as the kernel spreads
connections over the workers. Every router refreshes at the same interval, each at its own
phase.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from router.sim import Finished, Job, Simulator
from router.view import ClusterView, ReplicaState
from workloads import Request


class StaleSimulator(Simulator):
    """A `Simulator` whose `view()` is the stale view of the router that takes the next
    request; `submit` places that request as that router's own."""

    def __init__(self, *args: Any, routers: int, interval_s: float, seed: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.routers = routers
        self.interval_s = interval_s
        self._rng = random.Random(seed)
        self._router = 0
        self._own: list[dict[int, Job]] = [{} for _ in range(routers)]
        """Each router's jobs in flight, by id(job)."""
        self._owner: dict[int, tuple[int, int]] = {}
        """id(job) -> (router, replica)."""
        self._others: list[list[tuple[int, int]]] = [self._counts(r) for r in range(routers)]
        """Each router's last snapshot of the others' (in flight, owed) at each replica."""
        self._due = [self._rng.uniform(0, interval_s) for _ in range(routers)]
        self.imbalance: list[float] = []
        """At each arrival, the busiest replica's in-flight over the mean (where any is busy)."""

    def _mine(self, router: int) -> list[tuple[int, int]]:
        """The router's own (in flight, owed) at each replica, exactly."""
        self.sync()  # each job's tokens as of now
        mine = [(0, 0)] * len(self.replicas)
        for job in self._own[router].values():
            _, replica = self._owner[id(job)]
            running, owed = mine[replica]
            mine[replica] = (running + 1, owed + job.remaining)
        return mine

    def _counts(self, router: int) -> list[tuple[int, int]]:
        """The others' (in flight, owed) at each replica, as they are now."""
        return [
            (r.batch.in_flight - running, r.batch.owed - owed)
            for r, (running, owed) in zip(self.replicas, self._mine(router), strict=True)
        ]

    def advance(self, until: float) -> list[Finished]:
        """Run to `until`, taking each router's snapshot at its refresh times on the way."""
        finished: list[Finished] = []
        while self.interval_s > 0 and (due := min(self._due)) <= until:
            finished += super().advance(due)
            for router, at in enumerate(self._due):
                if at <= due:
                    self._others[router] = self._counts(router)
                    self._due[router] = at + self.interval_s
        return finished + super().advance(until)

    def _end_iteration(self, index: int) -> list[Finished]:
        """As the simulator's, and the jobs that left the replica leave their router's count."""
        before = list(self._jobs_at(index))
        done = super()._end_iteration(index)
        still = {id(job) for job in self._jobs_at(index)}
        for job in before:
            if id(job) not in still:
                self._release(job)
        return done

    def _jobs_at(self, index: int) -> Iterator[Job]:
        batch = self.replicas[index].batch
        yield from batch.running
        yield from batch.waiting

    def _release(self, job: Job) -> None:
        owner = self._owner.pop(id(job), None)
        if owner is not None:
            del self._own[owner[0]][id(job)]

    def view(self) -> ClusterView:
        """The view of the router that takes the next request (drawn here, once per request)."""
        self._router = router = self._rng.randrange(self.routers)
        others = self._counts(router) if self.interval_s == 0 else self._others[router]
        truth = [r.batch.in_flight for r in self.replicas]
        if any(truth):
            self.imbalance.append(max(truth) / (sum(truth) / len(truth)))
        mine = self._mine(router)
        return ClusterView(
            tuple(
                ReplicaState(r.name, r.model, running + seen, True, owed + seen_owed)
                for r, (running, owed), (seen, seen_owed) in zip(
                    self.replicas, mine, others, strict=True
                )
            )
        )

    def submit(self, request: Request, replica: int) -> None:
        super().submit(request, replica)
        job = next(job for job in self._jobs_at(replica) if job.request is request)
        self._own[self._router][id(job)] = job
        self._owner[id(job)] = (self._router, replica)
