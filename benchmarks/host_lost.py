"""`python -m benchmarks.host_lost`: an engine host lost under load, and found again through DNS.

The twin's `paper-4gpu-sim` as a fleet: its twelve replicas as 2 engine hosts behind one DNS
name (`hosts: 2`, each host running every model on two devices), answered by a real DNS server
(dnsmasq); 2 front-end hosts of 1 worker each, which find the engine hosts through it; the load
generator over HTTP/3, spread over both front-ends, at `--rate` for `--duration` seconds. Each
"host" is a loopback address of its own (127.0.0.2-5).

At `--kill-at` seconds every process of the second engine host is killed with SIGKILL; a second
later its address leaves DNS (as a pod whose readiness fails leaves its Service); at
`--back-at` it starts again, and its address returns to DNS once it listens. A run of the same
workload with no host lost goes first, for the surviving host's SLO attainment to compare with.

Reported, against the targets of issue 56:
- the failed requests, and whether each is one the rules allow: on the lost host's replicas,
  and already streaming (one that had no token yet goes on at another replica); the client,
  the request logs and /metrics (both front-ends) counting the same;
- how long after the kill each front-end had the lost host's replicas down (its link lost);
- how long after the host listened again each front-end had found it through DNS, and had
  routed a request to it;
- the SLO attainment of the requests on the surviving host's replicas while the other was
  down, in this run and in the run without a loss.

Writes results/host_lost/ (each run's records and logs, host_lost.json) and prints the table.

    python -m benchmarks.host_lost                        # 48 req/s, 40 s, kill at 15, back at 25
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from benchmarks.common import placed_anew, server_counts
from benchmarks.dnsmasq import Dnsmasq
from config import DEFAULT_PATH, load_deployment
from experiments.harness import live
from serving.launch import Launched, free_port, launch, serving_command
from workloads.summary import Outcome

ROOT = Path(__file__).resolve().parent.parent
NAME = "engines.fleet.test"
ENGINE_HOSTS = ("127.0.0.2", "127.0.0.3")
FRONT_ENDS = ("127.0.0.4", "127.0.0.5")
TOKEN = "host-lost-benchmark-link-token-0"


def fleet_config(folder: Path, config: Path, deployment: str, port: int) -> Path:
    """`config` extended with `deployment` as a fleet of 2 engine hosts behind NAME: each
    model's replicas on two devices of each host, so that the view keeps the order (and the
    count) the DQN was trained on."""
    shipped = load_deployment(config, deployment)
    entries = []
    for model in shipped.models:
        devices = [r.device for r in shipped.replicas if r.model == model]
        entries.append({"model": model, "devices": devices[: len(devices) // 2],
                        "engine_host": f"{NAME}:{port}", "hosts": len(ENGINE_HOSTS)})  # fmt: skip
    return placed_anew(folder, config, deployment, "fleet", entries)


@dataclass
class Fleet:
    folder: Path
    config: Path
    port: int
    dns: Dnsmasq
    engines: dict[str, Launched] = field(default_factory=dict)
    front_ends: list[Launched] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start_engine_host(self, host: str) -> float:
        """Start the engine host at `host`; when it listens (time.time())."""
        command = [sys.executable, "-m", "serving.engine_host", "--config", str(self.config),
                   "--deployment", "fleet", "--listen", f"{host}:{self.port}",
                   "--as", f"{NAME}:{self.port}", "--link-token-file",
                   str(self.folder / "link-token")]  # fmt: skip
        log = self.folder / f"engines-{host}-{len(self.engines)}.log"
        started = launch(f"engine host {host}", command, self.port, "", log, host=host)
        self.engines[host] = started.listening()
        return time.time()


@contextlib.contextmanager
def fleet(folder: Path, config: Path, deployment: str) -> Iterator[Fleet]:
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (folder / "link-token").write_text(TOKEN)
    dns = Dnsmasq(folder)
    running = Fleet(folder, fleet_config(folder, config, deployment, port), port, dns)
    try:
        for host in ENGINE_HOSTS:
            running.start_engine_host(host)
        dns.set(NAME, *ENGINE_HOSTS)
        for host in FRONT_ENDS:
            tcp, udp = free_port(), free_port(socket.SOCK_DGRAM)
            log = folder / f"requests-{host}.log"
            flags = ["--config", str(running.config), "--host", host, "--h3-port", str(udp),
                     "--link-token-file", str(folder / "link-token"), "--dns-server", dns.server,
                     "--admission", "deadline", "--request-log", str(log)]  # fmt: skip
            started = launch(f"front-end {host}", serving_command("fleet", tcp, *flags), tcp,
                             "/readyz", folder / f"front-end-{host}.log", h3_port=udp,
                             host=host)  # fmt: skip
            running.front_ends.append(started)
            running.logs.append(log)
            started.ready(300)
        yield running
    finally:
        for launched in [*running.front_ends, *running.engines.values()]:
            launched.stop()
        dns.stop()


def log_time(line: str) -> float:
    """The time.time() of a log line's timestamp (local time, as logging writes it)."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first(log: Path, text: str, after: float) -> float | None:
    """When `text` first appears in `log` at or after `after`."""
    for line in log.read_text().splitlines():
        if text in line and line[:4].isdigit() and (at := log_time(line)) >= after - 0.001:
            return at
    return None


def one_run(args: argparse.Namespace, lose: bool) -> dict:
    folder = args.out / ("lost" if lose else "baseline")
    events: dict[str, float] = {}
    with fleet(folder, args.config, args.deployment) as running:
        urls = [f"https://{f.host}:{f.h3_port}" for f in running.front_ends]
        lost = ENGINE_HOSTS[1]

        def lose_a_host() -> None:
            time.sleep(args.kill_at)
            os.killpg(running.engines[lost].process.pid, signal.SIGKILL)
            events["killed"] = time.time()
            time.sleep(1.0)
            running.dns.set(NAME, ENGINE_HOSTS[0])
            events["left_dns"] = time.time()
            time.sleep(max(0.0, args.back_at - args.kill_at - 1.0))
            events["listening"] = running.start_engine_host(lost)
            running.dns.set(NAME, *ENGINE_HOSTS)
            events["back_in_dns"] = time.time()

        timeline = threading.Thread(target=lose_a_host, daemon=True)
        flags = ["--config", str(args.config), "--deployment", args.deployment, "--model",
                 "auto", "--connections", "4", "--arrivals", "poisson", "--rate",
                 f"{args.rate:g}", "--duration", f"{args.duration:g}", "--seed",
                 str(args.seed)]  # fmt: skip
        also = [a for url in urls[1:] for a in ("--also-url", url)]
        if lose:
            timeline.start()
        record = live.replay(urls[0], folder / "replay.json", *also, "--insecure", *flags,
                             proto="h3")  # fmt: skip
        if lose:
            timeline.join()
        time.sleep(1.0)  # the last log lines
        counts = [server_counts(f.url, log) for f, log in zip(running.front_ends, running.logs,
                                                              strict=True)]  # fmt: skip
        address = f"{lost}:{running.port}"
        front_logs = [f.log for f in running.front_ends]
    done = [Outcome(**o) for o in record["requests"]]
    result: dict = {"events": events, "summary": record["summary"], "counts": counts,
                    "run_started": record["run_started"]}  # fmt: skip
    result["outcomes"] = done
    if lose:
        killed = events["killed"]
        result["down_after_s"] = [
            (at - killed) if (at := first(log, f"engine link to {address} lost", killed)) else None
            for log in front_logs
        ]
        back = events["listening"]
        result["found_after_s"] = [
            (at - back) if (at := first(log, f"engine host {address} found behind", back)) else None
            for log in front_logs
        ]
        result["found_line"] = f"engine host {address} found behind"
    return result


OK = ("ok",)
"""The request log's and /metrics' outcome of a request served whole."""


def on_slot(outcome: Outcome, slot: int) -> bool:
    return outcome.replica is not None and f"#{slot}/" in outcome.replica


def slo(outcomes: list[Outcome], start: float, end: float, slot: int) -> tuple[float, int]:
    """SLO attainment of the requests on `slot`'s replicas that arrived in [start, end)."""
    chosen = [o for o in outcomes if start <= o.arrival_s < end and on_slot(o, slot)]
    return (sum(o.slo_met for o in chosen) / len(chosen) if chosen else float("nan")), len(chosen)


def seconds(times: list[float | None]) -> str:
    return ", ".join(f"{t:.3f} s" if t is not None else "never" for t in times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_lost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--deployment", default="paper-4gpu-sim")
    parser.add_argument("--rate", type=float, default=48.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--kill-at", type=float, default=15.0)
    parser.add_argument("--back-at", type=float, default=25.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "host_lost")
    args = parser.parse_args(argv)
    args.config = args.config.resolve()
    base, lost = one_run(args, lose=False), one_run(args, lose=True)

    # Slot 0 is the first address (127.0.0.2, which survives); the lost host holds slot 1.
    ended = [o for o in lost["outcomes"] if not o.completed]
    # Admission control's refusals (429 with Retry-After) are no failure of the lost host: with
    # half the replicas gone, what none could start in time is refused at the door, by design.
    refused = [o for o in ended if o.status == 429]
    failed = [o for o in ended if o.status != 429]
    allowed = [o for o in failed if on_slot(o, 1) and (o.output_tokens > 0 or o.ttft_s)]
    base_refused = sum(1 for o in base["outcomes"] if o.status == 429)
    # On the load generator's clock, whose 0 is its first arrival (`arrival_s`).
    events = {k: v - lost["run_started"] for k, v in lost["events"].items()}
    kill, back = events["killed"], events["listening"]
    logged = sum(sum(v for k, v in c["logged"].items() if k not in OK) for c in lost["counts"])
    counted = sum(sum(v for k, v in c["outcomes"].items() if k not in OK) for c in lost["counts"])
    survivor_lost, n_lost = slo(lost["outcomes"], kill, back, 0)
    survivor_base, n_base = slo(base["outcomes"], kill, back, 0)
    found = lost["found_after_s"]
    used = []
    for o in sorted(lost["outcomes"], key=lambda o: o.arrival_s):
        if o.arrival_s > back and on_slot(o, 1) and o.completed:
            used.append(o.arrival_s)
            break
    print(f"\n{args.deployment} as a fleet of 2 engine hosts (DNS) and 2 front-ends, "
          f"{args.rate:g} req/s for {args.duration:g} s, seed {args.seed}; host 127.0.0.3 "
          f"killed at {kill:.1f} s, listening again at {back:.1f} s\n")  # fmt: skip
    print("| what | measured |\n|---|---|")
    print(f"| requests sent / refused by admission control (429) / failed | "
          f"{len(lost['outcomes'])} / {len(refused)} / {len(failed)} |")  # fmt: skip
    print(f"| refused (429) in the run with no loss | {base_refused} |")
    print(f"| failed ones the rules allow (on the lost host, already streaming) | "
          f"{len(allowed)} of {len(failed)} |")  # fmt: skip
    print(f"| refused or failed, by the client / request logs / /metrics | {len(ended)} / "
          f"{logged} / {counted} |")  # fmt: skip
    print(f"| retried at another replica (both front-ends) | "
          f"{sum(sum(c['retries'].values()) for c in lost['counts'])} |")  # fmt: skip
    print(f"| lost host's replicas down, after the kill (each front-end) | "
          f"{seconds(lost['down_after_s'])} |")  # fmt: skip
    print(f"| found through DNS, after it listened again (each front-end) | {seconds(found)} |")
    print(f"| first request it served after its return, sent after it listened by | "
          f"{(used[0] - back) if used else float('nan'):.2f} s |")  # fmt: skip
    print(f"| SLO on the surviving host, {kill:.1f}-{back:.1f} s: this run / no loss | "
          f"{survivor_lost:.4f} ({n_lost}) / {survivor_base:.4f} ({n_base}) |")  # fmt: skip
    print(f"| SLO of the whole run: this run / no loss | {lost['summary']['slo_attainment']:.4f} / "
          f"{base['summary']['slo_attainment']:.4f} |")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in lost.items() if k != "outcomes"}
    keep["baseline_summary"] = base["summary"]
    (args.out / "host_lost.json").write_text(json.dumps(keep, indent=1, default=str))
    print(f"\nwrote {args.out / 'host_lost.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
