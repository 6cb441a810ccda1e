"""A closed-loop client in the simulator: at most N requests in flight, as `vllm bench serve
--max-concurrency N` (and the live load generator's `--max-concurrency`) keeps them.

A request is ready at its arrival time (a Poisson process at `rate`, as `--request-rate`, or all
at once), and is sent at the first moment after that when fewer than `concurrency` are in flight,
ready requests in the order they became ready. With `ordered`, a conversation's next turn is
ready only when its previous answer has ended (at that moment): its first turn follows the
arrivals. Time to first token counts from the sending, as vLLM's benchmark counts it, so a
request's wait for a free slot on the client is not in it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from router.sim import Finished, Simulator
from router.view import ClusterView
from workloads import Request
from workloads.conversations import first_turns

Route = Callable[[Request, ClusterView], int | None]
"""The replica for a request, given the cluster as it arrives (at the simulator's now); None:
admission control refused it (it ends at once, shed, and a conversation goes on)."""


def run_closed_loop(
    sim: Simulator,
    route: Route,
    requests: Sequence[Request],
    concurrency: int,
    rate: float | None = None,
    seed: int = 0,
    ordered: bool = False,
    progress: Callable[[int], object] | None = None,
    served: Callable[[list[Finished]], object] | None = None,
) -> list[Finished]:
    """Send `requests` through `sim`, routed by `route`, at most `concurrency` at a time; every
    request's end, in the order they ended. Each request's arrival is when it was sent.
    `served` hears every request that ends, as it does (`router.route.Router.served`)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    rng = np.random.default_rng([seed, 7])
    first, later = first_turns(requests, ordered)
    times = np.zeros(len(first)) if not rate else np.cumsum(rng.exponential(1 / rate, len(first)))
    seq = itertools.count()
    ready = [(float(t), next(seq), r) for t, r in zip(times, first, strict=True)]
    heapq.heapify(ready)
    in_flight = 0
    finished: list[Finished] = []
    while ready or in_flight:
        if in_flight < concurrency and ready and ready[0][0] <= sim.now:
            _, _, request = heapq.heappop(ready)
            request = replace(request, arrival=sim.now)
            replica = route(request, sim.view())
            if replica is None:
                finished.append(Finished.shed(request))
                _next_turn(later, request, ready, sim.now, seq)
                continue
            sim.submit(request, replica)
            in_flight += 1
            continue
        due = ready[0][0] if ready and in_flight < concurrency else float("inf")
        event = sim.next_event()
        until = min(due, event if event is not None else float("inf"))
        if until == float("inf"):
            raise RuntimeError("requests in flight, but the simulator has nothing to do")
        done = sim.advance(until)
        in_flight -= len(done)
        finished += done
        if served is not None and done:
            served(done)
        for f in done:
            _next_turn(later, f.request, ready, sim.now, seq)
        if progress is not None and done:
            progress(len(done))
    return finished


def _next_turn(
    later: dict[str, deque[Request]],
    ended: Request,
    ready: list[tuple[float, int, Request]],
    now: float,
    seq: itertools.count[int],
) -> None:
    """`ended`'s session's next turn, if it has one, is ready now."""
    queue = later.get(ended.session_id or "")
    if queue:
        heapq.heappush(ready, (now, next(seq), queue.popleft()))
