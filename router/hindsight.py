"""Routing in hindsight: what each decision leads to, tried in the simulator on the true future.

A workload run in the simulator is fixed in advance: every arrival, and where every answer ends.
A router sees only the present; here the future is known, and a decision can be tried: fork
the episode (`RoutingEnv.fork`), send the request to a replica, let a base policy route what
comes after, run it all to its end, and add up the rewards (`action_values`). The same future
for every action, so that what tells them apart is the action alone.

Two things are built on it:
- `clairvoyant`: a schedule the simulator runs, which picks each decision by what it leads to
  (rollout, Bertsekas' name for it), under several heuristic bases; then the best of it and
  each base's own schedule. It knows more than any online router; the experiments report it in
  every cell as the reward a router could reach, next to the bound no schedule can pass
  (`router.bound`).
- the training of the learned router (`router.train`), which learns, from decisions sampled
  on training workloads, the value each action has under a base policy: a step of policy
  iteration, with each action's value measured on the future that came.

The actions are the models, each sent to its least-loaded replica that admission control
allows (`choices`): a model none of whose replicas is allowed is masked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from config import Deployment
from router.env import RoutingEnv
from router.policies import Policy
from router.sim import Finished, output_tokens
from router.view import ClusterView
from workloads import Request
from workloads.generate import WorkloadSpec


def choices(view: ClusterView, models: Sequence[str]) -> list[int | None]:
    """Per model, the replica a request sent to it goes to (its least-loaded one that admission
    control allows); None: the model is masked."""
    return [view.least_loaded(m) for m in models]


def base_replica(env: RoutingEnv, policy: Policy, obs: object) -> int:
    """Where `policy` sends the current request, as the gateway would dispatch it."""
    assert env.request is not None
    view = env.view()
    return view.replica_for(policy.choose(obs, env.request, view))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Horizon:
    """How far ahead a decision is judged, the same for every action: the requests that arrive
    within `slo_windows` times the decided request's SLO time (its output tokens at the SLO's
    time per token: how long it lives if it meets its SLO), at least `seconds`, and at most
    `requests` of them, are routed by the base; then everything in flight runs to its end, with
    nothing more arriving. The value of an action is the reward of the same requests whatever
    the action: those in flight, the decided one and those that come while it may run."""

    seconds: float = 1.0
    slo_windows: float = 1.0
    requests: int = 100


def action_values(
    env: RoutingEnv, replicas: Sequence[int], base: Policy, horizon: Horizon, obs: object = None
) -> list[float]:
    """For each of `replicas`: the reward of every request in flight now, of the current one
    sent there, and of those the horizon takes in, routed by `base`, each run to its end in a
    fork of `env`. `obs`: the current observation, for a base that reads it (passed through
    to the forks' next ones)."""
    request = env.request
    assert request is not None and env.sim is not None
    reward = env.deployment.reward
    tokens = output_tokens(request, env.deployment.max_model_len)
    until = request.arrival + max(
        horizon.seconds, horizon.slo_windows * tokens * env.deployment.slo.tpot_s
    )
    start = end = env.next_request - 1  # the current request's index
    while (end < len(env.requests) and end - start < horizon.requests
           and env.requests[end].arrival <= until):  # fmt: skip
        end += 1
    counted = {r.request_id for r in env.requests[start:end]}
    counted |= {job.request.request_id for r in env.sim.replicas
                for job in (*r.batch.running, *r.batch.waiting)}  # fmt: skip
    values = []
    for replica in replicas:
        fork = env.fork()
        obs, _, _, truncated, _ = fork.step(replica)
        while not truncated and fork.next_request - 1 < end:
            obs, _, _, truncated, _ = fork.step(base_replica(fork, base, obs))
        fork.drain()
        values.append(sum(reward(f.request.task, f.model, f.request.qos_class, f.slo_met)
                          for f in fork.finished if f.request.request_id in counted))  # fmt: skip
    return values


class Replay:
    """A schedule followed again: each request to the model it went to (its least-loaded
    replica that is allowed), else as `fallback` routes it. What a second pass of the
    clairvoyant takes for the rest of the schedule while it tries each decision anew."""

    def __init__(self, models: dict[str, str], fallback: Policy) -> None:
        self.models = models
        self.fallback = fallback

    def choose(self, obs: object, request: Request, view: ClusterView) -> int:
        model = self.models.get(request.request_id)
        replica = view.least_loaded(model) if model is not None else None
        return replica if replica is not None else self.fallback.choose(obs, request, view)  # type: ignore[arg-type]


def clairvoyant(
    deployment: Deployment,
    spec: WorkloadSpec,
    seed: int,
    bases: Sequence[Callable[[], Policy]],
    horizon: Horizon = Horizon(),
    passes: int = 2,
    requests: int | None = None,
    duration: float | None = None,
    progress: Callable[[int], object] | None = None,
) -> list[Finished]:
    """The workload's requests (as `router.evaluate.simulate` draws them from `spec` and
    `seed`) routed in hindsight. First each heuristic of `bases` routes them all; the best of
    those schedules is the start. Then each pass takes every decision anew, in arrival order,
    as the model whose rollout earns the most (`action_values`) while the rest of the requests
    go where the schedule so far sent them (`Replay`; ties keep its choice), and keeps the new
    schedule if it earns more in full. Returns the best schedule: it never earns less than a
    base. `bases` must keep no state between calls (the rollouts share them)."""
    reward = deployment.reward

    def earned(done: list[Finished]) -> float:
        return sum(reward(f.request.task, f.model, f.request.qos_class, f.slo_met) for f in done)

    schedules = [_run(deployment, make(), spec, seed, requests, duration) for make in bases]
    best = max(schedules, key=earned)
    fallback = bases[0]
    for _ in range(passes):
        replay = Replay({f.request.request_id: f.model for f in best if f.model}, fallback())
        tried = _rollout_schedule(deployment, spec, seed, replay, horizon, requests, duration,
                                  progress)  # fmt: skip
        if earned(tried) <= earned(best):
            break
        best = tried
    return best


def _env(deployment: Deployment, spec: WorkloadSpec, seed: int, requests: int | None,
         duration: float | None) -> tuple[RoutingEnv, object]:  # fmt: skip
    env = RoutingEnv(deployment, action="replica")
    options = {"workload": spec, "seed": seed, "duration": duration, "requests": requests}
    obs, _ = env.reset(seed=seed, options={k: v for k, v in options.items() if v is not None})
    return env, obs


def _run(
    deployment: Deployment,
    policy: Policy,
    spec: WorkloadSpec,
    seed: int,
    requests: int | None,
    duration: float | None,
) -> list[Finished]:
    env, obs = _env(deployment, spec, seed, requests, duration)
    truncated = False
    while not truncated:
        obs, _, _, truncated, _ = env.step(base_replica(env, policy, obs))
    env.drain()
    return env.finished


def _rollout_schedule(
    deployment: Deployment,
    spec: WorkloadSpec,
    seed: int,
    base: Policy,
    horizon: Horizon,
    requests: int | None,
    duration: float | None,
    progress: Callable[[int], object] | None,
) -> list[Finished]:
    """One pass: every decision the model whose rollout under `base` earns the most."""
    env, obs = _env(deployment, spec, seed, requests, duration)
    truncated = False
    while not truncated:
        first = base_replica(env, base, obs)
        options = sorted({r for r in choices(env.view(), deployment.models) if r is not None}
                         | {first})  # fmt: skip
        replica = first
        if len(options) > 1:
            values = action_values(env, options, base, horizon, obs)
            # Ties to the base's own choice: a change must gain.
            top = max(values)
            if values[options.index(first)] < top:
                replica = options[values.index(top)]
        obs, _, _, truncated, _ = env.step(replica)
        if progress is not None:
            progress(1)
    env.drain()
    return env.finished
