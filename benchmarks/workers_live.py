"""`python -m benchmarks.workers_live`: the learned router's live mean reward with 2 front-end
workers against 1, on the same requests, and the highest rate each holds at 99% SLO.

The twin (`paper-4gpu-sim`) at its own speed, the shipped DQN routing, admission control as the
deployment has it, the load generator over HTTP/3 (4 QUIC connections) as
`experiments.stable --live` sends it: for each of `--rates` and `--seeds`, the same Poisson
workload (same seed, same requests) through a fresh server with `--workers 1` and with
`--workers 2`. Reported per rate: each worker count's mean reward with its 95% confidence
interval over the seeds, and the paired difference (2 minus 1, seed by seed) with its own;
the target is a difference within 0.01. Then, over `--slo-rates` with seed 0, the share of
requests that met their SLO, and the highest rate at 99% or more for each worker count.

Writes results/workers_live/workers_live.csv (and each run's load-generator record) and prints
the tables.

    python -m benchmarks.workers_live                     # 16 and 48 req/s, 3 seeds, 40 s each
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from config import DEFAULT_PATH, Deployment, load_deployment
from experiments.harness import live
from experiments.harness.output import write_csv
from experiments.stable import row
from experiments.stale_view import mean_ci
from workloads.replay import Outcome

ROOT = Path(__file__).resolve().parent.parent


def one_run(
    args: argparse.Namespace, deployment: Deployment, workers: int, rate: float, seed: int
) -> dict[str, object]:
    flags = ["--arrivals", "poisson", "--rate", f"{rate:g}", "--duration", f"{args.duration:g}",
             "--seed", str(seed)]  # fmt: skip
    out = args.out / f"w{workers}-{rate:g}-{seed}.json"
    record = live.run_live(
        args.deployment, args.config, "dqn", flags, out, args.admission,
        server_flags=["--workers", str(workers)],
    )  # fmt: skip
    done = [Outcome(**o) for o in record["requests"]]
    return {"workers": workers} | row("dqn", rate, seed, done, deployment) | live.live_row(record)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.workers_live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="paper-4gpu-sim")
    parser.add_argument("--rates", default="16,48", help="req/s, for the reward")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--slo-rates", default="", help="req/s, for the highest rate at 99%% SLO")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per run")
    parser.add_argument("--admission", choices=["deadline", "none"], default="deadline")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "workers_live")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",") if r]
    slo_rates = [float(r) for r in args.slo_rates.split(",") if r]
    # Worker counts alternate run by run, so that the VM's drift falls on both alike.
    runs = [(r, s, w) for r in rates for s in range(args.seeds) for w in (1, 2)]
    runs += [(r, 0, w) for r in slo_rates if r not in rates for w in (1, 2)]
    deployment = load_deployment(args.config, args.deployment)
    rows = [one_run(args, deployment, w, r, s)
            for r, s, w in tqdm(runs, unit="run", desc="live")]  # fmt: skip
    write_csv(args.out / "workers_live.csv", rows)

    def of(workers: int, rate: float) -> list[dict[str, object]]:
        return sorted((x for x in rows if x["workers"] == workers and x["rate"] == rate),
                      key=lambda x: int(x["seed"]))  # type: ignore[call-overload]  # fmt: skip

    print(f"\n{args.deployment}, DQN, {args.seeds} seeds x {args.duration:g} s, over HTTP/3\n")
    print("| rate | 1 worker | 2 workers | 2 - 1 (paired) | server cores 1 / 2 | failed 1 / 2 |")
    print("|---|---|---|---|---|---|")
    for rate in rates:
        one, two = of(1, rate), of(2, rate)
        r1, r2 = ([float(x["mean_reward"]) for x in side] for side in (one, two))  # type: ignore[arg-type]
        (m1, h1), (m2, h2) = mean_ci(r1), mean_ci(r2)
        diff, half = mean_ci([b - a for a, b in zip(r1, r2, strict=True)])
        cores = [statistics.fmean(float(x["server_cores"]) for x in side) for side in (one, two)]  # type: ignore[arg-type]
        failed = [sum(int(x["errored"]) for x in side) for side in (one, two)]  # type: ignore[call-overload]
        print(f"| {rate:g} req/s | {m1:.4f} ± {h1:.4f} | {m2:.4f} ± {h2:.4f} "
              f"| {diff:+.4f} ± {half:.4f} | {cores[0]:.2f} / {cores[1]:.2f} "
              f"| {failed[0]} / {failed[1]} |")  # fmt: skip
    if slo_rates:
        print("\n| rate | SLO met, 1 worker | 2 workers |\n|---|---|---|")
        for rate in slo_rates:
            slo = [float(of(w, rate)[0]["slo"]) for w in (1, 2)]  # type: ignore[arg-type]
            print(f"| {rate:g} req/s | {slo[0]:.4f} | {slo[1]:.4f} |")
        for workers in (1, 2):
            held = [r for r in slo_rates if float(of(workers, r)[0]["slo"]) >= 0.99]  # type: ignore[arg-type]
            print(f"highest rate at >= 99% SLO, {workers} worker(s): "
                  f"{max(held) if held else 'none'} req/s")  # fmt: skip
    live.warn_of_trouble(rows, args.out)
    print(f"\nwrote {args.out / 'workers_live.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
