"""Run a policy over a workload in the simulator, and tune the threshold heuristic there.

The same environment that trains the DQN evaluates every policy, with the replica as the action,
so all of them see the same arrivals, the same contents and the same cluster.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from config import Deployment
from router.env import RandomRates, RoutingEnv
from router.policies import Policy, QualityThreshold, encoder_for
from router.sim import DEADLINE, OK, SHED, Finished, Simulator
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec
from workloads.lengths import Lengths
from workloads.summary import Outcome


def simulate(
    deployment: Deployment,
    policy: Policy,
    spec: WorkloadSpec,
    seed: int,
    duration: float | None = None,
    requests: int | None = None,
    simulator: Callable[[], Simulator] | None = None,
) -> list[Finished]:
    """Every request of the workload, routed by `policy` and run to its end."""
    env = RoutingEnv(
        deployment, action="replica", simulator=simulator, encoder=encoder_for(policy, deployment)
    )
    options = {"workload": spec, "seed": seed, "duration": duration, "requests": requests}
    obs, _ = env.reset(seed=seed, options={k: v for k, v in options.items() if v is not None})
    truncated = False
    while not truncated:
        assert env.request is not None
        obs, _, _, truncated, _ = env.step(policy.choose(obs, env.request, env.view()))
    env.drain()
    return env.finished


def outcomes(deployment: Deployment, finished: Sequence[Finished]) -> list[Outcome]:
    """The simulator's records in the load generator's terms, for workloads.summary."""
    rows = []
    for f in finished:
        r = f.request
        row = Outcome(
            request_id=r.request_id,
            qos_class=r.qos_class,
            task=r.task,
            arrival_s=f.arrival,
            status=_STATUS[f.outcome],
            model=f.model,
            replica=str(f.replica),
            prompt_tokens=r.prompt_tokens,
        )
        if f.outcome != OK or f.first_token is None:
            row.error_kind = f.outcome
        else:
            gaps = f.output_tokens - 1
            itl = (f.last_token - f.first_token) / gaps if gaps > 0 else 0.0
            row.ttft_s, row.itl_s = f.first_token - f.arrival, [itl] * gaps
            row.e2el_s, row.output_tokens = f.last_token - f.arrival, f.output_tokens
            row.slo_met = f.slo_met
            row.reward = deployment.reward(r.task, f.model, r.qos_class, f.slo_met)
        rows.append(row)
    return sorted(rows, key=lambda o: o.arrival_s)


_STATUS = {OK: 200, DEADLINE: 504, SHED: 429}
"""The gateway's answer for each way a simulated request ends."""


def mean_reward(deployment: Deployment, finished: Sequence[Finished]) -> float:
    if not finished:
        return 0.0
    reward = deployment.reward
    total = sum(reward(f.request.task, f.model, f.request.qos_class, f.slo_met) for f in finished)
    return total / len(finished)


def training_workloads(
    deployment: Deployment, episodes: int, seed: int, lengths: Sequence[Lengths] = ()
) -> list[tuple[WorkloadSpec, int]]:
    """(workload, its seed) for `episodes` episodes like the training ones (RandomRates), with
    request lengths from `lengths` (none: those of Chuppala (2024))."""
    rng = np.random.default_rng(seed)
    sampler = training_sampler(deployment, lengths)
    return [(sampler(rng), int(rng.integers(2**31))) for _ in range(episodes)]


def training_sampler(
    deployment: Deployment,
    lengths: Sequence[Lengths] = (),
    rates: tuple[float, float] = (0.25, 48.0),
) -> RandomRates:
    """The training workloads on `deployment`: every class of its, its context."""
    return RandomRates(
        rates=rates,
        classes=tuple(deployment.qos_classes),
        lengths=tuple(lengths),
        context=deployment.max_model_len,
    )


VALIDATION_SEED = 10_000
"""Validation workloads are drawn from their own seed, apart from tuning's (0) and training's."""


def validation_reward(
    deployment: Deployment,
    policy: Policy,
    episodes: int = 6,
    episode_requests: int = 1000,
    simulator: Callable[[], Simulator] | None = None,
) -> float:
    """Mean reward per request on fixed training-like workloads, to pick among checkpoints.
    `simulator` makes each episode's simulator (default: the deployment's, with exact views)."""
    finished = [
        f
        for spec, seed in training_workloads(deployment, episodes, VALIDATION_SEED)
        for f in simulate(
            deployment, policy, spec, seed, requests=episode_requests, simulator=simulator
        )
    ]
    return mean_reward(deployment, finished)


GRID_RATES = (1.0, 4.0, 16.0, 48.0)
"""The rates a policy is judged at across lengths (experiments.lengths) and validated at."""


GUARD_RATES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0)


def guard_rewards(deployment: Deployment, policy: Policy) -> np.ndarray:
    """Mean reward at each of GUARD_RATES on the thesis's workload (Poisson, its lengths, one
    class), without admission control, as its Figure 4 runs: 400 s of arrivals (40 s from 8
    req/s on), from the validation seed, not those the experiments report on."""
    rewards = []
    for k, rate in enumerate(GUARD_RATES):
        spec = WorkloadSpec(arrivals=Poisson(rate))
        done = simulate(deployment.with_admission("none"), policy, spec, VALIDATION_SEED + k,
                        duration=40.0 if rate >= 8 else 400.0)  # fmt: skip
        rewards.append(mean_reward(deployment, done))
    return np.array(rewards)


def grid_workload(deployment: Deployment, lengths: Lengths, rate: float) -> WorkloadSpec:
    """Poisson arrivals at `rate`, every class of the deployment alike, `lengths`' lengths."""
    return WorkloadSpec(
        arrivals=Poisson(rate),
        classes=dict.fromkeys(deployment.qos_classes, 1.0),
        lengths=lengths,
        context=deployment.max_model_len,
        text=False,
    )


def grid_reward(
    deployment: Deployment,
    policy: Policy,
    lengths: Sequence[Lengths],
    episode_requests: int = 1000,
    simulator: Callable[[], Simulator] | None = None,
    rates: Sequence[float] = GRID_RATES,
) -> float:
    """Mean reward on a grid: one episode of each distribution of `lengths` at each rate
    (Poisson, every class alike), each episode's mean reward weighing the same, so that a
    light load counts as much as a heavy one, and a short prompt as a long one."""
    rewards = []
    for k, (each, rate) in enumerate(itertools.product(lengths, rates)):
        spec = grid_workload(deployment, each, rate)
        done = simulate(deployment, policy, spec, VALIDATION_SEED + k,
                        requests=episode_requests, simulator=simulator)  # fmt: skip
        rewards.append(mean_reward(deployment, done))
    return float(np.mean(rewards))


@dataclass(frozen=True)
class TuneResult:
    thresholds: dict[str, int]
    reward: float
    """Mean reward per request over the tuning episodes."""
    table: list[tuple[dict[str, int], float]]


THRESHOLD_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def tune_threshold(
    deployment: Deployment,
    episodes: int = 8,
    episode_requests: int = 1000,
    seed: int = 0,
    grid: Sequence[int] = THRESHOLD_GRID,
    progress: Callable[[int], object] | None = None,
    lengths: Sequence[Lengths] = (),
) -> TuneResult:
    """Grid-search QualityThreshold's per-model thresholds on training workloads (RandomRates,
    drawn from `seed`, with request lengths from `lengths`), every candidate on the same
    episodes. The lowest-quality model is the last resort and keeps no threshold of its own."""
    ranked = sorted(
        deployment.models, key=lambda m: -np.mean([row[m] for row in deployment.quality.values()])
    )
    tuned = ranked[:-1]
    workloads = training_workloads(deployment, episodes, seed, lengths)
    table = []
    for values in itertools.product(grid, repeat=len(tuned)):
        thresholds = dict(zip(tuned, values, strict=True))
        policy = QualityThreshold(deployment.quality, max(grid), thresholds)
        finished = [
            f
            for spec, s in workloads
            for f in simulate(deployment, policy, spec, s, requests=episode_requests)
        ]
        table.append((thresholds, mean_reward(deployment, finished)))
        if progress:
            progress(1)
    best, reward = max(table, key=lambda row: row[1])
    return TuneResult(best, reward, table)
