"""`python -m experiments.sim_vs_real`: the simulator against the live embedded deployment.

One Poisson workload is sent to the real server (`workloads.replay` over HTTP/1.1, the server
started here unless --url names one). The simulator, on the deployment's measured profile, then
runs the very same requests: each at its scheduled arrival, with the prompt and output lengths
the engines reported, on the replica the live router chose. Per request, the error of the
simulated TTFT and end-to-end latency against the measured ones; the target is a median absolute
error of the end-to-end latency within 20%.

Writes results/sim_vs_real.csv and .png and prints the summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from config import DEFAULT_PATH, load_deployment
from experiments.harness.live import replay as run_replay
from experiments.harness.live import server
from experiments.harness.output import write_csv
from router.sim import Finished, Simulator
from workloads import Request


def compare(live: dict, deployment_name: str, config: Path) -> list[dict[str, float | str]]:
    """Replays the live requests in the simulator, each at its scheduled arrival with the token
    counts the engines reported, on the replica the live router chose."""
    deployment = load_deployment(config, deployment_name)
    names = [r.name for r in deployment.replicas]
    done = [o for o in live["requests"] if o["error_kind"] is None]
    # Every request replayed here completed live, so none may end at a deadline here either.
    sim = Simulator.from_deployment(deployment, deadlines={})
    finished: list[Finished] = []
    for i, o in enumerate(done):
        finished += sim.advance(o["arrival_s"])
        request = Request(str(i), o["arrival_s"], "", o["output_tokens"], o["qos_class"],
                          prompt_tokens=o["prompt_tokens"])  # fmt: skip
        sim.submit(request, names.index(o["replica"]))
    finished += sim.drain()
    by_index = {int(f.request.request_id): f for f in finished}
    rows = []
    for i, o in enumerate(done):
        f = by_index[i]
        assert f.first_token is not None  # no deadlines, and every request owes a token
        rows.append({
            "request": o["request_id"], "replica": o["replica"], "arrival_s": o["arrival_s"],
            "prompt_tokens": o["prompt_tokens"], "output_tokens": o["output_tokens"],
            "real_ttft_s": o["ttft_s"], "sim_ttft_s": f.first_token - f.arrival,
            "real_e2el_s": o["e2el_s"], "sim_e2el_s": f.last_token - f.arrival,
        })  # fmt: skip
    return rows


def errors(rows: list[dict[str, float | str]], what: str) -> np.ndarray:
    real = np.array([float(r[f"real_{what}_s"]) for r in rows])
    sim = np.array([float(r[f"sim_{what}_s"]) for r in rows])
    return (sim - real) / real


def plot(rows: list[dict[str, float | str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, what in zip(axes, ("ttft", "e2el"), strict=True):
        real = [float(r[f"real_{what}_s"]) for r in rows]
        sim = [float(r[f"sim_{what}_s"]) for r in rows]
        replicas = [str(r["replica"]) for r in rows]
        for replica in sorted(set(replicas)):
            pick = [i for i, x in enumerate(replicas) if x == replica]
            ax.scatter([real[i] for i in pick], [sim[i] for i in pick], s=8, label=replica)
        top = max(real + sim)
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        ax.set(xlabel=f"real {what} (s)", ylabel=f"simulated {what} (s)", title=what.upper())
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.sim_vs_real", description=__doc__)
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="embedded")
    parser.add_argument("--url", help="a running server of the deployment (default: start one)")
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    out = args.results / "sim_vs_real-live.json"
    flags = ["--config", str(args.config), "--deployment", args.deployment, "--arrivals",
             "poisson", "--rate", str(args.rate), "--duration", str(args.duration),
             "--seed", str(args.seed)]  # fmt: skip
    if args.url:
        live = run_replay(args.url, out, *flags)
    else:
        with server(args.deployment, None, args.results / "sim_vs_real-server.log") as live_server:
            live = run_replay(live_server.url, out, *flags)
    rows = compare(live, args.deployment, args.config)
    write_csv(args.results / "sim_vs_real.csv", rows)
    plot(rows, args.results / "sim_vs_real.png")
    sent, completed = live["summary"]["sent"], live["summary"]["completed"]
    print(f"{completed} of {sent} requests completed live; compared per request:")
    for what in ("ttft", "e2el"):
        e = errors(rows, what)
        real = np.median([float(r[f"real_{what}_s"]) for r in rows])
        sim = np.median([float(r[f"sim_{what}_s"]) for r in rows])
        spread = np.abs(e)
        print(f"  {what.upper():>5}: median real {real * 1e3:8.1f} ms, sim {sim * 1e3:8.1f} ms; "
              f"per-request error median {np.median(e):+.1%}, median |error| "
              f"{np.median(spread):.1%}, p90 |error| {np.percentile(spread, 90):.1%}")  # fmt: skip
    print(f"wrote {args.results / 'sim_vs_real.csv'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
