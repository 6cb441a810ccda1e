"""`python -m experiments.prefix_aware`: KubeAI's benchmark ("Benchmarking Prefix Aware Load
Balancing"), reproduced in the simulator.

The benchmark's shape: eight replicas of Llama 3.1 8B FP8 on L4s (`kubeai-l4-sim`), each with
vLLM's prefix cache (`router.kv_cache`), sent the benchmark's workload (800 prompts cut from
multi-turn conversations, 8,000 requests, `workloads.conversations.kubeai_benchmark_prompts`) by a
closed-loop client at concurrency 800, 1,600, 3,200 and 8,000 and the benchmark's request rates
(800, 200, 200, 800 a second), as `vllm bench serve --max-concurrency` sends them
(`router.closed_loop`). Prompts are counted, and their blocks hashed, by the deployment's
tokenizer through its chat template, as the gateway counts them. No first-token deadline: the
benchmark's client had none.

Every policy runs: round-robin, random (Kubernetes' Service), least-load, and the three
prefix-aware ones (`router.prefix`): bounded-load hashing (KubeAI's), an approximate index kept
from routing decisions, and a precise one kept from the engines' KV events. The table prints
beside KubeAI's numbers.

`--uneven` draws the prompts with Zipf popularity over conversations (some far busier than others)
instead of the benchmark's ten passes. `--calibrate` fits the L4 profile to KubeAI's round-robin
row alone (module `calibrate`) and prints what models.yaml should hold.

Writes results/prefix_aware/seed.csv (and .png), or uneven.csv, or calibration.csv.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from config import Deployment, load, load_deployment, resolve
from experiments.harness.output import write_csv
from router.closed_loop import run_closed_loop
from router.evaluate import mean_reward
from router.policies import ModelThenReplica, Policy, make_policy
from router.prefix import PrefixAffinity
from router.route import Router
from router.sim import SHED, Finished, Simulator
from serving.engines.prompts import PromptCounter, gateway_counter
from workloads import Request
from workloads.conversations import conversations, kubeai_benchmark_prompts, turns
from workloads.lengths import LMSYS_CHAT, SHAREGPT_16

DEPLOYMENT = "kubeai-l4-sim"
POLICIES = (
    "round-robin", "random-replica", "least-load", "prefix-hash", "prefix-approx", "prefix-precise",
)  # fmt: skip
RUNS = ((800, 800.0), (1600, 200.0), (3200, 200.0), (8000, 800.0))
"""(concurrency, request rate) of the benchmark's four runs."""

KUBEAI = {
    # KubeAI's published results: mean TTFT (ms), P99 TTFT (ms), benchmark duration (s).
    "round-robin": {800: (1319.77, 7438.41, 159.98), 1600: (10365.29, 22283.86, 157.07),
                    3200: (27183.41, 51797.57, 156.36), 8000: (48587.55, 101940.11, 156.20)},
    "least-load": {800: (817.18, 5551.81, 158.39), 1600: (10579.01, 15514.10, 153.02),
                   3200: (24147.86, 46021.48, 152.43), 8000: (39163.80, 78489.26, 152.59)},
    "prefix-hash": {800: (280.20, 1260.53, 104.67), 1600: (196.13, 492.33, 110.00),
                    3200: (213.92, 838.35, 111.37), 8000: (237.06, 619.65, 107.89)},
}  # fmt: skip


@dataclass(frozen=True)
class Scale:
    conversations: int
    prompts: int
    requests: int
    runs: tuple[tuple[int, float], ...]


FULL = Scale(conversations=150, prompts=800, requests=8000, runs=RUNS)
QUICK = Scale(conversations=150, prompts=800, requests=2000, runs=RUNS)
"""A quarter of the requests, at the benchmark's concurrency and rates."""


def counter(deployment: Deployment) -> PromptCounter:
    """Counts as the twin's gateway does (`gateway_counter`), remembering each distinct
    prompt's count: KubeAI's benchmark repeats its prompts ten times."""
    count = gateway_counter(deployment, remember=True)
    if count is None:
        raise ValueError(f"deployment {deployment.name}: no tokenizer here to count prompts with")
    return count


def seed_requests(count: PromptCounter, scale: Scale, seed: int, uneven: bool) -> list[Request]:
    convs = conversations(SHAREGPT_16, scale.conversations, seed)
    requests = kubeai_benchmark_prompts(convs, scale.prompts, scale.requests, count=count)
    if uneven:
        requests = zipf_draws(requests, scale.requests, seed)
    return [count.counted(r) for r in requests]


def zipf_draws(requests: Sequence[Request], n: int, seed: int, s: float = 1.1) -> list[Request]:
    """`n` requests drawn from the distinct prompts of `requests`, a conversation by Zipf
    popularity (exponent `s`), then one of its prompts uniformly."""
    by_session: dict[str, dict[object, Request]] = {}
    for r in requests:  # each distinct prompt once
        by_session.setdefault(r.session_id or "", {}).setdefault(r.prompt, r)
    sessions = list(by_session)
    rng = np.random.default_rng([seed, 11])
    weights = 1 / np.arange(1, len(sessions) + 1) ** s
    picks = rng.choice(len(sessions), size=n, p=weights / weights.sum())
    out = []
    for i, k in enumerate(picks):
        pool = list(by_session[sessions[k]].values())
        out.append(replace(pool[int(rng.integers(len(pool)))], request_id=f"z{i}"))
    return out


def simulate(
    deployment: Deployment,
    policy_name: str,
    requests: Sequence[Request],
    concurrency: int,
    rate: float,
    seed: int,
    routers: int = 1,
) -> tuple[list[Finished], Simulator]:
    """One run: `policy_name` over `requests` on a fresh simulator, without deadlines. With
    `routers`, requests take turns among that many routers, each with its own policy
    (front-end workers that do not share their indexes); every precise one hears every
    engine's events."""
    policies: list[Policy] = [make_policy(deployment, policy_name) for _ in range(routers)]
    precise = [p for p in policies if isinstance(p, PrefixAffinity) and p.precise]
    hear = None
    if precise:

        def hear(replica: int, kind: str, blocks: list[int]) -> None:
            for p in precise:
                p.event(replica, kind, blocks)

    sim = Simulator.from_deployment(deployment, deadlines={}, on_kv_event=hear)
    obs = np.zeros(1, dtype=np.float32)
    turn = itertools.count()
    done = run_closed_loop(
        sim,
        lambda r, v: policies[next(turn) % routers].choose(obs, r, v),
        requests,
        concurrency,
        rate,
        seed,
    )
    return done, sim


def row(
    policy: str, concurrency: int, rate: float, done: Sequence[Finished], sim: Simulator
) -> dict:
    ttft = np.array([f.first_token - f.arrival for f in done if f.first_token is not None])
    tpot = [
        (f.last_token - f.first_token) / (f.output_tokens - 1)
        for f in done
        if f.first_token is not None and f.output_tokens > 1
    ]
    duration = max(f.last_token for f in done)
    batches = [r.batch for r in sim.replicas]
    queried = sum(b.prompt_tokens for b in batches)
    return {
        "policy": policy,
        "concurrency": concurrency,
        "rate": rate,
        "requests": len(done),
        "mean_ttft_ms": 1000 * float(ttft.mean()),
        "median_ttft_ms": 1000 * float(np.median(ttft)),
        "p99_ttft_ms": 1000 * float(np.percentile(ttft, 99)),
        "mean_tpot_ms": 1000 * float(np.mean(tpot)),
        "duration_s": duration,
        "throughput": len(done) / duration,
        "hit_rate": sum(b.hit_tokens for b in batches) / queried if queried else 0.0,
        "preemptions": sum(b.preemptions for b in batches),
    }


def run_table(
    deployment: Deployment,
    requests: Sequence[Request],
    policies: Sequence[str],
    scale: Scale,
    seed: int,
    progress: Callable[[], object] = lambda: None,
    routers: int = 1,
) -> list[dict]:
    rows = []
    for (concurrency, rate), name in itertools.product(scale.runs, policies):
        done, sim = simulate(deployment, name, requests, concurrency, rate, seed, routers=routers)
        rows.append(row(name, concurrency, rate, done, sim) | {"routers": routers})
        progress()
    return rows


# With the learned router on paper-4gpu -------------------------------------------------------

PAPER = "paper-4gpu-sim"
PAPER_POLICIES = ("dqn", "prefix-hash", "prefix-precise", "dqn+prefix-hash", "dqn+prefix-precise")
PAPER_RATES = (4.0, 16.0, 48.0)


def paper_requests(count: PromptCounter, rate: float, duration: float, seed: int) -> list[Request]:
    """LMSYS-Chat-shaped conversations, their first turns arriving at rate / 2 (a conversation
    has 2.0 turns on average), so that turns come at about `rate`, for `duration` seconds; each
    next turn goes out when its previous answer ended. Classes drawn as in training."""
    n = max(1, int(rate / LMSYS_CHAT.mean_turns * duration))
    convs = conversations(LMSYS_CHAT, n, seed)
    rng = np.random.default_rng([seed, 13])
    starts = np.cumsum(rng.exponential(LMSYS_CHAT.mean_turns / rate, n))
    out = []
    for conv, start in zip(convs, starts, strict=True):
        qos_class = str(rng.choice(["real-time", "free-tier", "long"]))
        for k, r in enumerate(turns([conv], qos_class, count, max_prompt_tokens=1536)):
            out.append(count.counted(replace(r, arrival=float(start) if k == 0 else 0.0,
                                             max_tokens=min(r.max_tokens or 1, 512))))  # fmt: skip
    return out


def paper_route(deployment: Deployment, name: str) -> Callable[[], Router]:
    """A fresh router for one run, as the gateway routes (`router.route.Router`); "dqn+X": the
    DQN chooses the model and X the replica (`ModelThenReplica`)."""
    return lambda: Router(deployment, make_policy(deployment, name))


def run_paper(
    seeds: Sequence[int], rates: Sequence[float], policies: Sequence[str], duration: float,
    progress: Callable[[], object] = lambda: None,
) -> list[dict]:  # fmt: skip
    deployment = load_deployment(name=PAPER)
    count = counter(deployment)
    rows = []
    for seed, rate in itertools.product(seeds, rates):
        requests = paper_requests(count, rate, duration, seed)
        for name in policies:
            route = paper_route(deployment, name)()
            policy = route.policy
            replica_policy = (
                policy.replica_policy if isinstance(policy, ModelThenReplica) else policy
            )
            hear = None
            if isinstance(replica_policy, PrefixAffinity) and replica_policy.precise:
                hear = replica_policy.event
            sim = Simulator.from_deployment(deployment, on_kv_event=hear)
            done = run_closed_loop(
                sim, route, requests, len(requests), None, seed, ordered=True, served=route.served
            )
            ttft = [f.first_token - f.arrival for f in done if f.first_token is not None]
            batches = [r.batch for r in sim.replicas]
            rows.append({
                "policy": name, "rate": rate, "seed": seed, "requests": len(done),
                "mean_reward": mean_reward(deployment, done),
                "mean_ttft_ms": 1000 * float(np.mean(ttft)) if ttft else float("nan"),
                "shed": sum(f.outcome == SHED for f in done) / len(done),
                "hit_rate": sum(b.hit_tokens for b in batches)
                / max(1, sum(b.prompt_tokens for b in batches)),
            })  # fmt: skip
            progress()
    return rows


def print_paper(rows: Sequence[dict]) -> None:
    """Mean reward and TTFT per policy and rate, with 95% intervals over seeds, and the paired
    differences of DQN + prefix placement against the DQN alone and prefix-hash alone."""
    from scipy import stats

    def ci(values: Sequence[float]) -> tuple[float, float]:
        mean = float(np.mean(values))
        if len(values) < 2:
            return mean, float("nan")
        half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
        return mean, float(half)

    rates = sorted({r["rate"] for r in rows})
    names = list(dict.fromkeys(r["policy"] for r in rows))
    print(f"{'policy':>20} " + " ".join(f"{f'{rate:g} req/s reward':>22} {'TTFT ms':>8} {'hits':>5}"
                                         for rate in rates))  # fmt: skip
    for name in names:
        cells = []
        for rate in rates:
            mine = [r for r in rows if r["policy"] == name and r["rate"] == rate]
            mean, half = ci([r["mean_reward"] for r in mine])
            ttft = np.mean([r["mean_ttft_ms"] for r in mine])
            hits = np.mean([r["hit_rate"] for r in mine])
            cells.append(f"{mean:>13.4f} ± {half:<6.4f} {ttft:>8.0f} {hits:>5.2f}")
        print(f"{name:>20} " + " ".join(cells))
    for combined in (n for n in names if "+" in n):
        for other in ("dqn", combined.partition("+")[2]):
            if other not in names:
                continue
            for rate in rates:
                pairs = {(r["seed"]): r["mean_reward"] for r in rows
                         if r["policy"] == combined and r["rate"] == rate}  # fmt: skip
                base = {(r["seed"]): r["mean_reward"] for r in rows
                        if r["policy"] == other and r["rate"] == rate}  # fmt: skip
                diff, half = ci([pairs[s] - base[s] for s in pairs])
                print(f"{combined} against {other} at {rate:g} req/s: {diff:+.4f} ± {half:.4f}")


# Calibration -----------------------------------------------------------------------------------

RESERVES_GIB = (2.0, 8.0, 9.0, 9.5, 10.0, 10.5)
PREFILL_MS = (0.08, 0.1, 0.12, 0.166)
STEP_SCALES = (0.6, 0.7, 0.8, 1.0)


def calibrate(
    deployment: Deployment,
    requests: Sequence[Request],
    scale: Scale,
    seed: int,
    progress: Callable[[], object] = lambda: None,
) -> list[dict]:
    """Fit the profile to KubeAI's round-robin row alone: every combination of KV reserve
    (how much of the device's memory share holds no KV cache), prefill per token and a scale on
    the derived step times, scored by the squared log error of round-robin's mean TTFT and
    duration at the benchmark's four runs. The prefix-aware rows are not looked at."""
    spec = load()
    name = deployment.name
    profile_name = spec.deployments[name].profile
    assert profile_name is not None
    base = spec.profiles[profile_name]
    model = deployment.models[0]
    rows = []
    for reserve, prefill_ms, step in itertools.product(RESERVES_GIB, PREFILL_MS, STEP_SCALES):
        steps = {b: t * step for b, t in base.models[model].step_s.items()}
        timing = base.models[model].model_copy(
            update={"prefill_s_per_token": prefill_ms / 1000, "step_s": steps}
        )
        profile = base.model_copy(update={"reserved_gib": reserve, "models": {model: timing}})
        # Resolved as models.yaml would be with this profile: its KV capacity comes out of
        # config's own rule (`config.deployment.kv_capacity`).
        fitted = resolve(
            spec.model_copy(update={"profiles": {**spec.profiles, profile_name: profile}}), name
        )
        tokens = fitted.replicas[0].kv_tokens
        error = 0.0
        for concurrency, rate in scale.runs:
            done, sim = simulate(fitted, "round-robin", requests, concurrency, rate, seed)
            r = row("round-robin", concurrency, rate, done, sim)
            ttft, _, duration = KUBEAI["round-robin"][_full(concurrency, scale)]
            error += (
                math.log(r["mean_ttft_ms"] / ttft) ** 2 + math.log(r["duration_s"] / duration) ** 2
            )
        rows.append(
            {
                "reserved_gib": reserve,
                "kv_tokens": tokens,
                "prefill_ms": prefill_ms,
                "step_scale": step,
                "error": error,
            }
        )
        progress()
    return sorted(rows, key=lambda r: r["error"])


def _full(concurrency: int, scale: Scale) -> int:
    """The benchmark's concurrency a run of `scale` stands for."""
    concurrencies = [c for c, _ in scale.runs]
    if len(concurrencies) == len(RUNS) and concurrency in concurrencies:
        return RUNS[concurrencies.index(concurrency)][0]
    return concurrency


# Output ------------------------------------------------------------------------------------------


def print_table(rows: Sequence[dict], scale: Scale) -> None:
    print(
        f"{'policy':>15} {'conc':>5} {'mean TTFT':>10} {'p99 TTFT':>10} {'TPOT':>6} "
        f"{'dur s':>6} {'req/s':>6} {'hits':>5} | "
        f"{'KubeAI mean':>11} {'KubeAI p99':>10} {'KubeAI dur':>10}"
    )
    for r in rows:
        kubeai = KUBEAI.get(r["policy"], {}).get(_full(r["concurrency"], scale))
        theirs = f"{kubeai[0]:>11.0f} {kubeai[1]:>10.0f} {kubeai[2]:>10.1f}" if kubeai else ""
        print(
            f"{r['policy']:>15} {r['concurrency']:>5} {r['mean_ttft_ms']:>10.0f} "
            f"{r['p99_ttft_ms']:>10.0f} {r['mean_tpot_ms']:>6.0f} {r['duration_s']:>6.1f} "
            f"{r['throughput']:>6.1f} {r['hit_rate']:>5.2f} | {theirs}"
        )


def plot(rows: Sequence[dict], scale: Scale, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    concurrencies = [c for c, _ in scale.runs]
    for name in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == name]
        line = left.plot(concurrencies, [r["mean_ttft_ms"] for r in mine], "o-", label=name)
        right.plot(concurrencies, [r["hit_rate"] for r in mine], "o-", color=line[0].get_color())
        if name in KUBEAI:
            left.plot(
                concurrencies,
                [KUBEAI[name][_full(c, scale)][0] for c in concurrencies],
                "x--",
                color=line[0].get_color(),
                label=f"{name} (KubeAI)",
            )
    left.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="mean TTFT (ms)", title=title)
    left.legend(fontsize=7)
    right.set(
        xscale="log",
        xlabel="concurrency",
        ylabel="prefix cache hit rate (tokens)",
        title="Prefix cache hits",
        ylim=(0, 1),
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.prefix_aware", description=__doc__)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (seconds)")
    parser.add_argument(
        "--uneven",
        action="store_true",
        help="Zipf popularity over conversations instead of the benchmark's passes",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the L4 profile on KubeAI's round-robin row, print the best",
    )
    parser.add_argument(
        "--routers",
        type=int,
        default=1,
        help="routers taking turns, each with its own index (default 1)",
    )
    parser.add_argument(
        "--runs", help="concurrency:rate pairs instead of the benchmark's four, e.g. 8000:74"
    )
    parser.add_argument(
        "--paper",
        action="store_true",
        help="the DQN with prefix placement on paper-4gpu-sim, on LMSYS-shaped conversations",
    )
    parser.add_argument("--seeds", type=int, default=3, help="with --paper")
    parser.add_argument("--duration", type=float, default=60.0, help="with --paper, s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=Path("results/prefix_aware"))
    args = parser.parse_args()
    from tqdm import tqdm

    if args.paper:
        policies = args.policies if args.policies != list(POLICIES) else list(PAPER_POLICIES)
        total = args.seeds * len(PAPER_RATES) * len(policies)
        duration = args.duration / 4 if args.quick else args.duration
        with tqdm(total=total, desc="paper-4gpu runs", file=sys.stderr) as bar:
            rows = run_paper(range(args.seeds), PAPER_RATES, policies, duration, bar.update)
        write_csv(args.results / "paper.csv", rows)
        print_paper(rows)
        return 0
    scale = QUICK if args.quick else FULL
    if args.runs:
        runs = tuple((int(c), float(r)) for c, r in (p.split(":") for p in args.runs.split(",")))
        scale = replace(scale, runs=runs)
    deployment = load_deployment(name=DEPLOYMENT)
    requests = seed_requests(counter(deployment), scale, args.seed, args.uneven)
    prompt = np.mean([r.prompt_tokens or 0 for r in requests])
    output = np.mean([r.max_tokens or 0 for r in requests])
    print(
        f"{len(requests)} requests, {len({r.prompt for r in requests})} distinct prompts from "
        f"{len({r.session_id for r in requests})} conversations; {prompt:.0f} prompt tokens and "
        f"{output:.0f} output tokens on average (KubeAI's benchmark: 832 and 76)",
        file=sys.stderr,
    )
    if args.calibrate:
        total = len(RESERVES_GIB) * len(PREFILL_MS) * len(STEP_SCALES)
        with tqdm(total=total, desc="calibrating", file=sys.stderr) as bar:
            fits = calibrate(deployment, requests, scale, args.seed, bar.update)
        write_csv(args.results / "calibration.csv", fits)
        for fit in fits[:5]:
            print(fit)
        return 0
    with tqdm(total=len(scale.runs) * len(args.policies), desc="runs", file=sys.stderr) as bar:
        rows = run_table(
            deployment, requests, args.policies, scale, args.seed, bar.update, args.routers
        )
    name = ("uneven" if args.uneven else "seed") + (f"-{args.routers}r" if args.routers > 1 else "")
    name += "-runs" if args.runs else ""
    name += f"-s{args.seed}" if args.seed else ""
    write_csv(args.results / f"{name}.csv", rows)
    workload = "Zipf-popular conversations" if args.uneven else "KubeAI's benchmark workload"
    title = "Mean TTFT, " + workload
    plot(rows, scale, args.results / f"{name}.png", title)
    print_table(rows, scale)
    print(f"wrote {args.results / name}.csv and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
