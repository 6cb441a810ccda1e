"""`python -m experiments.paths_live`: the network-aware router against the network-blind one,
live, with clients on the four emulated paths of the `mixed` mix at once (the target: +0.05 of mean
reward for the network-aware one over the blind one).

The same requests as `experiments.paths`' simulation, each from a client on the path the
simulator drew for it (`router.paths.ClientPaths`, the same seed): the star topology of
`netsim.netem`, one client namespace a path, each behind its own emulated link (the mix's
rate, delay and loss; Chatterbox's Gilbert-Elliott chain on the bad one), and the real server
(`python -m serving --deployment paper-4gpu-sim`, the digital twin of the paper deployment) in
the server namespace: network-blind as it ships, network-aware with `--paths mixed`. Each path's
clients are one load generator (`python -m workloads.replay --requests`) spreading its requests
over `--connections` QUIC connections (8: many clients behind each kind of link, where the
simulator has each request a client of its own; with one, a lossy path's one congestion window
carries all of its requests), and the four start on one clock (`--start-at`). A request scores
its model's quality if its last token reached its client within the SLO of its scheduled
sending, as `experiments.transport_macro_live` scores it; the simulator's score of the same
requests is printed beside.

    python -m experiments.paths_live             # 1, 4, 16 req/s x 40 s; 120 s unpredictable
    python -m experiments.paths_live --rates 4 --seconds 0   # one stable run only

Needs root, as the emulator does. Writes results/paths_live/ (runs.csv, and each run's
load-generator records, request files and server log).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from config import Deployment, load_deployment
from experiments.harness.live import cpu_seconds
from experiments.harness.output import as_float, write_csv
from experiments.path_delivery import link_of
from experiments.paths import policies as sim_policies
from experiments.transport_macro import met_at_client, score
from experiments.transport_macro_live import as_delivery
from experiments.transport_micro import CONGESTION_CONTROL
from netsim.netem import Netem, NetemError, check_can_run
from router.evaluate import mean_reward, simulate
from router.paths import ClientPaths
from workloads.arrivals import ArrivalProcess, Poisson, SwitchingRate
from workloads.generate import WorkloadSpec, requests
from workloads.request import Request, save_requests
from workloads.summary import Outcome

OUT = Path("results/paths_live")
ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENT = "paper-4gpu-sim"
MIX = "mixed"
POLICIES = ("dqn-blind", "dqn-net")
KEY = "paths-live-key"
"""The premium key the load generators send, so that real-time is a class they may ask for."""
HTTP_PORT, H3_PORT = 8000, 8443
SCHEDULER = "edf"
START_AFTER_S = 10.0
"""From starting the load generators to arrival 0: time for the four to start and connect."""
TIMEOUT_AFTER_RUN_S = 10.0
LOG_WAIT_S = 10.0
"""How long the server may take to hear that its last answers arrived (`_settle`)."""
DRAIN_S = 5.0
"""The server's drain at the end of a run: what is still open then is cut and logged."""


def workload(
    arrivals: ArrivalProcess, deployment: Deployment, seed: int, seconds: float
) -> tuple[WorkloadSpec, list[Request], list[str]]:
    """The requests of one run, as `experiments.paths` simulates them, and each one's path."""
    spec = WorkloadSpec(arrivals=arrivals, classes=dict.fromkeys(deployment.qos_classes, 1))
    assert deployment.paths is not None
    clients = ClientPaths(deployment.paths, seed)
    batch = list(requests(spec, seed, seconds))
    return spec, batch, [clients.draw().name for _ in batch]


def live_run(
    policy: str, name: str, batch: Sequence[Request], paths: Sequence[str], deployment: Deployment,
    seconds: float, seed: int, folder: Path, connections: int,
) -> tuple[dict[str, Outcome], float]:  # fmt: skip
    """One live run on a fresh emulator and server: each request's outcome, and the server's
    CPU in cores over the run. `connections`: QUIC connections each path's load generator
    spreads its requests over."""
    assert deployment.paths is not None
    names = list(deployment.paths.paths)
    links = [link_of(deployment.paths.paths[p], seed * 10 + i) for i, p in enumerate(names)]
    env = {"QOS_PREMIUM_KEY": KEY}
    folder.mkdir(parents=True, exist_ok=True)
    with Netem(links, topology="star", clients=len(names)) as net:
        host = net.server_address
        server = [
            sys.executable, "-m", "serving", "--deployment", DEPLOYMENT, "--host", host,
            "--port", str(HTTP_PORT), "--h3-port", str(H3_PORT), "--scheduler", SCHEDULER,
            "--congestion-control", CONGESTION_CONTROL,
            "--request-log", str(folder / f"{name}.requests-log.jsonl"), "--drain-s", str(DRAIN_S),
            *(["--paths", MIX] if policy == "dqn-net" else []),
        ]  # fmt: skip
        log = folder / f"{name}.server.log"
        with log.open("wb") as server_log:
            served = net.popen(
                net.server, server, cwd=ROOT, env=env, stdout=server_log, stderr=server_log
            )
        waiter = net.popen(
            net.server,
            [sys.executable, "-m", "experiments.transport_macro_live", "wait",
             f"http://{host}:{HTTP_PORT}"],
            cwd=ROOT,
        )  # fmt: skip
        while waiter.poll() is None:
            if served.poll() is not None:
                waiter.kill()
            time.sleep(0.2)
        if waiter.returncode != 0:
            raise RuntimeError(f"{name}: the server did not start; its log ends:\n"
                               f"{log.read_text()[-2000:]}")  # fmt: skip
        start_at = time.time() + START_AFTER_S
        senders = []
        for i, path in enumerate(names):
            mine = [r for r, p in zip(batch, paths, strict=True) if p == path]
            if not mine:  # a short run may draw no client on a rare path
                continue
            wanted = folder / f"{name}.{path}.requests.jsonl"
            save_requests(wanted, mine)
            client = [
                sys.executable, "-m", "workloads.replay", "--requests", str(wanted),
                "--proto", "h3", "--scheduler", SCHEDULER, "--congestion-control",
                CONGESTION_CONTROL, "--url", f"https://{host}:{H3_PORT}", "--insecure",
                "--deployment", DEPLOYMENT, "--api-key", KEY, "--connections", str(connections),
                "--timeout", str(seconds + TIMEOUT_AFTER_RUN_S), "--start-at", f"{start_at:.3f}",
                "--out", str(folder / f"{name}.{path}.json"), "--no-progress",
            ]  # fmt: skip
            with (folder / f"{name}.{path}.client.log").open("wb") as client_log:
                senders.append(net.popen(
                    net.clients[i], client, cwd=ROOT, env=env, stdout=client_log,
                    stderr=client_log,
                ))  # fmt: skip
        before = cpu_seconds(served.pid)
        started = time.monotonic()
        for sender in senders:
            # Past this a load generator is stuck: killed at the emulator's teardown, it leaves
            # no record, which the run reports below.
            with contextlib.suppress(subprocess.TimeoutExpired):
                sender.wait(START_AFTER_S + seconds + TIMEOUT_AFTER_RUN_S + 120)
        if served.poll() is not None:
            raise RuntimeError(f"{name}: the server exited ({served.returncode}) during the run; "
                               f"its log ends:\n{log.read_text()[-2000:]}")  # fmt: skip
        cores = (cpu_seconds(served.pid) - before) / max(1e-9, time.monotonic() - started)
        _settle(served, folder / f"{name}.requests-log.jsonl", len(batch))
    outcomes: dict[str, Outcome] = {}
    for path in dict.fromkeys(paths):
        record = folder / f"{name}.{path}.json"
        if not record.exists():
            raise RuntimeError(f"{name}: the {path} client wrote no record; see "
                               f"{folder / f'{name}.{path}.client.log'}")  # fmt: skip
        for o in json.loads(record.read_text())["requests"]:
            outcomes[o["request_id"]] = Outcome(**o)
    return outcomes, cores


def _settle(served: subprocess.Popen[bytes], request_log: Path, requests: int) -> None:
    """Let the server log every request before the emulator goes. It logs an answer once its
    client has acknowledged the last byte, which on a lossy path can come after the client has
    the answer and has exited (one CI run read 26 lines for 27 requests); past LOG_WAIT_S, a
    graceful stop ends what is left, and logs it as stopped."""
    deadline = time.monotonic() + LOG_WAIT_S
    while time.monotonic() < deadline:
        if request_log.exists() and len(request_log.read_text().splitlines()) >= requests:
            return
        time.sleep(0.2)
    served.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        served.wait(DRAIN_S + 10)


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    deployment = load_deployment(args.config, "paper-4gpu", MIX)
    made = sim_policies(deployment, None)
    phases: list[tuple[str, str, ArrivalProcess, float]] = [
        ("stable", f"{rate:g}", Poisson(rate), args.rate_seconds) for rate in args.rates
    ]
    if args.seconds > 0:
        phases.append(("unpredictable", "all", SwitchingRate(), args.seconds))
    rows = []
    for kind, phase, arrivals, seconds in tqdm(phases, unit="phase", desc="live"):
        spec, batch, paths = workload(arrivals, deployment, args.seed, seconds)
        for policy in POLICIES:
            name = f"{policy}-{kind}-{phase}-s{args.seed}"
            outcomes, cores = live_run(
                policy,
                name,
                batch,
                paths,
                deployment,
                seconds,
                args.seed,
                args.results,
                args.connections,
            )
            simulated = simulate(deployment, made[policy](), spec, args.seed, duration=seconds)
            done = [as_delivery(r, outcomes[r.request_id]) for r in batch]
            row: dict[str, object] = {
                "policy": policy, "workload": kind, "phase": phase, "seed": args.seed,
                "requests": len(batch),
                "live": round(statistics.fmean(score(deployment, d) for d in done), 4),
                "simulated": round(mean_reward(deployment, simulated), 4),
                "slo_live": round(statistics.fmean(met_at_client(deployment, d) for d in done), 4),
                "errors": sum(d.status not in (None, 200) for d in done),
                "unfinished": sum(d.status is None for d in done),
                "server_cores": round(cores, 3),
            }  # fmt: skip
            for path in dict.fromkeys(paths):
                mine = [d for d, p in zip(done, paths, strict=True) if p == path]
                row[f"live:{path}"] = round(statistics.fmean(score(deployment, d) for d in mine), 4)
            rows.append(row)
            tqdm.write(f"{name}: live {row['live']:.4f}, simulated {row['simulated']:.4f}")
            write_csv(args.results / "runs.csv", rows)
    return rows


def report(rows: Sequence[dict[str, object]]) -> list[str]:
    """The network-aware DQN's gain over the network-blind one, live and simulated, per
    workload (a stable workload's score is the mean over its rates)."""
    lines = []
    print(f"\n{'workload':14} {'policy':10} {'live':>8} {'simulated':>10}")
    for kind in ("stable", "unpredictable"):
        means = {}
        for policy in POLICIES:
            mine = [r for r in rows if r["workload"] == kind and r["policy"] == policy]
            if not mine:
                continue
            means[policy] = tuple(
                statistics.fmean(as_float(r[k]) for r in mine) for k in ("live", "simulated")
            )
            print(f"{kind:14} {policy:10} {means[policy][0]:>8.4f} {means[policy][1]:>10.4f}")
        if len(means) == 2:
            live = means["dqn-net"][0] - means["dqn-blind"][0]
            sim = means["dqn-net"][1] - means["dqn-blind"][1]
            verdict = "PASS" if live >= 0.05 else "MISS"
            lines.append(f"{verdict} {kind}, live: network-aware {live:+.4f} against network-blind "
                         f"(simulated {sim:+.4f}; target +0.05)")  # fmt: skip
    for line in lines:
        print(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.paths_live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=ROOT / "models.yaml")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=[1.0, 4.0, 16.0])  # fmt: skip
    parser.add_argument("--rate-seconds", type=float, default=40.0)
    parser.add_argument("--seconds", type=float, default=120.0, help="unpredictable; 0: none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--connections",
        type=int,
        default=8,
        help="QUIC connections a path's load generator spreads its requests over: the clients "
        "behind each link (the simulator has each request a client of its own)",
    )
    parser.add_argument("--results", type=Path, default=OUT)
    args = parser.parse_args()
    if args.rate_seconds <= 0 or args.seconds < 0 or any(r <= 0 for r in args.rates):
        parser.error("--rates and --rate-seconds must be above 0, --seconds at least 0")
    if args.connections < 1:
        parser.error("--connections must be at least 1")
    try:
        check_can_run()
    except NetemError as exc:
        parser.error(str(exc))
    rows = run(args)
    report(rows)
    print(f"wrote {args.results / 'runs.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
