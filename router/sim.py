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

import copy
import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from config import DEFAULT_MAX_MODEL_LEN, Deployment, Slo
from config.schema import ProfileModel
from router.kv_cache import Hold, KvCache
from router.paths import NetworkTime
from router.view import ClusterView, ReplicaState
from workloads import Request

DEFAULT_PROMPT_TOKENS = 64
"""Assumed for a request whose prompt length is not known in advance."""

QUIET_RUN = 2
"""The fewest quiet iterations (`Batcher.quiet`) the simulator runs as one event."""

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
    """At the client where its path is modelled (`network`), else at the server."""
    outcome: str = OK
    network: NetworkTime | None = None
    """Its time on its client's network path, where the simulation models one."""

    def delivered(self, network: NetworkTime, slo: Slo) -> None:
        """Over its client's path: the SLO is met or missed at the client, from its sending
        to the last token's arrival there."""
        self.network = network
        if self.outcome == OK:
            at_client = network.uplink_s + self.last_token - self.arrival + network.last_s
            self.slo_met = slo.met(at_client, self.output_tokens)

    @classmethod
    def shed(cls, request: Request) -> Finished:
        """A request refused on arrival: it never reached a replica."""
        return cls(request, -1, None, request.arrival, None, request.arrival, 0, False, SHED)


@dataclass(eq=False)  # identity: the batcher finds a job in its lists by who it is
class Job:
    """One request at a replica."""

    request: Request
    arrival: float
    deadline: float
    """No first token by then: the gateway gives up on it (inf: the engine does not know one)."""
    tokens: int
    """Output tokens it will generate (`output_tokens`)."""
    remaining: int
    first_token: float | None = None
    prefill: int = 0
    """Prompt tokens still to compute before its first token (with a KV cache: a request
    admitted in chunks, or preempted, waits on them)."""
    hold: Hold | None = None
    """Its KV blocks, while it holds any."""
    cached_tokens: int = 0
    """Prompt tokens it found cached when last admitted."""
    preempted: bool = False

    def fork(self) -> Job:
        """A copy to run on in another simulator (`Simulator.fork`)."""
        job = copy.copy(self)
        if self.hold is not None:
            job.hold = Hold(list(self.hold.hashes), self.hold.private)
        return job


def max_output_tokens(request: Request, context: int) -> int:
    """The output a request may get: its max_tokens, or, where it sets none, the deployment's
    default, which is vLLM's: all the context its prompt leaves; at least one token."""
    if request.max_tokens is not None:
        return max(1, request.max_tokens)
    return max(1, context - (request.prompt_tokens or DEFAULT_PROMPT_TOKENS))


def output_tokens(request: Request, max_model_len: int) -> int:
    """What an engine generates for `request`: its answer (where the workload knows where it
    ends), cut at `max_output_tokens`; at least one token."""
    most = max_output_tokens(request, max_model_len)
    return most if request.answer_tokens is None else max(1, min(most, request.answer_tokens))


def step_time(profile: ProfileModel, batch: int) -> float:
    """Decode step time at `batch`, linear between the profiled sizes and flat beyond them."""
    sizes = sorted(profile.step_s)
    return float(np.interp(batch, sizes, [profile.step_s[b] for b in sizes]))


class Batcher:
    """One replica's continuous batching, without a clock: the rules that the simulator runs in
    virtual time and the simulated engine (`serving.engines.simulated`) in real time, so that
    there is one model of a GPU, not two.

    An iteration (`begin`) admits every waiting request up to `max_batch` and costs the decode
    step of the batch it runs plus the prefill of the prompts it admitted; its end (`end`) gives
    every request in the batch one token.

    With a KV cache (`kv`), admission also follows vLLM's scheduler: a request is admitted only
    when its prompt's blocks fit (first come, first served: one that does not fit holds back
    those behind it), it computes only the prompt tokens it did not find cached, and a running
    request whose output needs a block where none is free preempts the most recently admitted
    one, which gives back its blocks and waits again at the head of the queue, to recompute its
    prompt and output when readmitted. With `max_batched_tokens`, an iteration computes at most
    that many tokens, one per decoding request first, then prompt chunks in turn (vLLM's chunked
    prefill); a request's first token comes with the iteration that computes its prompt's last
    chunk."""

    def __init__(
        self,
        profile: ProfileModel,
        max_batch: int,
        default_prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
        steps: list[float] | None = None,
        kv: KvCache | None = None,
        max_batched_tokens: int | None = None,
        hash_stride: int = 1,
    ) -> None:
        """`steps`: step_time(profile, b) for b = 0..max_batch, where the caller shares one table
        among the replicas of a model; the hot path indexes instead of interpolating.
        `hash_stride`: how many of a request's block hashes (`Request.blocks`) make one of the
        cache's blocks, where its blocks are larger than those the hashes were cut at."""
        self.profile = profile
        self.max_batch = max_batch
        self.default_prompt_tokens = default_prompt_tokens
        self.steps = steps or [step_time(profile, b) for b in range(max_batch + 1)]
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.hash_stride = hash_stride
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.owed = 0
        """Output tokens still owed to the requests in flight (what the gateway counts live)."""
        self.prompt_tokens = 0
        """Prompt tokens of the requests admitted, not counting readmissions after preemption
        (vLLM's prefix cache queries)."""
        self.hit_tokens = 0
        """Of those, the ones found cached (vLLM's prefix cache hits)."""
        self.preemptions = 0

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def fork(self) -> Batcher:
        """A copy that goes on apart: its own jobs and KV cache, which tells no one."""
        batch = copy.copy(self)
        batch.waiting = [job.fork() for job in self.waiting]
        batch.running = [job.fork() for job in self.running]
        batch.kv = self.kv.fork() if self.kv is not None else None
        return batch

    def add(self, job: Job) -> None:
        job.prefill = self._prompt(job)
        self.waiting.append(job)
        self.owed += job.remaining

    def remove(self, job: Job) -> None:
        """`job` leaves before its last token (aborted)."""
        if job in self.running:
            self.running.remove(job)
        else:
            self.waiting.remove(job)
        self._release(job)
        self.owed -= job.remaining

    def _prompt(self, job: Job) -> int:
        tokens = job.request.prompt_tokens
        return self.default_prompt_tokens if tokens is None else tokens

    def _release(self, job: Job) -> None:
        if job.hold is not None and self.kv is not None:
            self.kv.release(job.hold)
            job.hold = None

    def begin(self) -> float | None:
        """Start an iteration: admit what fits; its cost alone on its device (None: no work)."""
        if self.kv is not None or self.max_batched_tokens is not None:
            return self._begin_paged()
        admitted = self.waiting[: max(0, self.max_batch - len(self.running))]
        del self.waiting[: len(admitted)]
        self.running += admitted
        if not self.running:
            return None
        prefill = 0
        for job in admitted:
            prefill += job.prefill
            self.prompt_tokens += job.prefill
            job.prefill = 0
        return self.steps[len(self.running)] + prefill * self.profile.prefill_s_per_token

    def _begin_paged(self) -> float | None:
        budget = self.max_batched_tokens or math.inf
        computed = 0
        i = 0
        while i < len(self.running):  # `_grow` may preempt from the end, this one included
            job = self.running[i]
            if job.prefill == 0:
                budget -= 1
                if self.kv is not None:
                    self._grow(job)
            i += 1
        for job in self.running:  # chunks of prompts admitted earlier
            if job.prefill > 0 and budget > 0:
                chunk = int(min(budget, job.prefill))
                job.prefill -= chunk
                budget -= chunk
                computed += chunk
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            job = self.waiting[0]
            if self.kv is not None and not self._admit(job):
                break
            self.waiting.pop(0)
            self.running.append(job)
            chunk = int(min(budget, job.prefill))
            job.prefill -= chunk
            budget -= chunk
            computed += chunk
        if not self.running:
            return None
        return self.steps[len(self.running)] + computed * self.profile.prefill_s_per_token

    def quiet(self) -> int:
        """How many iterations in a row, from the next, would only give each running request a
        token: nothing waits to be admitted or preempted, every prompt is computed, no request
        ends or reaches its deadline, and (with a KV cache) the blocks their growing output
        needs are free or idle, so that none is preempted. 0: the next may do more."""
        if self.waiting or not self.running:
            return 0
        least = self.running[0].remaining
        for job in self.running:
            if job.prefill or job.first_token is None:
                return 0
            if job.remaining < least:
                least = job.remaining
        quiet = least - 1  # the iteration that ends a request is not quiet
        if self.kv is not None:
            while quiet > 1 and self._blocks_for(quiet) > self.kv.free + self.kv.idle:
                quiet //= 2
        return quiet

    def _blocks_for(self, iterations: int) -> int:
        """The blocks `iterations` quiet iterations add to the running requests' holds."""
        kv = self.kv
        assert kv is not None
        size, blocks = kv.block_size, 0
        for job in self.running:
            hold = job.hold
            assert hold is not None
            # The context its last iteration reads: what it has and what comes before.
            context = self._prompt(job) + job.tokens - job.remaining + iterations - 1
            blocks += max(0, -(-context // size) - len(hold.hashes) - hold.private)
        return blocks

    def decode(self, iterations: int) -> None:
        """`iterations` quiet iterations (`quiet`) ended: each running request got as many
        tokens, and its KV blocks grew with them, as those iterations one by one would have."""
        if iterations <= 0:
            return
        kv = self.kv
        for job in self.running:
            if kv is not None:
                hold = job.hold
                assert hold is not None
                context = self._prompt(job) + job.tokens - job.remaining + iterations - 1
                for _ in range(-(-context // kv.block_size) - len(hold.hashes) - hold.private):
                    kv.extend(hold)  # there is room: `quiet` counted it
            job.remaining -= iterations
        self.owed -= iterations * len(self.running)

    def grow_running(self) -> None:
        """The blocks the iteration in progress reads, where it is quiet: its start grew each
        running request's hold (idempotent: a hold already that large is left alone)."""
        if self.kv is not None:
            for job in self.running:
                self._grow(job)

    def _admit(self, job: Job) -> bool:
        """Hold `job`'s blocks if they fit, and take its cached prefix off its prefill."""
        kv = self.kv
        assert kv is not None
        size = kv.block_size
        context = job.prefill  # its prompt, and what it had generated if it was preempted
        hashes = job.request.blocks or ()
        if self.hash_stride > 1:
            hashes = hashes[self.hash_stride - 1 :: self.hash_stride]
        # vLLM computes at least a prompt's last token, whatever is cached (for its logits).
        got = kv.hold(hashes, -(-context // size), (context - 1) // size)
        if got is None:
            return False
        job.hold, hit = got
        job.cached_tokens = hit * size
        job.prefill = context - job.cached_tokens
        if not job.preempted:  # vLLM counts a readmitted request's lookups apart
            self.prompt_tokens += context
            self.hit_tokens += job.cached_tokens
        return True

    def _grow(self, job: Job) -> None:
        """A block for `job`'s next token where it needs one, preempting the most recently
        admitted requests (perhaps itself) until one is free."""
        kv = self.kv
        assert kv is not None and job.hold is not None
        context = self._prompt(job) + job.tokens - job.remaining  # the KV its next step reads
        if -(-context // kv.block_size) <= len(job.hold.hashes) + job.hold.private:
            return
        while not kv.extend(job.hold):
            victim = self.running.pop()
            self._release(victim)
            victim.prefill = self._prompt(victim) + victim.tokens - victim.remaining
            victim.preempted = True
            self.waiting.insert(0, victim)
            self.preemptions += 1
            if victim is job:
                return

    def end(self, now: float) -> list[tuple[Job, str]]:
        """End the iteration at `now`: a token for every request in the batch whose prompt is
        computed. Returns the requests that ended, with how: their last token (OK) or their
        deadline (DEADLINE: one the deadline overtook while it was prefilled, whose token never
        counts, and those that waited out their deadlines in the queue)."""
        ended: list[tuple[Job, str]] = []
        still: list[Job] = []
        for job in self.running:
            if job.first_token is None and job.deadline < now:
                self.owed -= job.remaining  # aborted before this token
                self._release(job)
                ended.append((job, DEADLINE))
                continue
            if job.prefill > 0:  # a chunk of its prompt: no token yet
                still.append(job)
                continue
            job.remaining -= 1
            self.owed -= 1
            if job.first_token is None:
                job.first_token = now
            if job.remaining > 0:
                still.append(job)
            else:
                self._release(job)
                ended.append((job, OK))
        self.running = still
        late = [j for j in self.waiting if j.deadline <= now]
        if late:
            self.waiting = [j for j in self.waiting if j.deadline > now]
            for job in late:
                self.owed -= job.remaining
                ended.append((job, DEADLINE))
        return ended


class Devices:
    """Replicas on one device slow each other: an iteration that starts while k other replicas
    of its device are busy takes (1 + interference x k) times as long."""

    def __init__(self, interference: float) -> None:
        self.interference = interference
        self._busy: dict[str, int] = {}

    def start(self, device: str) -> float:
        """An iteration starts on `device`: its slowdown, fixed for its whole length."""
        others = self._busy.get(device, 0)
        self._busy[device] = others + 1
        return 1.0 + self.interference * others

    def stop(self, device: str) -> None:
        self._busy[device] -= 1

    def fork(self) -> Devices:
        devices = Devices(self.interference)
        devices._busy = dict(self._busy)
        return devices


@dataclass
class _Replica:
    name: str
    model: str
    device: str
    batch: Batcher
    busy_until: float | None = None
    """End of the iteration in progress (of the quiet run in progress); None while idle."""
    quiet: tuple[float, float, int] | None = None
    """While it runs quiet iterations (`Batcher.quiet`) in one go: when the first began, how
    long each takes, and how many there are."""
    decoded: int = 0
    """Of those, how many its batch has been given (`Batcher.decode`)."""
    epoch: int = 0
    """Moves on when its next event does: an older one left in the queue is void."""


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
        kv: Sequence[tuple[int, int] | None] | None = None,
        max_batched_tokens: int | None = None,
        on_kv_event: Callable[[int, str, list[int]], None] | None = None,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    ) -> None:
        """`replicas`: (name, model, device) each; `profiles`: model -> its latency profile;
        `deadlines`: QoS class -> first-token deadline in seconds (a class not named has none);
        `kv`: per replica, its KV cache as (tokens, block size), or None for none (the default
        for all); `max_batched_tokens`: vLLM's token budget per iteration (None: no limit);
        `on_kv_event(replica, kind, hashes)` hears the caches' stored and removed blocks;
        `max_model_len`: the context, all of which a request without max_tokens may take."""
        missing = sorted({m for _, m, _ in replicas} - set(profiles))
        if missing:
            raise ValueError(f"no latency profile for model(s): {', '.join(missing)}")
        tables = {m: [step_time(p, b) for b in range(max_batch + 1)] for m, p in profiles.items()}
        kv = list(kv) if kv is not None else [None] * len(replicas)
        self.hash_block = min((size for _, size in filter(None, kv)), default=16)
        """The block size `Request.blocks` are cut at: the smallest cache's."""
        self.replicas = []
        for index, ((n, m, d), cache) in enumerate(zip(replicas, kv, strict=True)):
            batch = Batcher(
                profiles[m], max_batch, default_prompt_tokens, tables[m],
                max_batched_tokens=max_batched_tokens,
            )  # fmt: skip
            if cache is not None:
                tokens, size = cache
                if size % self.hash_block:
                    raise ValueError(f"{n}: KV blocks of {size} tokens, not a multiple of "
                                     f"{self.hash_block}")  # fmt: skip
                tell = None
                if on_kv_event is not None:
                    tell = functools.partial(on_kv_event, index)
                batch.kv = KvCache(tokens // size, size, tell)
                batch.hash_stride = size // self.hash_block
            self.replicas.append(_Replica(n, m, d, batch))
        self.devices = Devices(interference)
        self.slo = slo
        self.max_model_len = max_model_len
        self.deadlines = deadlines or {}
        self.now = 0.0
        self.on_tokens: Callable[[list[Job]], None] | None = None
        """Told, at the end of every iteration, which requests it gave a token (their
        `remaining` says whether it was the last): for a co-simulation that sends each token as
        it is made. None, the default, costs the simulator nothing."""
        self._events: list[tuple[float, int, int, int]] = []  # (time, seq, replica, epoch)
        self._pushed = 0
        """Events pushed so far: the tie-break of events at the same time, first come first."""
        self._quiet: set[int] = set()
        """The replicas in a quiet run."""
        self._hears_kv = on_kv_event is not None
        devices = [r.device for r in self.replicas]
        self._neighbours = [
            [j for j, other in enumerate(devices) if other == d and j != i]
            for i, d in enumerate(devices)
        ]

    @classmethod
    def from_deployment(cls, deployment: Deployment, **kwargs: Any) -> Simulator:
        if deployment.profile is None:
            raise ValueError(f"deployment {deployment.name!r} names no latency profile")
        replicas = [(r.name, r.model, r.device or r.name) for r in deployment.replicas]
        kwargs.setdefault("interference", deployment.profile.interference)
        kwargs.setdefault("deadlines", {n: c.deadline_s for n, c in deployment.qos_classes.items()})
        if deployment.max_batch is not None:  # vLLM's cap on a batch, where the deployment sets one
            kwargs.setdefault("max_batch", deployment.max_batch)
        kwargs.setdefault(
            "kv",
            [(r.kv_tokens, r.block_size) if r.kv_tokens else None for r in deployment.replicas],
        )
        budget = deployment.engine_arg("max_num_batched_tokens")
        if budget is not None:
            kwargs.setdefault("max_batched_tokens", budget)
        kwargs.setdefault("max_model_len", deployment.max_model_len)
        return cls(replicas, deployment.profile.models, deployment.slo, **kwargs)

    def fork(self) -> Simulator:
        """A copy of the simulator as it is now, which goes on apart: to try what a decision
        would lead to (`router.hindsight`). It tells no one of its tokens or KV blocks."""
        sim = copy.copy(self)
        sim.replicas = [
            _Replica(
                r.name, r.model, r.device, r.batch.fork(), r.busy_until, r.quiet, r.decoded, r.epoch
            )  # fmt: skip
            for r in self.replicas
        ]
        sim.devices = self.devices.fork()
        sim.on_tokens = None
        sim._events = list(self._events)
        sim._quiet = set(self._quiet)
        sim._hears_kv = False
        return sim

    def view(self) -> ClusterView:
        return ClusterView(
            tuple(
                ReplicaState(r.name, r.model, r.batch.in_flight, True, self._owed(r))
                for r in self.replicas
            )
        )

    def _owed(self, r: _Replica) -> int:
        """Output tokens still owed at `r` now, counting the tokens of a quiet run's iterations
        ended by now that its batch has not been given yet (`sync`)."""
        if r.quiet is None:
            return r.batch.owed
        return r.batch.owed - (self._ended(r) - r.decoded) * len(r.batch.running)

    def _ended(self, r: _Replica) -> int:
        """How many of `r`'s quiet iterations have ended by now."""
        assert r.quiet is not None
        start, step, count = r.quiet
        return min(count, int((self.now - start) / step))

    def submit(self, request: Request, replica: int) -> None:
        """Queue `request` at `replica` at the current time (its arrival, for the SLO)."""
        r = self.replicas[replica]
        tokens = output_tokens(request, self.max_model_len)
        deadline = self.now + self.deadlines.get(request.qos_class, float("inf"))
        r.batch.add(Job(request, self.now, deadline, tokens, tokens))
        if r.busy_until is None:
            self._start_iteration(replica)
            self._busy_changed(replica)
        elif r.quiet is not None:  # it joins the batch when the iteration in progress ends
            self._cut(replica)

    def advance(self, until: float) -> list[Finished]:
        """Run every iteration that ends by `until`; return the requests that ended."""
        finished: list[Finished] = []
        events, replicas = self._events, self.replicas
        while events and events[0][0] <= until:
            at, _, index, epoch = heapq.heappop(events)
            if epoch != replicas[index].epoch:
                continue
            self.now = at
            finished += self._end_iteration(index)
        self.now = max(self.now, until)
        if self._hears_kv:  # the KV blocks the iterations in progress took, as they took them
            self.sync()
        return finished

    def sync(self) -> None:
        """Give every replica in a quiet run what its iterations gave by now: the tokens of those
        that ended, the KV blocks of the one in progress. Until then `view` counts the tokens,
        and nothing but a listener of the caches' events sees the blocks."""
        for index in self._quiet:
            r = self.replicas[index]
            ended = self._ended(r)
            r.batch.decode(ended - r.decoded)
            r.decoded = ended
            r.batch.grow_running()

    def next_event(self) -> float | None:
        """When the next iteration ends (None: every replica is idle)."""
        events = self._events
        while events and events[0][3] != self.replicas[events[0][2]].epoch:
            heapq.heappop(events)
        return events[0][0] if events else None

    def drain(self) -> list[Finished]:
        """Run until every submitted request has ended."""
        finished: list[Finished] = []
        while (at := self.next_event()) is not None:
            finished += self.advance(at)
        return finished

    # Quiet runs: where a replica's next iterations would only give each running request a
    # token (`Batcher.quiet`), they are one event instead of one each, so that a request alone
    # on a replica costs a few events instead of one per token. They are the same iterations,
    # each as long as the first (its batch and its device's busy neighbours are the same); the
    # k-th ends at start + k x step, where one by one they would sum to within a few ulps of
    # it. What would change them cuts the run at
    # the end of the iteration in progress, where the batcher takes over again: a request
    # submitted to the replica, or a neighbour on its device going busy or idle. What anyone
    # reads between events is as the iterations left it: `view` counts the tokens of those
    # ended, `sync` gives them to the batch.

    def _start_iteration(self, index: int) -> bool:
        """Start `index`'s next iteration, or quiet run; False: it has no work (idle)."""
        r = self.replicas[index]
        if self.on_tokens is None and (quiet := r.batch.quiet()) >= QUIET_RUN:
            step = r.batch.steps[len(r.batch.running)] * self.devices.start(r.device)
            at = self.now + quiet * step
            r.quiet, r.decoded, r.busy_until = (self.now, step, quiet), 0, at
            self._quiet.add(index)
            self._push(at, index)
            return True
        cost = r.batch.begin()
        if cost is None:
            return False
        r.busy_until = self.now + cost * self.devices.start(r.device)
        self._push(r.busy_until, index)
        return True

    def _push(self, at: float, index: int) -> None:
        self._pushed += 1
        heapq.heappush(self._events, (at, self._pushed, index, self.replicas[index].epoch))

    def _cut(self, index: int) -> None:
        """End `index`'s quiet run with the iteration in progress."""
        r = self.replicas[index]
        assert r.quiet is not None
        start, step, count = r.quiet
        through = self._ended(r) + 1  # those ended by now, and the one in progress
        if through >= count:
            return
        r.quiet = (start, step, through)
        r.busy_until = start + through * step
        r.epoch += 1
        self._push(r.busy_until, index)

    def _busy_changed(self, index: int) -> None:
        """`index` went busy or idle: its neighbours' next iterations run at another speed."""
        for j in self._neighbours[index]:
            if self.replicas[j].quiet is not None:
                self._cut(j)

    def _end_iteration(self, index: int) -> list[Finished]:
        r = self.replicas[index]
        if r.quiet is not None:  # a quiet run ended: none of its requests did
            r.batch.decode(r.quiet[2] - r.decoded)
            r.quiet, r.decoded = None, 0
            self._quiet.discard(index)
            self.devices.stop(r.device)
            self._start_iteration(index)
            return []
        served = list(r.batch.running) if self.on_tokens is not None else []
        ended = r.batch.end(self.now)
        if self.on_tokens is not None:
            aborted = {id(job) for job, outcome in ended if outcome == DEADLINE}
            self.on_tokens([job for job in served if id(job) not in aborted])
        done = [self._end(index, job, outcome) for job, outcome in ended]
        r.busy_until = None
        self.devices.stop(r.device)
        if not self._start_iteration(index):
            self._busy_changed(index)
        return done

    def _end(self, index: int, job: Job, outcome: str) -> Finished:
        """`job` left replica `index`: its last token (OK) or its deadline."""
        r = self.replicas[index]
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
