"""`python -m benchmarks.prefix_twin`: the workload of KubeAI's benchmark through the real
server, on the live twin (`kubeai-l4-sim`: eight simulated L4 replicas of Llama 3.1 8B in real
time), and whether every request is accounted for, in calm and in storms.

The server (`python -m serving --deployment kubeai-l4-sim --policy P --time-scale K`, HTTP/1.1,
request log on) on CPU 0; the load (`python -m workloads.replay --kubeai-benchmark --num-requests N
--rate R --max-concurrency C --classes long`) on CPU 1. The engines run K times slower than
the profile (at 1, eight replicas at concurrency 800 stream about 10,000 tokens a second, more
than one core carries beside the client), and no class has a deadline (KubeAI's benchmark client
had none): TTFT is reported in the profile's time, divided by K. Scenarios:
- `calm`: each policy in turn;
- `client-killed`: the client SIGKILLed `--kill-after` seconds in, then another 300 requests;
- `engines-die`: two of the eight engines die 12 s in (`simulation.faults`), back 5 s later.

With `--deployment paper-4gpu-sim --lengths NAME`, the same scenarios on the twin of the deployment
in Chuppala (2024), the load a length distribution's requests (`workloads.replay --lengths`, every
class alike, the classes' deadlines kept), and `--policies` DQN files side by side: how the router
that reads each request's lengths (its prompt tokens, max_tokens and expected output) and the one
before it hold in the storm.

For each run: the client's completed and failed requests, the server's `serving_requests_total`
by outcome and its request log's lines, and what `serving_replica_in_flight` holds after: they
must agree, and in-flight must be back at 0.

    python -m benchmarks.prefix_twin                                   # calm, RR and precise
    python -m benchmarks.prefix_twin --scenario engines-die --requests 1500 --concurrency 200
    python -m benchmarks.prefix_twin --scenario client-killed --concurrency 300
    python -m benchmarks.prefix_twin --deployment paper-4gpu-sim --lengths conversations \
        --time-scale 1 --rate 64 --requests 1900 --scenario engines-die \
        --policies router/trained/paper-4gpu-lengths.npz,router/trained/paper-4gpu.npz
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from config import load_deployment
from serving.launch import ROOT, Launched, free_port, launch, shipped_spec
from workloads.lengths import ALL as LENGTHS

KUBEAI_TWIN = "kubeai-l4-sim"
DYING = {
    KUBEAI_TWIN: ["cuda:0/llama-3.1-8b-fp8", "cuda:3/llama-3.1-8b-fp8"],
    "paper-4gpu-sim": ["cuda:0/opt-6.7b", "cuda:1/opt-1.3b"],
}
"""The two engines that die in `engines-die`, per deployment."""
KEY = "prefix-twin-premium-key"
"""The load's API key with --lengths, whose classes include real-time (the premium tier's)."""


def config(folder: Path, deployment: str, faults: bool) -> Path:
    """The shipped models.yaml, with no class deadline on the twin of KubeAI's benchmark (its
    client had none), and with `faults`, two dying engines."""
    spec = shipped_spec()
    if deployment == KUBEAI_TWIN:
        for qos_class in spec["qos_classes"].values():
            qos_class["deadline_s"] = 3600.0
    if faults:
        spec["deployments"][deployment]["simulation"]["faults"] = {
            "replicas": DYING[deployment], "fail_after_s": 12.0, "restart_s": 5.0,
        }  # fmt: skip
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def start_server(
    folder: Path, tag: str, policy: str, args: argparse.Namespace, faults: bool
) -> Launched:
    """`policy`: a policy's name, or a DQN's file (`serving --policy-file`)."""
    port = free_port()
    chosen = ["--policy", "dqn", "--policy-file", policy] if policy.endswith(".npz") else [
        "--policy", policy]  # fmt: skip
    command = [sys.executable, "-m", "serving", "--config",
               str(config(folder, args.deployment, faults)), "--deployment", args.deployment,
               *chosen, "--port", str(port), "--h3-port", "0", "--time-scale", str(args.time_scale),
               "--request-log", str(folder / f"{tag}-requests.jsonl")]  # fmt: skip
    env = {"QOS_PREMIUM_KEY": KEY}
    return launch(tag, command, port, "/readyz", folder / f"{tag}.log", env, cpus={0}).ready(120)


def load(url: str, out: Path, args: argparse.Namespace, requests: int, kill_after: float = 0.0
         ) -> dict | None:  # fmt: skip
    """The client's summary; None where it was killed."""
    if args.lengths:
        classes = ",".join(load_deployment(name=args.deployment).qos_classes)
        workload = ["--lengths", args.lengths, "--classes", classes, "--api-key", KEY,
                    "--deployment", args.deployment]  # fmt: skip
    else:
        workload = ["--kubeai-benchmark", "--classes", "long"]
    command = [sys.executable, "-m", "workloads.replay", "--proto", "h1", "--url", url,
               *workload, "--num-requests", str(requests), "--rate", str(args.rate),
               "--max-concurrency", str(args.concurrency),
               "--seed", str(args.seed), "--no-progress", "--out", str(out)]  # fmt: skip
    cpus = set(range(1, os.cpu_count() or 2)) or {0}
    client = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: os.sched_setaffinity(0, cpus))  # fmt: skip
    if kill_after:
        time.sleep(kill_after)
        client.kill()
        client.wait()
        return None
    client.wait()
    return json.loads(out.read_text())["summary"]


def server_counts(url: str, request_log: Path) -> dict:
    outcomes: Counter[str] = Counter()
    in_flight = 0.0
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "serving_requests_total":
                outcomes[sample.labels["outcome"]] += int(sample.value)
            elif sample.name == "serving_replica_in_flight":
                in_flight += sample.value
    logged = Counter(json.loads(line)["outcome"] for line in request_log.read_text().splitlines())
    return {"outcomes": dict(outcomes), "logged": dict(logged), "in_flight": in_flight}


def row(
    tag: str, policy: str, scale: float, summary: dict | None, server: dict, before: int = 0
) -> dict:
    """One run's line; `before`: the requests the server had logged before it."""
    out = {"run": tag, "policy": policy, **server, "new": sum(server["logged"].values()) - before}
    if summary is not None:
        out |= {
            "sent": summary["sent"], "completed": summary["completed"],
            "failed": summary["errored"], "errors": summary["errors"],
            "mean_ttft_ms": summary["mean_ttft_ms"] / scale,
            "p99_ttft_ms": summary["p99_ttft_ms"] / scale,
            "req_per_s": summary["request_throughput"] * scale,
            "slo": summary["slo_attainment"], "mean_reward": summary.get("mean_reward"),
        }  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    folder = args.out
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    faults = args.scenario == "engines-die"
    for policy in args.policies.split(","):
        tag = "-".join([args.scenario, *Path(policy).with_suffix("").parts[-2:]])
        with start_server(folder, tag, policy, args, faults) as server:
            log = folder / f"{tag}-requests.jsonl"
            if args.scenario == "client-killed":
                load(server.url, folder / f"{tag}.json", args, args.requests, args.kill_after)
                time.sleep(2)  # the server sees the connections close
                killed = server_counts(server.url, log)
                rows.append(row(f"{tag} (killed)", policy, args.time_scale, None, killed))
                summary = load(server.url, folder / f"{tag}-after.json", args, 300)
                time.sleep(2)
                rows.append(row(f"{tag} (then 300 more)", policy, args.time_scale, summary,
                                server_counts(server.url, log), rows[-1]["new"]))  # fmt: skip
            else:
                summary = load(server.url, folder / f"{tag}.json", args, args.requests)
                time.sleep(2)
                counts = server_counts(server.url, log)
                rows.append(row(tag, policy, args.time_scale, summary, counts))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefix_twin", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--scenario", choices=("calm", "client-killed", "engines-die"),
                        default="calm")  # fmt: skip
    parser.add_argument("--deployment", default=KUBEAI_TWIN, choices=list(DYING))
    parser.add_argument("--lengths", choices=list(LENGTHS),
                        help="the load: this length distribution's requests (workloads.lengths, "
                        "every class of the deployment alike); default: KubeAI's benchmark "
                        "prompts")  # fmt: skip
    parser.add_argument("--policies", default="round-robin,prefix-precise",
                        help="policy names, or DQN files (.npz), comma-separated")  # fmt: skip
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=800)
    parser.add_argument("--rate", type=float, default=800.0)
    parser.add_argument("--time-scale", type=float, default=5.0)
    parser.add_argument("--kill-after", type=float, default=20.0, help="client-killed: s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "prefix_twin")
    args = parser.parse_args(argv)
    rows = run(args)
    (args.out / f"{args.scenario}.json").write_text(json.dumps(rows, indent=1))
    lost = [
        r["run"] for r in rows
        if r["in_flight"] or sum(r["outcomes"].values()) != sum(r["logged"].values())
        or ("sent" in r and r["sent"] != r["new"])
    ]  # fmt: skip
    print("every request accounted for" if not lost else f"NOT accounted for: {lost}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
