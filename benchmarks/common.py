"""What several benchmarks share: the upstreams they put behind a gateway (null servers and real
`vllm serve`), the peers' gateways (sglang-router, vllm-router) from a virtual environment of
their own, the models.yaml that names the upstreams, where results go, the timer and machine of
the microbenchmarks, and the storms on a live twin (`storm_runs`: calm, a client killed, engines
dying; every request accounted for)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from serving.launch import ROOT, Launched, free_port, launch, shipped_spec

MODEL = "null"
"""What the upstreams serve."""


ASKED = "opt-125m"
"""What the load asks for: the model of our deployment's replicas; the upstreams ignore it and the
peers pass it through."""


def placed_anew(
    folder: Path, config: Path, deployment: str, name: str, entries: list[dict]
) -> Path:
    """models.yaml at `folder`, extending `config` with deployment `name`: `deployment` as it
    is but for its placement, which is `entries` (placed over hosts, say)."""
    spec = yaml.safe_load(config.read_text())["deployments"][deployment]
    overlay = {"extends": str(config.resolve()), "placements": {name: entries},
               "deployments": {name: {**spec, "placement": name}}}  # fmt: skip
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(overlay, sort_keys=False))
    return path


def remote_config(
    folder: Path, urls: list[str], model: str = "opt-125m", served: str = MODEL,
    name: str = "bench-upstreams", each: Sequence[dict] = (), tokenizer: Path | None = None,
    **settings: object,
) -> Path:  # fmt: skip
    """The shipped models.yaml plus a deployment `name`: the upstreams as replicas of one model
    (`model`, served as `served`; `each`: more keys for each one's placement entry), its other
    settings the `remote` deployment's, then `settings`. `tokenizer`: a folder the model's
    source points at, so that the gateway counts prompts with it (the shipped source of
    opt-125m, a hub name, is not on the machine, and the gateway routes uncounted)."""
    spec = shipped_spec()
    if tokenizer is not None:
        spec["models"][model]["source"] = str(tokenizer)
    spec["placements"][name] = [
        {"model": model, "url": url + "/v1", "served_name": served, **(each[i] if each else {})}
        for i, url in enumerate(urls)
    ]
    spec["deployments"][name] = {**spec["deployments"]["remote"], "placement": name, **settings}
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def start_upstreams(
    stack: ExitStack, folder: Path, paces: list[tuple[float, float]], max_num_seqs: int = 0
) -> list[str]:
    """Null upstreams, one per (first-token ms, token-gap ms), on CPU 1 where there is one;
    stopped when `stack` closes. Their URLs."""
    urls = []
    for i, (first_ms, gap_ms) in enumerate(paces):
        port = free_port()
        command = [sys.executable, "-m", "workloads.null_server", "--port", str(port),
                   "--h3-port", "0", "--model", MODEL, "--max-num-seqs", str(max_num_seqs),
                   "--first-token-ms", str(first_ms), "--token-gap-ms", str(gap_ms)]  # fmt: skip
        upstream = launch(f"null-{i}", command, port, "/health", folder / f"null-{i}.log",
                          cpus={1} if (os.cpu_count() or 1) > 1 else None)  # fmt: skip
        stack.enter_context(upstream.ready(60))
        urls.append(upstream.url)
    return urls


def start_vllm(
    stack: ExitStack, folder: Path, names: list[str],
    flags: Sequence[Sequence[str]] = (("--kv-cache-memory-bytes", str(256 * 2**20)),),
    env: dict[str, str] | None = None, model: str = "tiny-s",
) -> list[str]:  # fmt: skip
    """A real `vllm serve` of an embedded model (CPU build) per entry of `flags`, with those
    flags added, answering to `names`, on CPU 1 where there is one; stopped when `stack`
    closes. Their URLs."""
    subprocess.run([sys.executable, "-m", "serving.embedded"], cwd=ROOT, check=True)
    template = folder / "chat_template.jinja"
    template.write_text(yaml.safe_load((ROOT / "models.yaml").read_text())["chat_template"])
    urls = []
    for i, extra in enumerate(flags):
        port = free_port()
        # By its module: the CPU build's `vllm` command looks up a distribution named `vllm`
        # and dies.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   "--model", str(ROOT / ".models" / model), "--served-model-name", *names,
                   "--port", str(port), "--chat-template", str(template), "--enforce-eager",
                   "--max-model-len", "2048", *extra]  # fmt: skip
        upstream = launch(
            f"vllm-serve-{i}", command, port, "/health", folder / f"vllm-serve-{i}.log",
            {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})},
            cpus={1} if (os.cpu_count() or 1) > 1 else None,
        )  # fmt: skip
        stack.enter_context(upstream.ready(600))
        urls.append(upstream.url)
    return urls


def peer_command(name: str, venv: Path) -> list[str] | None:
    """How to start peer gateway `name` from `venv`; None, with a note, where it is not there."""
    binary = {
        "sglang-router": [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router"],
        "vllm-router": [str(venv / "bin" / "vllm-router")],
    }[name]
    if not Path(binary[0]).exists() or (
        name == "sglang-router"
        and subprocess.run([binary[0], "-c", "import sglang_router"], capture_output=True)
        .returncode != 0
    ):  # fmt: skip
        print(f"note: {name} is not in {venv}; --install-peers", file=sys.stderr)
        return None
    return binary


PEERS = ("sglang-router==0.3.2", "vllm-router==0.1.17")
"""The peers' versions every comparison ran: `router.prefix.SglangCacheAware` copies sglang-router
0.3.2's cache_aware, so a newer one would be compared with a copy of an older."""


def install_peers(venv: Path) -> None:
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *PEERS], check=True)


def add_peer_arguments(parser: argparse.ArgumentParser, out: str) -> None:
    """--peers-venv, --install-peers and --out (results/`out`)."""
    parser.add_argument("--peers-venv", type=Path, default=ROOT / ".peers-venv")
    parser.add_argument("--install-peers", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / out)


def report(out: Path, rows: list[dict], text: str) -> None:
    """Write a run's rows and table under `out`, and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    (out / "table.md").write_text(text + "\n")
    print(text)


def timer_overhead_s(samples: int = 200_000) -> float:
    """What one timed interval costs with nothing inside it (median of batches)."""
    pc = time.perf_counter
    per_batch = []
    for _ in range(20):
        acc = 0.0
        for _ in range(samples // 20):
            t0 = pc()
            acc += pc() - t0
        per_batch.append(acc / (samples // 20))
    return statistics.median(per_batch)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return (
        f"{platform.platform()}, {cpu}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()} ({platform.python_implementation()})"
    )


STORMS = ("calm", "client-killed", "engines-die")
"""What a storm run does to a live twin: nothing, SIGKILL its client part way, or kill two of
its engines (`simulation.faults`, `DYING`) 12 s in and bring them back 5 s later."""
DYING = {
    "kubeai-l4-sim": ["cuda:0/llama-3.1-8b-fp8", "cuda:3/llama-3.1-8b-fp8"],
    "paper-4gpu-sim": ["cuda:0/opt-6.7b", "cuda:1/opt-1.3b"],
}
"""The two engines that die in `engines-die`, per deployment."""
STORM_KEY = "storm-premium-key"
"""The load's API key, whose classes include real-time (the premium tier's)."""


def storm_config(folder: Path, deployment: str, faults: bool, no_deadlines: bool) -> Path:
    """The shipped models.yaml; with `no_deadlines`, no class deadline; with `faults`, two dying
    engines."""
    spec = shipped_spec()
    if no_deadlines:
        for qos_class in spec["qos_classes"].values():
            qos_class["deadline_s"] = 3600.0
    if faults:
        spec["deployments"][deployment]["simulation"]["faults"] = {
            "replicas": DYING[deployment], "fail_after_s": 12.0, "restart_s": 5.0,
        }  # fmt: skip
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def start_twin(folder: Path, tag: str, policy: str, config: Path, deployment: str,
               time_scale: float) -> Launched:  # fmt: skip
    """`python -m serving` on CPU 0 with a request log; `policy`: a policy's name, or a DQN's
    file (`serving --policy-file`)."""
    port = free_port()
    chosen = ["--policy", "dqn", "--policy-file", policy] if policy.endswith(".npz") else [
        "--policy", policy]  # fmt: skip
    command = [sys.executable, "-m", "serving", "--config", str(config), "--deployment",
               deployment, *chosen, "--port", str(port), "--h3-port", "0", "--time-scale",
               str(time_scale), "--request-log", str(folder / f"{tag}-requests.jsonl")]  # fmt: skip
    env = {"QOS_PREMIUM_KEY": STORM_KEY}
    return launch(tag, command, port, "/readyz", folder / f"{tag}.log", env, cpus={0}).ready(120)


def replay_load(url: str, out: Path, workload: list[str], args: argparse.Namespace,
                requests: int, kill_after: float = 0.0) -> dict | None:  # fmt: skip
    """`workloads.replay` with `workload`'s flags on the other CPUs: its summary; None where it
    was killed `kill_after` s in."""
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
    """The server's outcomes and retries (by reason) from /metrics, and from its request log."""
    outcomes: Counter[str] = Counter()
    retries: Counter[str] = Counter()
    in_flight = 0.0
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "serving_requests_total":
                outcomes[sample.labels["outcome"]] += int(sample.value)
            elif sample.name == "serving_retries_total":
                retries[sample.labels["reason"]] += int(sample.value)
            elif sample.name == "serving_replica_in_flight":
                in_flight += sample.value
    lines = [json.loads(line) for line in request_log.read_text().splitlines()]
    return {
        "outcomes": dict(outcomes), "logged": dict(Counter(line["outcome"] for line in lines)),
        "in_flight": in_flight, "retries": dict(retries),
        "logged_retries": sum(len(line.get("retries") or ()) for line in lines),
    }  # fmt: skip


def storm_row(
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


def storm_runs(
    args: argparse.Namespace, deployment: str, workload: list[str], no_deadlines: bool
) -> list[dict]:
    """Each of `args.policies` through `args.scenario` on a fresh twin of `deployment`, the load
    `workload`: a row a run (two for client-killed: when killed, then after 300 more)."""
    folder = args.out
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    faults = args.scenario == "engines-die"
    config = storm_config(folder, deployment, faults, no_deadlines)
    for policy in args.policies.split(","):
        tag = "-".join([args.scenario, *Path(policy).with_suffix("").parts[-2:]])
        with start_twin(folder, tag, policy, config, deployment, args.time_scale) as server:
            log = folder / f"{tag}-requests.jsonl"
            if args.scenario == "client-killed":
                replay_load(server.url, folder / f"{tag}.json", workload, args, args.requests,
                            args.kill_after)  # fmt: skip
                time.sleep(2)  # the server sees the connections close
                killed = server_counts(server.url, log)
                rows.append(storm_row(f"{tag} (killed)", policy, args.time_scale, None, killed))
                summary = replay_load(server.url, folder / f"{tag}-after.json", workload, args,
                                      300)  # fmt: skip
                time.sleep(2)
                rows.append(storm_row(f"{tag} (then 300 more)", policy, args.time_scale, summary,
                                server_counts(server.url, log), rows[-1]["new"]))  # fmt: skip
            else:
                summary = replay_load(server.url, folder / f"{tag}.json", workload, args,
                                      args.requests)  # fmt: skip
                time.sleep(2)
                counts = server_counts(server.url, log)
                rows.append(storm_row(tag, policy, args.time_scale, summary, counts))
    return rows


def add_storm_arguments(parser: argparse.ArgumentParser, policies: str, out: str) -> None:
    """The flags every storm takes; `policies` and `out`: their defaults."""
    parser.add_argument("--scenario", choices=STORMS, default="calm")
    parser.add_argument("--policies", default=policies,
                        help="policy names, or DQN files (.npz), comma-separated")  # fmt: skip
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=800)
    parser.add_argument("--rate", type=float, default=800.0)
    parser.add_argument("--time-scale", type=float, default=5.0)
    parser.add_argument("--kill-after", type=float, default=20.0, help="client-killed: s")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / out)


def storm_report(args: argparse.Namespace, rows: list[dict]) -> int:
    """Write the rows, say whether every request was accounted for; 1 where one was not."""
    (args.out / f"{args.scenario}.json").write_text(json.dumps(rows, indent=1))
    lost = [
        r["run"] for r in rows
        if r["in_flight"] or sum(r["outcomes"].values()) != sum(r["logged"].values())
        or sum(r["retries"].values()) != r["logged_retries"]
        or ("sent" in r and r["sent"] != r["new"])
    ]  # fmt: skip
    print("every request accounted for" if not lost else f"NOT accounted for: {lost}")
    return 1 if lost else 0
