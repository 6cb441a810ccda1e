"""Time of one routing decision in the gateway: the live view, the features and the policy.

Calls the gateway's own `_route` (what every request with model "auto" runs) on a deployment's
replicas, with their running counts redrawn before each call from a seeded generator and tasks
drawn uniformly. Engines are not started: routing reads only their health flag and the gateway's
counts, so each replica gets an idle stand-in that says it is healthy. Each call is timed on its
own with perf_counter_ns; the garbage collector is off while timing, as in timeit. Prints p50,
p99 and max per policy, and writes results/route_decision.csv.

Then the prefix-aware policies (`--prefix`, on by default) on the deployment of KubeAI's benchmark
(`kubeai-l4-sim`, eight replicas), with its prompts (832 tokens, 52 blocks each on average, counted
and hashed before the timing, as the gateway does before it routes): least-load as the floor,
bounded-load hashing, and the approximate and precise indexes, each warmed first (the approximate
one by routing every distinct prompt once, the precise one by each prompt's blocks stored on a
replica drawn at random). Apart from them, what counting a prompt's tokens and hashing its blocks
costs the gateway before it routes (`prompt count`: KubeAI's benchmark prompts, 838 tokens on
average, each counted afresh).

Then the DQN that reads the request's lengths against the one shipped before it (`--before`), on
the first deployment: the same calls, each timed on both gateways in turn, the requests of every
training length distribution; and apart, the output predictor the gateway runs before the
decision (`output predictor`), taught 2,000 served requests first.

Then the network-aware DQN against the network-blind one (`--paths`, default `mixed`, on the
first deployment): the same calls, each timed on both gateways in turn (which goes first
alternates), the network-aware one's requests carrying paths of the mix. It prints both p99s and
their difference, whose target is at most 10 us.

    python -m benchmarks.route_decision [--deployments paper-4gpu embedded] [--calls 20000]
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from config import Deployment, load_deployment
from experiments.harness.output import write_csv
from experiments.prefix_aware import Scale, counter, seed_requests
from router.features import OutputPredictor
from router.paths import estimate_of
from router.policies import TRAINED, ModelThenReplica, make_policy
from router.prefix import PrefixAffinity
from serving.gateway import AUTO, Gateway
from serving.metrics import Metrics
from serving.replicas import Replica, ReplicaSet
from workloads import Message, Request
from workloads.conversations import conversations, kubeai_benchmark_prompts
from workloads.lengths import SHAREGPT_16, TRAINING

ROOT = Path(__file__).resolve().parent.parent


class _Idle:
    """Stands in for an engine that is up; routing asks nothing else of it."""

    def healthy(self) -> bool:
        return True

    def load(self) -> None:
        return None  # no load of its own beyond what the gateway counts


def _gateway(deployment: Deployment, policy_name: str) -> tuple[Gateway, ReplicaSet]:
    replicas = ReplicaSet([Replica(c, _Idle()) for c in deployment.replicas])  # type: ignore[arg-type]
    policy = make_policy(deployment, policy_name)
    return Gateway(deployment, replicas, policy, Metrics(replicas)), replicas


def _requests(deployment: Deployment, count: int = 64) -> list[Request]:
    """Requests of every task and class, of lengths of every training distribution (their
    prompts counted, as the gateway counts before it routes), each on a path of the
    deployment's mix where it names one."""
    tasks, classes = deployment.tasks, list(deployment.qos_classes)
    paths = [estimate_of(p) for p in deployment.paths.paths.values()] if deployment.paths else []
    rng = np.random.default_rng(1)
    out = []
    for i in range(count):
        lengths = TRAINING[i % len(TRAINING)]
        prompt, _, max_tokens = lengths.draw(rng, deployment.max_model_len)
        out.append(Request(
            f"r{i}", 0.0, (Message("user", f"question {i}"),), max_tokens,
            classes[i % len(classes)], task=tasks[i % len(tasks)], prompt_tokens=prompt or 40,
            path=paths[i % len(paths)] if paths else None,
        ))  # fmt: skip
    return out


def measure_predictor(deployment: Deployment, calls: int) -> np.ndarray:
    """Microseconds of each output prediction (`OutputPredictor.predict`, which the gateway runs
    before the decision's timer starts), on a predictor taught 2,000 served requests first."""
    predictor = OutputPredictor(deployment.max_model_len)
    requests = _requests(deployment)
    rng = np.random.default_rng(2)
    for k in range(2000):
        predictor.observe(requests[k % len(requests)], int(rng.integers(1, 512)))
    times = np.empty(calls)
    gc.disable()
    try:
        for i in range(calls):
            request = requests[i % len(requests)]
            start = time.perf_counter_ns()
            predictor.predict(request)
            times[i] = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return times / 1000.0


def measure(deployments: list[Deployment], policy_name: str, calls: int, seed: int) -> np.ndarray:
    """Microseconds of each call (rows) on each deployment's gateway (columns), the same calls
    on each, in turn, the first of each call's turns rotating among them."""
    gateways = [_gateway(d, policy_name) for d in deployments]
    requests = [_requests(d) for d in deployments]
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 24, size=(calls, len(deployments[0].replicas)))
    rates = rng.uniform(0.25, 48, size=calls)
    times = np.empty((calls, len(deployments)))
    gc.disable()
    try:
        for i in range(calls):
            for k in range(len(deployments)):
                which = (i + k) % len(deployments)
                gateway, replicas = gateways[which]
                for replica, n in zip(replicas, loads[i], strict=True):
                    replica.running = int(n)
                request = requests[which][i % len(requests[which])]
                start = time.perf_counter_ns()
                gateway._route(request, AUTO, float(rates[i]), replicas.view(None))
                times[i, which] = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return times / 1000.0


PROMPTS = Scale(conversations=40, prompts=200, requests=2000, runs=())
"""KubeAI's benchmark recipe at a quarter of its distinct prompts: what the prefix rows route."""


@functools.cache
def _kubeai_prompts(deployment_name: str, seed: int) -> list[Request]:
    """KubeAI's benchmark prompts, counted and hashed for `deployment_name`, each with a task."""
    deployment = load_deployment(ROOT / "models.yaml", deployment_name)
    requests = seed_requests(counter(deployment), PROMPTS, seed, uneven=False)
    tasks = deployment.tasks
    return [replace(r, task=tasks[i % len(tasks)]) for i, r in enumerate(requests)]


def measure_prefix(
    policy_name: str, calls: int, seed: int, deployment_name: str = "kubeai-l4-sim"
) -> np.ndarray:
    """Microseconds of each prefix-aware decision on `deployment_name` (module docstring)."""
    deployment = load_deployment(ROOT / "models.yaml", deployment_name)
    gateway, replicas = _gateway(deployment, policy_name)
    requests = _kubeai_prompts(deployment_name, seed)
    rng = np.random.default_rng(seed)
    policy = gateway.policy
    if isinstance(policy, ModelThenReplica):
        policy = policy.replica_policy
    distinct = {r.prompt: r for r in requests}.values()
    for request in distinct:
        if isinstance(policy, PrefixAffinity) and policy.precise:
            policy.event(int(rng.integers(len(replicas))), "stored", request.blocks or ())
        else:
            gateway._route(request, AUTO, 50.0, replicas.view(None))
    loads = rng.integers(0, 24, size=(calls, len(deployment.replicas)))
    times = np.empty(calls)
    gc.disable()
    try:
        for i in range(calls):
            for replica, n in zip(replicas, loads[i], strict=True):
                replica.running = int(n)
            request = requests[i % len(requests)]
            start = time.perf_counter_ns()
            gateway._route(request, AUTO, 50.0, replicas.view(None))
            times[i] = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return times / 1000.0


def measure_count(calls: int, seed: int) -> np.ndarray:
    """Microseconds the gateway takes to count a prompt and hash its blocks before routing
    (`Gateway._count`: a thread for prompts of over 1,024 characters), on KubeAI's benchmark
    prompts."""
    import asyncio

    from serving.engines.prompts import gateway_counter

    deployment = load_deployment(ROOT / "models.yaml", "kubeai-l4-sim")
    counter = gateway_counter(deployment)
    assert counter is not None
    convs = conversations(SHAREGPT_16, PROMPTS.conversations, seed)
    prompts = kubeai_benchmark_prompts(convs, PROMPTS.prompts, PROMPTS.prompts)
    times = np.empty(calls)

    async def run() -> None:
        for i in range(calls):
            start = time.perf_counter_ns()
            await counter.count(prompts[i % len(prompts)], 16384)
            times[i] = time.perf_counter_ns() - start

    asyncio.run(run())
    return times / 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--deployments", nargs="+", default=["paper-4gpu", "embedded"])
    parser.add_argument(
        "--policies", nargs="+", default=["dqn", "quality-threshold", "prefix-hash", "least-load"]
    )
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument(
        "--prefix",
        nargs="*",
        default=["least-load", "prefix-hash", "prefix-approx", "prefix-precise"],
        help="prefix-aware policies to time on kubeai-l4-sim (none: skip)",
    )
    parser.add_argument("--paths", default="mixed", help="the network-aware DQN's path mix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--before",
        type=Path,
        default=TRAINED / "paper-4gpu-lengths.npz",
        help="a DQN to time beside the first deployment's own (default: the one that reads "
        "request lengths); 'none': skip",
    )
    parser.add_argument(
        "--policy-file",
        type=Path,
        help="--before: the DQN timed against it (default: the first deployment's own)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    if str(args.before) == "none":
        args.before = None
    rows = []
    print(f"{'deployment':>12} {'policy':>18} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    config = ROOT / "models.yaml"
    for dep in args.deployments:
        for policy in args.policies:
            try:
                us = measure([load_deployment(config, dep)], policy, args.calls, args.seed)[:, 0]
            except ValueError as exc:  # e.g. a deployment whose policy file is not trained yet
                print(f"{dep:>12} {policy:>18} skipped: {exc}")
                continue
            rows.append(_row(dep, policy, us, args.calls))
    for policy in args.prefix:
        rows.append(_row("kubeai-l4-sim", policy, measure_prefix(policy, args.calls, args.seed),
                         args.calls))  # fmt: skip
    if args.prefix:
        # The DQN with and without prefix placement, on the same prompts, in this one run.
        for policy in ("dqn", "dqn+prefix-precise"):
            us = measure_prefix(policy, args.calls, args.seed, "paper-4gpu-sim")
            rows.append(_row("paper-4gpu-sim", policy, us, args.calls))
        calls = min(args.calls, 4000)
        rows.append(_row("kubeai-l4-sim", "prompt count", measure_count(calls, args.seed), calls))
    first = args.deployments[0]
    if args.before is not None:
        # The DQN against the one before it, on the same calls, in this run.
        now = load_deployment(config, first)
        if args.policy_file is not None:
            now = now.with_policy_file(args.policy_file)
        both = measure([now.with_policy_file(args.before), now], "dqn", args.calls, args.seed)
        rows.append(_row(first, "dqn (before)", both[:, 0], args.calls))
        rows.append(_row(first, "dqn (now)", both[:, 1], args.calls))
        rows.append(_row(first, "output predictor", measure_predictor(now, args.calls),
                         args.calls))  # fmt: skip
        p99 = np.percentile(both, 99, axis=0)
        verdict = "PASS" if p99[1] - p99[0] <= 10 else "MISS"
        print(f"{verdict} the DQN {now.policy_file}: p99 {p99[1]:.1f} us against {p99[0]:.1f} us "
              f"before, in the same run: {p99[1] - p99[0]:+.1f} us (target: at most +10; the "
              "predictor's own time is in it)")  # fmt: skip
    blind, aware = load_deployment(config, first), load_deployment(config, first, args.paths)
    if aware.policy_file == blind.policy_file:
        print(f"{first} has no network-aware policy (policy.net_path): not compared")
    else:
        both = measure([blind, aware], "dqn", args.calls, args.seed)
        rows.append(_row(first, "dqn (network-blind)", both[:, 0], args.calls))
        rows.append(_row(f"{first}+{args.paths}", "dqn (network-aware)", both[:, 1], args.calls))
        p99 = np.percentile(both, 99, axis=0)
        verdict = "PASS" if p99[1] - p99[0] <= 10 else "MISS"
        print(f"{verdict} network-aware p99 {p99[1]:.1f} us against network-blind {p99[0]:.1f} us"
              f" in the same run: {p99[1] - p99[0]:+.1f} us (target: at most +10)")  # fmt: skip
    write_csv(args.out / "route_decision.csv", rows)
    return 0


def _row(deployment: str, policy: str, us: np.ndarray, calls: int) -> dict[str, object]:
    p50, p99 = np.percentile(us, [50, 99])
    print(f"{deployment:>12} {policy:>18} {p50:>8.1f} {p99:>8.1f} {us.max():>8.1f}")
    return {"deployment": deployment, "policy": policy, "calls": calls, "p50_us": p50,
            "p99_us": p99, "max_us": us.max()}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
