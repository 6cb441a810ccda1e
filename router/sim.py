"""A discrete-event model of the deployment's replicas under continuous batching, in virtual time.

Each replica runs iterations back to back while it has work. An iteration admits every waiting
request (up to `max_batch`), then costs the profile's decode step for the batch it runs plus the
prefill of the prompts it admitted, and gives every request in the batch one token: an admitted
request's first token comes at the end of the iteration that prefilled it, as in vLLM.

Replicas on one device slow each other: an iteration that starts while k other replicas of the
same device are busy takes (1 + interference × k) times as long. That is the whole co-location
model, explicit and tunable; on a CPU deployment every replica shares the one "cpu" device.

The SLO test is models.yaml's (`Slo.met`): arrival to last token, per output token.

The gateway's first-token deadline is modelled as it runs live: a request with no token by its
class's deadline ends there (outcome "deadline", a 504 live) and leaves its replica, which frees
its slot as the gateway's abort does. A request waiting in the queue leaves at the next iteration
boundary after its deadline; one that the deadline overtakes while it is prefilled ends with that
iteration (the gateway aborts it, so its token never counts).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from config import Deployment, Slo
from config.schema import ProfileModel
from router.view import ClusterView, ReplicaState
from workloads import Request

DEFAULT_PROMPT_TOKENS = 64
"""Assumed for a request whose prompt length is not known in advance."""

OK, DEADLINE, SHED = "ok", "deadline", "shed"
"""How a request ended: its last token, its first-token deadline (504), or refused at the door
(429, `router.admission`). The gateway's outcomes of the same names."""


@dataclass
class Finished:
    """One request's life in the simulator."""

    request: Request
    replica: int
    """-1 for a request that was shed."""
    model: str | None
    arrival: float
    first_token: float | None
    """None unless the request got a token."""
    last_token: float
    """When it ended, however it did."""
    output_tokens: int
    slo_met: bool
    outcome: str = OK

    @classmethod
    def shed(cls, request: Request) -> Finished:
        """A request refused on arrival: it never reached a replica."""
        return cls(request, -1, None, request.arrival, None, request.arrival, 0, False, SHED)


@dataclass
class _Job:
    request: Request
    arrival: float
    deadline: float
    """No first token by then: the gateway gives up on it."""
    tokens: int
    """Output tokens it will get: its max_tokens, at least 1."""
    remaining: int
    first_token: float | None = None


@dataclass
class _Replica:
    name: str
    model: str
    device: str
    profile: ProfileModel
    waiting: list[_Job] = field(default_factory=list)
    running: list[_Job] = field(default_factory=list)
    busy_until: float | None = None
    """End of the iteration in progress; None while idle."""
    steps: list[float] = field(default_factory=list)
    """step_time(profile, b) for b = 0..max_batch: the hot path indexes instead of interpolating."""
    owed: int = 0
    """Output tokens still owed to the requests in flight (what the gateway counts live)."""

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)


def step_time(profile: ProfileModel, batch: int) -> float:
    """Decode step time at `batch`, linear between the profiled sizes and flat beyond them."""
    sizes = sorted(profile.step_s)
    return float(np.interp(batch, sizes, [profile.step_s[b] for b in sizes]))


class Simulator:
    """Replicas of a deployment, fed by `submit` and moved forward by `advance`."""

    def __init__(
        self,
        replicas: Sequence[tuple[str, str, str]],
        profiles: dict[str, ProfileModel],
        slo: Slo,
        max_batch: int = 256,
        interference: float = 0.0,
        default_prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
        deadlines: dict[str, float] | None = None,
    ) -> None:
        """`replicas`: (name, model, device) each; `profiles`: model -> its latency profile;
        `deadlines`: QoS class -> first-token deadline in seconds (a class not named has none)."""
        missing = sorted({m for _, m, _ in replicas} - set(profiles))
        if missing:
            raise ValueError(f"no latency profile for model(s): {', '.join(missing)}")
        tables = {m: [step_time(p, b) for b in range(max_batch + 1)] for m, p in profiles.items()}
        self.replicas = [_Replica(n, m, d, profiles[m], steps=tables[m]) for n, m, d in replicas]
        self._busy = dict.fromkeys((r.device for r in self.replicas), 0)
        """Busy replicas per device."""
        self.slo = slo
        self.max_batch = max_batch
        self.interference = interference
        self.default_prompt_tokens = default_prompt_tokens
        self.deadlines = deadlines or {}
        self.now = 0.0
        self._events: list[tuple[float, int, int]] = []  # (time, seq, replica index)
        self._seq = itertools.count()

    @classmethod
    def from_deployment(cls, deployment: Deployment, **kwargs: object) -> Simulator:
        if deployment.profile is None:
            raise ValueError(f"deployment {deployment.name!r} names no latency profile")
        replicas = [(r.name, r.model, r.device or r.name) for r in deployment.replicas]
        kwargs.setdefault("interference", deployment.profile.interference)
        kwargs.setdefault("deadlines", {n: c.deadline_s for n, c in deployment.qos_classes.items()})
        if deployment.max_batch is not None:  # vLLM's cap on a batch, where the deployment sets one
            kwargs.setdefault("max_batch", deployment.max_batch)
        return cls(replicas, deployment.profile.models, deployment.slo, **kwargs)  # type: ignore[arg-type]

    def view(self) -> ClusterView:
        return ClusterView(
            tuple(ReplicaState(r.name, r.model, r.in_flight, True, r.owed) for r in self.replicas)
        )

    def submit(self, request: Request, replica: int) -> None:
        """Queue `request` at `replica` at the current time (its arrival, for the SLO)."""
        r = self.replicas[replica]
        tokens = max(1, request.max_tokens or 1)
        deadline = self.now + self.deadlines.get(request.qos_class, float("inf"))
        r.waiting.append(_Job(request, self.now, deadline, tokens, tokens))
        r.owed += tokens
        if r.busy_until is None:
            self._start_iteration(replica)

    def advance(self, until: float) -> list[Finished]:
        """Run every iteration that ends by `until`; return the requests that ended."""
        finished: list[Finished] = []
        while self._events and self._events[0][0] <= until:
            at, _, index = heapq.heappop(self._events)
            self.now = at
            finished += self._end_iteration(index)
        self.now = max(self.now, until)
        return finished

    def drain(self) -> list[Finished]:
        """Run until every submitted request has ended."""
        finished: list[Finished] = []
        while self._events:
            finished += self.advance(self._events[0][0])
        return finished

    def _start_iteration(self, index: int) -> None:
        r = self.replicas[index]
        admitted = r.waiting[: max(0, self.max_batch - len(r.running))]
        del r.waiting[: len(admitted)]
        r.running += admitted
        if not r.running:
            return
        prefill = sum(
            self.default_prompt_tokens
            if j.request.prompt_tokens is None
            else j.request.prompt_tokens
            for j in admitted
        )
        cost = r.steps[len(r.running)] + prefill * r.profile.prefill_s_per_token
        others = self._busy[r.device]  # this replica is idle here, so not among them
        r.busy_until = self.now + cost * (1.0 + self.interference * others)
        self._busy[r.device] += 1
        heapq.heappush(self._events, (r.busy_until, next(self._seq), index))

    def _end_iteration(self, index: int) -> list[Finished]:
        r = self.replicas[index]
        done: list[Finished] = []
        still: list[_Job] = []
        for job in r.running:
            if job.first_token is None and job.deadline < self.now:
                done.append(self._end(index, job, DEADLINE))  # aborted before this token
                continue
            job.remaining -= 1
            r.owed -= 1
            if job.first_token is None:
                job.first_token = self.now
            if job.remaining > 0:
                still.append(job)
            else:
                done.append(self._end(index, job, OK))
        r.running = still
        late = [j for j in r.waiting if j.deadline <= self.now]
        if late:  # the gateway's 504 for what waited out its deadline in the queue
            done += [self._end(index, j, DEADLINE) for j in late]
            r.waiting = [j for j in r.waiting if j.deadline > self.now]
        r.busy_until = None
        self._busy[r.device] -= 1
        self._start_iteration(index)
        return done

    def _end(self, index: int, job: _Job, outcome: str) -> Finished:
        """`job` leaves replica `index`: its last token (OK) or its deadline."""
        r = self.replicas[index]
        r.owed -= job.remaining
        ok = outcome == OK
        return Finished(
            job.request,
            index,
            r.model,
            job.arrival,
            job.first_token,
            self.now,
            job.tokens if ok else 0,
            ok and self.slo.met(self.now - job.arrival, job.tokens),
            outcome,
        )
