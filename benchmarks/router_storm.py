"""`python -m benchmarks.router_storm`: the learned router through the real server in storms,
on the live twin of Chuppala (2024)'s deployment (`paper-4gpu-sim`), with a length
distribution's requests, and whether every request is accounted for.

The server (`python -m serving --deployment paper-4gpu-sim --policy-file F --time-scale K`,
HTTP/1.1, request log on) on CPU 0; the load (`python -m workloads.replay --lengths NAME`, every
class of the deployment alike, their deadlines kept) on CPU 1, for each DQN of `--policies` in
turn: how the router that reads each request's lengths and the one before it hold. Scenarios
(`benchmarks.common.STORMS`): `calm`; `client-killed` (the client SIGKILLed `--kill-after`
seconds in, then another 300 requests); `engines-die` (OPT-6.7B on GPU 0 and OPT-1.3B on GPU 1
die 12 s in, back 5 s later).

For each run: the client's completed and failed requests, the server's `serving_requests_total`
by outcome and its request log's lines, and what `serving_replica_in_flight` holds after: they
must agree, and in-flight must be back at 0. The same storms with KubeAI's workload:
`benchmarks.prefix_twin`.

    python -m benchmarks.router_storm --lengths conversations --rate 64 --requests 1900 \
        --scenario engines-die \
        --policies router/trained/paper-4gpu-lengths.npz,router/trained/paper-4gpu.npz
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import STORM_KEY, add_storm_arguments, storm_report, storm_runs
from config import load_deployment
from workloads.lengths import ALL as LENGTHS

DEPLOYMENT = "paper-4gpu-sim"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_storm", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_storm_arguments(parser, "router/trained/paper-4gpu.npz", "router_storm")
    parser.add_argument(
        "--lengths",
        choices=list(LENGTHS),
        default="conversations",
        help="the load: this length distribution's requests (workloads.lengths)",
    )
    parser.set_defaults(time_scale=1.0, rate=64.0, concurrency=800)
    args = parser.parse_args(argv)
    classes = ",".join(load_deployment(name=DEPLOYMENT).qos_classes)
    workload = ["--lengths", args.lengths, "--classes", classes, "--api-key", STORM_KEY,
                "--deployment", DEPLOYMENT]  # fmt: skip
    return storm_report(args, storm_runs(args, DEPLOYMENT, workload, no_deadlines=False))


if __name__ == "__main__":
    sys.exit(main())
