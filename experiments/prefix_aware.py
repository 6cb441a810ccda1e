"""`python -m experiments.prefix_aware`: prefix-aware routing (seed 003) on the live deployment.

Multi-turn sessions (each turn resends the whole conversation, led by a document of its own), as
Poisson arrivals, sent to the real embedded deployment with vLLM's prefix caching on (its
default), once per routing policy, each on a freshly started server so that no policy inherits a
warm cache. Compares TTFT and throughput.

Writes results/prefix_aware.csv and .png and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.live import replay, server
from experiments.output import write_csv

POLICIES = ("round-robin", "least-load", "prefix-hash", "dqn")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.prefix_aware", description=__doc__)
    parser.add_argument("--deployment", default="embedded")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    flags = ["--deployment", args.deployment, "--arrivals", "poisson", "--rate", str(args.rate),
             "--duration", str(args.duration), "--seed", str(args.seed), "--sessions"]  # fmt: skip
    rows = []
    for policy in args.policies:
        log = args.results / f"prefix_aware-{policy}-server.log"
        with server(args.deployment, policy, log) as live:
            record = replay(live.url, args.results / f"prefix_aware-{policy}.json", *flags)
        s = record["summary"]
        rows.append({
            "policy": policy, "sent": s["sent"], "completed": s["completed"],
            "mean_ttft_ms": s["mean_ttft_ms"], "median_ttft_ms": s["median_ttft_ms"],
            "p99_ttft_ms": s["p99_ttft_ms"], "median_itl_ms": s["median_itl_ms"],
            "output_throughput": s["output_throughput"],
            "total_token_throughput": s["total_token_throughput"],
            "mean_reward": s["mean_reward"], "model_share": s["model_share"],
        })  # fmt: skip
        print(f"{policy}: done", file=sys.stderr)
    write_csv(args.results / "prefix_aware.csv", rows)
    plot(rows, args.results / "prefix_aware.png")
    print(f"multi-turn sessions, Poisson {args.rate:g} req/s for {args.duration:g} s, seed "
          f"{args.seed}, deployment {args.deployment}")  # fmt: skip
    print(f"{'policy':>12} {'done':>9} {'mean TTFT':>10} {'med TTFT':>9} {'p99 TTFT':>9} "
          f"{'tok/s out':>9} {'tok/s all':>9} {'reward':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['policy']:>12} {r['completed']:>4}/{r['sent']:<4} {r['mean_ttft_ms']:>10.1f} "
              f"{r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>9.1f} "
              f"{r['output_throughput']:>9.1f} {r['total_token_throughput']:>9.1f} "
              f"{r['mean_reward']:>7.3f}")  # fmt: skip
    print(f"wrote {args.results / 'prefix_aware.csv'} and .png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["policy"] for r in rows]
    left.bar(names, [r["median_ttft_ms"] for r in rows], label="median")
    left.plot(names, [r["p99_ttft_ms"] for r in rows], "k^", label="p99")
    left.set(ylabel="TTFT (ms)", title="Time to first token")
    left.legend()
    right.bar(names, [r["total_token_throughput"] for r in rows])
    right.set(ylabel="tokens/s (prompt + output)", title="Throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
