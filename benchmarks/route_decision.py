"""Time of one routing decision in the gateway: the live view, the features and the policy.

Calls the gateway's own `_route` (what every request with model "auto" runs) on a deployment's
replicas, with their running counts redrawn before each call from a seeded generator and tasks
drawn uniformly. Engines are not started: routing reads only their health flag and the gateway's
counts, so each replica gets an idle stand-in that says it is healthy. Each call is timed on its
own with perf_counter_ns; the garbage collector is off while timing, as in timeit. Prints p50,
p99 and max per policy, and writes results/route_decision.csv.

    python benchmarks/route_decision.py [--deployments paper-4gpu embedded] [--calls 20000]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from config import load_deployment  # noqa: E402
from experiments.output import write_csv  # noqa: E402
from router.policies import make_policy  # noqa: E402
from serving.gateway import AUTO, Gateway  # noqa: E402
from serving.metrics import Metrics  # noqa: E402
from serving.replicas import Replica, ReplicaSet  # noqa: E402
from workloads import Message, Request  # noqa: E402


class _Idle:
    """Stands in for an engine that is up; routing asks nothing else of it."""

    def healthy(self) -> bool:
        return True


def measure(deployment_name: str, policy_name: str, calls: int, seed: int) -> np.ndarray:
    deployment = load_deployment(ROOT / "models.yaml", deployment_name)
    replicas = ReplicaSet([Replica(c, _Idle()) for c in deployment.replicas])  # type: ignore[arg-type]
    gateway = Gateway(deployment, replicas, make_policy(deployment, policy_name), Metrics(replicas))
    rng = np.random.default_rng(seed)
    tasks = deployment.tasks
    requests = [
        Request(
            f"r{i}",
            0.0,
            (Message("user", f"question {i}"),),
            64,
            "free-tier",
            task=tasks[i % len(tasks)],
        )  # fmt: skip
        for i in range(64)
    ]
    loads = rng.integers(0, 24, size=(calls, len(replicas.replicas)))
    rates = rng.uniform(0.25, 48, size=calls)
    times = np.empty(calls)
    gc.disable()
    try:
        for i in range(calls):
            for replica, n in zip(replicas, loads[i], strict=True):
                replica.running = int(n)
            request = requests[i % len(requests)]
            start = time.perf_counter_ns()
            gateway._route(request, AUTO, float(rates[i]), set())
            times[i] = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return times / 1000.0  # microseconds


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--deployments", nargs="+", default=["paper-4gpu", "embedded"])
    parser.add_argument(
        "--policies", nargs="+", default=["dqn", "quality-threshold", "prefix-hash", "least-load"]
    )
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    rows = []
    print(f"{'deployment':>12} {'policy':>18} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
    for dep in args.deployments:
        for policy in args.policies:
            try:
                us = measure(dep, policy, args.calls, args.seed)
            except ValueError as exc:  # e.g. a deployment whose policy file is not trained yet
                print(f"{dep:>12} {policy:>18} skipped: {exc}")
                continue
            p50, p99 = np.percentile(us, [50, 99])
            rows.append({"deployment": dep, "policy": policy, "calls": args.calls,
                         "p50_us": p50, "p99_us": p99, "max_us": us.max()})  # fmt: skip
            print(f"{dep:>12} {policy:>18} {p50:>8.1f} {p99:>8.1f} {us.max():>8.1f}")
    write_csv(args.out / "route_decision.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
