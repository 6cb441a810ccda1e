"""A bound no routing of a workload can pass, in the simulator's model of the deployment.

The workload is known in full (every arrival, every prompt's and answer's length), and the bound
is a linear program (HiGHS, through scipy) over x[i, m], the share of request i that model m
serves within the SLO. It maximises the reward sum(x[i, m] quality(i, m) weight(i)) / requests
under constraints that every schedule the simulator can run meets, so that its optimum is at
least what any schedule earns, the clairvoyant's (`router.hindsight`) included:

- A request goes one way at most: sum over m of x[i, m] <= 1 (the rest is unserved or late).
- x[i, m] = 0 where model m could not serve request i within its SLO even alone on an idle
  device: its first iteration (its prefill and one step at batch 1) past its class's first-token
  deadline, or that and (n - 1) more steps at batch 1 past the SLO's n x tpot for its n output
  tokens; or its context larger than the replica's KV cache.
- Capacity, per model and time window [s, e): the requests that arrive at or after s and whose
  SLO ends by e (arrival + n x tpot) must be served inside the window. On one replica, take
  only those requests, c_t of them in its t-th iteration. Each of them is in n of its
  iterations and lives at most n x tpot, so sum over t of c_t d_t <= tpot sum(n) = tpot N,
  where d_t, the iteration's length, is at least step(c_t) (more requests in the batch,
  prefills and busy neighbours only make it longer); and sum d_t <= (e - s) - their prefills.
  The most tokens N that allows is rho x (window - prefills), where rho (`slo_token_rate`)
  is the optimum of a small LP over how many iterations run at each batch size: the most
  tokens a second a replica can give requests that all meet the SLO. Summed over the model's
  replicas: sum over the window's requests of x[i, m] (n_i + rho prefill_m p_i) <= rho R (e - s).

Windows of 0.5 s, 1 s, 2 s, ... up to the workload's whole span, each length at every multiple
of half of it. What the bound leaves out, so that it is loose by that much at most: busy
neighbours on a GPU (each slows an iteration by 10% on paper-4gpu), batches that cannot follow
the requests exactly, waiting for a batch to make room, the first-token deadlines under load,
and requests that straddle windows. docs/router.md#the-references-in-hindsight says how far it
sits above the clairvoyant schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_array

from config import Deployment
from config.schema import ProfileModel
from router.sim import DEFAULT_PROMPT_TOKENS, output_tokens, step_time
from workloads import Request

SHORTEST_WINDOW_S = 0.5


def slo_token_rate(profile: ProfileModel, tpot_s: float, max_batch: int) -> float:
    """The most output tokens a second one replica can give requests that all meet an SLO of
    `tpot_s` a token: max sum(c n_c) over iterations n_c >= 0 at each batch size c, such that
    sum(n_c step(c)) <= 1 s and sum(n_c c (step(c) - tpot)) <= 0 (see the module)."""
    sizes = np.arange(1, max_batch + 1)
    steps = np.array([step_time(profile, int(c)) for c in sizes])
    result = linprog(
        -sizes.astype(float),
        A_ub=np.vstack([steps, sizes * (steps - tpot_s)]),
        b_ub=[1.0, 0.0],
        bounds=(0, None),
        method="highs",
    )
    if result.status != 0:
        raise RuntimeError(f"the token-rate LP failed: {result.message}")
    return float(-result.fun)


@dataclass(frozen=True)
class Bound:
    reward: float
    """Mean reward per request no schedule can pass."""
    alone: float
    """Without the capacity constraints: each request's best model that could serve it alone."""
    shares: dict[str, float]
    """The share of the requests the bound's optimum gives each model."""


def upper_bound(
    deployment: Deployment, requests: Sequence[Request], max_batch: int | None = None
) -> Bound:
    """The bound on `requests` (with their arrivals and lengths, as the simulator runs them) on
    `deployment`, whose latency profile, replicas and SLO it reads."""
    profile = deployment.profile
    if profile is None:
        raise ValueError(f"deployment {deployment.name!r} names no latency profile")
    if not requests:
        return Bound(0.0, 0.0, {})
    tpot = deployment.slo.tpot_s
    batch = max_batch or deployment.max_batch or 256
    models = deployment.models
    replicas = {m: [r for r in deployment.replicas if r.model == m] for m in models}
    deadlines = {n: c.deadline_s for n, c in deployment.qos_classes.items()}
    arrival = np.array([r.arrival for r in requests])
    tokens = np.array([output_tokens(r, deployment.max_model_len) for r in requests])
    prompt = np.array([r.prompt_tokens or DEFAULT_PROMPT_TOKENS for r in requests])
    ends = arrival + tokens * tpot
    columns: list[tuple[int, int, float]] = []  # (request, model, reward) of each variable
    for m, model in enumerate(models):
        p = profile.models[model]
        first = step_time(p, 1) + prompt * p.prefill_s_per_token
        last = first + (tokens - 1) * step_time(p, 1)
        # The most blocks any of its replicas holds, and the blocks its last step reads.
        blocks = max(
            (r.kv_tokens // r.block_size if r.kv_tokens else math.inf for r in replicas[model]),
            default=math.inf,
        )
        size = min((r.block_size for r in replicas[model]), default=16)
        for i, request in enumerate(requests):
            if first[i] > deadlines.get(request.qos_class, math.inf) or last[i] > tokens[i] * tpot:
                continue
            if -(-(prompt[i] + tokens[i] - 1) // size) > blocks:
                continue
            value = deployment.reward(request.task, model, request.qos_class, True)
            if value > 0:
                columns.append((i, m, value))
    n = len(requests)
    if not columns:
        return Bound(0.0, 0.0, {m: 0.0 for m in models})
    index = np.array([c[0] for c in columns])
    model_of = np.array([c[1] for c in columns])
    values = np.array([c[2] for c in columns])
    best_alone = np.zeros(n)
    np.maximum.at(best_alone, index, values)
    rows, cols, data, limits = [], [], [], []
    # One way at most per request.
    for k, i in enumerate(index):
        rows.append(i)
        cols.append(k)
        data.append(1.0)
    limits += [1.0] * n
    row = n
    span = float(ends.max() - arrival.min())
    start0 = float(arrival.min())
    lengths = []
    length = SHORTEST_WINDOW_S
    while length < 2 * span:
        lengths.append(length)
        length *= 2
    for m, model in enumerate(models):
        p = profile.models[model]
        rho = slo_token_rate(p, tpot, batch)
        mine = np.nonzero(model_of == m)[0]
        if not len(mine):
            continue
        weight = tokens[index[mine]] + rho * p.prefill_s_per_token * prompt[index[mine]]
        a, e = arrival[index[mine]], ends[index[mine]]
        for length in lengths:
            for s in np.arange(start0, start0 + span, length / 2):
                inside = np.nonzero((a >= s) & (e <= s + length))[0]
                if not len(inside):
                    continue
                rows += [row] * len(inside)
                cols += mine[inside].tolist()
                data += weight[inside].tolist()
                limits.append(rho * len(replicas[model]) * length)
                row += 1
    matrix = coo_array((data, (rows, cols)), shape=(row, len(columns))).tocsr()
    result = linprog(-values, A_ub=matrix, b_ub=limits, bounds=(0, 1), method="highs")
    if result.status != 0:
        raise RuntimeError(f"the bound's LP failed: {result.message}")
    x = result.x
    shares = {model: float(x[model_of == m].sum() / n) for m, model in enumerate(models)}
    return Bound(float(-result.fun / n), float(best_alone.sum() / n), shares)
