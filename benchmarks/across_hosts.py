"""`python -m benchmarks.across_hosts`: the learned router's live mean reward with its fleet split
over hosts, against one host, on the same requests; and the simulator's, on them too.

- **One host**: `python -m serving --deployment paper-4gpu-sim --workers 2` on 127.0.0.1 (the
  supervisor, its 2 workers, and its engine host on a Unix socket).
- **Two hosts**: the same twelve replicas split over 2 engine hosts on TCP (127.0.0.2 runs each
  model's cuda:0 and cuda:1, 127.0.0.3 its cuda:2 and cuda:3), and 2 front-end hosts (127.0.0.4
  and 127.0.0.5) of 1 worker each. The load generator spreads its QUIC connections evenly over
  both front-ends' addresses, and its requests over them in turn (`--also-url`). Each front-end
  sees the other's requests as the engine hosts report them (10 ms apart), and the other's
  arrival rate as the front-ends exchange it through them (`serving.fleet_rate`, every 0.1 s).
- **Two hosts, each on its own arrival rate**: the same with `--no-rate-exchange`, each
  front-end routing on its own arrivals alone (half the fleet's): what the exchange is for.

For each of `--seeds`, the same Poisson workload at `--rate` (the load generator draws it from
the seed, as `experiments.stable --live` does) through fresh servers of each setup, the setups
alternating. Reported: each setup's mean reward with its 95% interval over the seeds, the paired
difference (minus one host, seed by seed), the simulator's on the same requests, the
requests that failed, and each front-end's share of the requests (from its /metrics).

Writes results/across_hosts/across_hosts.csv (and each run's load-generator record and the
servers' logs) and prints the table.

    python -m benchmarks.across_hosts                     # 48 req/s, 3 seeds, 40 s each
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
from tqdm import tqdm

from benchmarks.common import placed_anew
from config import DEFAULT_PATH, Deployment, load_deployment
from experiments.harness import live
from experiments.harness.output import write_csv
from experiments.stable import row
from experiments.stale_view import mean_ci
from router.evaluate import outcomes, simulate
from router.policies import make_policy
from serving.launch import Launched, free_port, launch, serving_command
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec
from workloads.summary import Outcome

ROOT = Path(__file__).resolve().parent.parent
SETUPS = {
    "one-host": "one host, 2 workers",
    "two-hosts": "two hosts, 1 worker each",
    "two-hosts-alone": "two hosts, each on its own arrival rate (--no-rate-exchange)",
}
ENGINE_HOSTS = ("127.0.0.2", "127.0.0.3")
FRONT_ENDS = ("127.0.0.4", "127.0.0.5")
TOKEN = "across-hosts-benchmark-link-token"


def split_config(folder: Path, config: Path, deployment: str, port: int) -> Path:
    """`config` extended with `deployment` split over the two engine hosts at `port`: each
    model's first two devices on the first, the other two on the second, so that its replicas
    stay in the order the DQN was trained on."""
    shipped = load_deployment(config, deployment)
    entries = []
    for model in shipped.models:
        devices = [r.device for r in shipped.replicas if r.model == model]
        half = len(devices) // 2
        for host, mine in zip(ENGINE_HOSTS, (devices[:half], devices[half:]), strict=True):
            entries.append({"model": model, "devices": mine, "engine_host": f"{host}:{port}"})
    return placed_anew(folder, config, deployment, "two-hosts", entries)


@contextlib.contextmanager
def two_hosts(
    folder: Path, config: Path, deployment: str, exchange: bool = True
) -> Iterator[tuple[list[Launched], list[int]]]:
    """The engine hosts and the front-ends, ready; yields the front-ends, and every process."""
    port = free_port()
    split = split_config(folder, config, deployment, port)
    token = folder / "link-token"
    token.write_text(TOKEN)
    with contextlib.ExitStack() as stack:
        engines: list[Launched] = []
        for host in ENGINE_HOSTS:
            command = [sys.executable, "-m", "serving.engine_host", "--config", str(split),
                       "--deployment", "two-hosts", "--listen", f"{host}:{port}",
                       "--link-token-file", str(token)]  # fmt: skip
            started = launch(f"engine host {host}", command, port, "", folder / f"{host}.log",
                             host=host)  # fmt: skip
            stack.enter_context(started)
            engines.append(started.listening())
        front_ends, pids = [], [launched.pid for launched in engines]
        for host in FRONT_ENDS:
            tcp, udp = free_port(), free_port(socket.SOCK_DGRAM)
            flags = ["--config", str(split), "--host", host, "--h3-port", str(udp),
                     "--link-token-file", str(token), "--admission", "deadline",
                     "--request-log", "off"]  # fmt: skip
            flags += [] if exchange else ["--no-rate-exchange"]
            command = serving_command("two-hosts", tcp, *flags)
            started = launch(f"front-end {host}", command, tcp, "/readyz", folder / f"{host}.log",
                             h3_port=udp, host=host)  # fmt: skip
            stack.enter_context(started)
            front_ends.append(started.ready(300))
        yield front_ends, pids + [f.pid for f in front_ends]


def tree_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of the processes `pids` and all their descendants."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = process.cpu_times()
                    total += times.user + times.system
    return total


def replay(urls: list[str], out: Path, flags: list[str], pids: list[int]) -> dict:
    """The load generator over HTTP/3 to `urls` (the first, then --also-url), with the cores
    the servers (`pids` and their children) used while it ran. Its certificate check is off:
    the project's test certificate names 127.0.0.1 only, not the other addresses; both setups
    run so, alike."""
    also = [a for url in urls[1:] for a in ("--also-url", url)]
    cpu = tree_cpu(pids)
    record = live.replay(urls[0], out, *also, "--insecure", *flags, proto="h3")
    record["server_cores"] = (tree_cpu(pids) - cpu) / record["summary"]["duration_s"]
    return record


def one_run(
    args: argparse.Namespace, deployment: Deployment, setup: str, seed: int
) -> dict[str, object]:
    flags = ["--config", str(args.config), "--deployment", args.deployment, "--model", "auto",
             "--connections", str(args.connections), "--arrivals", "poisson", "--rate",
             f"{args.rate:g}", "--duration", f"{args.duration:g}", "--seed", str(seed)]  # fmt: skip
    out = args.out / f"{setup}-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "replay.json"
    shares: list[int] = []
    if setup == "one-host":
        extra = ["--config", str(args.config), "--admission", "deadline", "--request-log", "off",
                 "--workers", "2"]  # fmt: skip
        with live.server(args.deployment, None, out / "server.log", extra=extra,
                         ready_path="/readyz") as server:  # fmt: skip
            urls = [f"https://127.0.0.1:{server.h3_port}"]
            record = replay(urls, record_path, flags, [server.pid])
            shares = [sum(live.requests_total(server.url).values())]
    else:
        exchange = setup == "two-hosts"
        with two_hosts(out, args.config, args.deployment, exchange) as (front_ends, pids):
            urls = [f"https://{f.host}:{f.h3_port}" for f in front_ends]
            record = replay(urls, record_path, flags, pids)
            shares = [sum(live.requests_total(f.url).values()) for f in front_ends]
    done = [Outcome(**o) for o in record["requests"]]
    return (
        {"setup": setup, "served_by_each": "/".join(map(str, shares))}
        | row("dqn", args.rate, seed, done, deployment)
        | live.live_row(record)
    )


def simulated(deployment: Deployment, rate: float, seed: int, duration: float) -> float:
    """The simulator's mean reward on the same requests (the same spec and seed)."""
    done = simulate(deployment, make_policy(deployment), WorkloadSpec(arrivals=Poisson(rate)),
                    seed, duration=duration)  # fmt: skip
    return float(row("dqn", rate, seed, outcomes(deployment, done), deployment)["mean_reward"])  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.across_hosts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="paper-4gpu-sim")
    parser.add_argument("--rate", type=float, default=48.0, help="req/s")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per run")
    parser.add_argument("--connections", type=int, default=4, help="QUIC connections in all")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "across_hosts")
    args = parser.parse_args(argv)
    args.config = args.config.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    deployment = load_deployment(args.config, args.deployment)
    # The setups alternate run by run, so that the VM's drift falls on both alike.
    runs = [(s, setup) for s in range(args.seeds) for setup in SETUPS]
    rows = [one_run(args, deployment, setup, s)
            for s, setup in tqdm(runs, unit="run", desc="live")]  # fmt: skip
    for r in rows:
        r["sim_reward"] = simulated(deployment, args.rate, int(r["seed"]), args.duration)  # type: ignore[call-overload]
    write_csv(args.out / "across_hosts.csv", rows)

    def rewards(setup: str, key: str = "mean_reward") -> list[float]:
        side = sorted((r for r in rows if r["setup"] == setup), key=lambda r: int(r["seed"]))  # type: ignore[call-overload]
        return [float(r[key]) for r in side]  # type: ignore[arg-type]

    one, sim = rewards("one-host"), rewards("one-host", "sim_reward")
    print(f"\n{args.deployment}, DQN, {args.rate:g} req/s, {args.seeds} seeds x "
          f"{args.duration:g} s, over HTTP/3\n")  # fmt: skip
    print(
        "| setup | mean reward | minus one host (paired) | minus the simulator (paired) "
        "| failed | requests served by each front-end |"
    )
    print("|---|---|---|---|---|---|")
    for key, setup in SETUPS.items():
        side = rewards(key)
        m, h = mean_ci(side)
        d1, h1 = mean_ci([b - a for a, b in zip(one, side, strict=True)])
        ds, hs = mean_ci([b - a for a, b in zip(sim, side, strict=True)])
        failed = sum(int(r["errored"]) for r in rows if r["setup"] == key)  # type: ignore[call-overload]
        served = ", ".join(str(r["served_by_each"]) for r in rows if r["setup"] == key)
        print(f"| {setup} | {m:.4f} ± {h:.4f} | {d1:+.4f} ± {h1:.4f} | {ds:+.4f} ± {hs:.4f} "
              f"| {failed} | {served} |")  # fmt: skip
    ms, hs = mean_ci(sim)
    print(f"| the simulator | {ms:.4f} ± {hs:.4f} | | | | |")
    live.warn_of_trouble(rows, args.out)
    print(f"\nwrote {args.out / 'across_hosts.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
