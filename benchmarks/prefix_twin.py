"""`python -m benchmarks.prefix_twin`: the workload of KubeAI's benchmark through the real
server, on the live twin (`kubeai-l4-sim`: eight simulated L4 replicas of Llama 3.1 8B in real
time), and whether every request is accounted for, in calm and in storms.

The server (`python -m serving --deployment kubeai-l4-sim --policy P --time-scale K`, HTTP/1.1,
request log on) on CPU 0; the load (`python -m workloads.replay --kubeai-benchmark --num-requests N
--rate R --max-concurrency C --classes long`) on CPU 1. The engines run K times slower than
the profile (at 1, eight replicas at concurrency 800 stream about 10,000 tokens a second, more
than one core carries beside the client), and no class has a deadline (KubeAI's benchmark client
had none): TTFT is reported in the profile's time, divided by K. Scenarios
(`benchmarks.common.STORMS`):
- `calm`: each policy in turn;
- `client-killed`: the client SIGKILLed `--kill-after` seconds in, then another 300 requests;
- `engines-die`: two of the eight engines die 12 s in (`simulation.faults`), back 5 s later.

For each run: the client's completed and failed requests, the server's `serving_requests_total`
by outcome and its request log's lines, and what `serving_replica_in_flight` holds after: they
must agree, and in-flight must be back at 0. The same storms with the router's own workload:
`benchmarks.router_storm`.

    python -m benchmarks.prefix_twin                                   # calm, RR and precise
    python -m benchmarks.prefix_twin --scenario engines-die --requests 1500 --concurrency 200
    python -m benchmarks.prefix_twin --scenario client-killed --concurrency 300
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import add_storm_arguments, storm_report, storm_runs

KUBEAI_TWIN = "kubeai-l4-sim"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefix_twin", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_storm_arguments(parser, "round-robin,prefix-precise", "prefix_twin")
    args = parser.parse_args(argv)
    workload = ["--kubeai-benchmark", "--classes", "long"]
    return storm_report(args, storm_runs(args, KUBEAI_TWIN, workload, no_deadlines=True))


if __name__ == "__main__":
    sys.exit(main())
