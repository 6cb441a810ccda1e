"""The simulator's prefix cache against real vLLM's, on CPU: the same prompts, hit for hit.

Real vLLM (the CPU build, in process, `enable_prefix_caching`, float32, eager) serves one of the
embedded models with a KV cache of `--kv-blocks` blocks of 128 tokens, small enough that
conversations evict each other. The prompts are multi-turn conversations with long histories
(a ~600-token first message, so turns run past 1,000 tokens), their turns interleaved across
conversations, each request sent alone and asked for one token. vLLM reports the tokens each
found cached (`RequestOutput.num_cached_tokens`); the simulator's `Batcher` with a `KvCache` of
vLLM's own block count serves the same token ids in the same order.

1. Hit rates: cached prompt tokens over all prompt tokens, both ways, and how many requests
   found exactly as many tokens cached in both (the target: within 5 percentage points).
2. TTFT with a hit against without: for turns whose history is cached, each is timed warm
   (its previous turn just served) and cold (after `reset_prefix_cache`), three times each;
   the median warm/cold ratio against the simulator's, from the embedded profile's step and
   prefill times and the tokens each would compute (the target: the same ratio within 20%).

    python -m benchmarks.cache_fidelity [--model tiny-m] [--kv-blocks 40] [--conversations 8]

Writes results/cache_fidelity.csv (one row per request) and prints both comparisons.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from config import ReplicaConfig, load_deployment
from experiments.harness.output import write_csv
from router.kv_cache import KvCache, block_hashes
from router.sim import Batcher, Job
from serving.embedded import ensure_built
from serving.engines.prompts import PromptTokenizer, load_tokenizer
from workloads import Request
from workloads.conversations import conversations, turns
from workloads.generate import filler
from workloads.lengths import ChatShape

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 128
"""vLLM's KV block on CPU."""

LONG_HISTORY = ChatShape(
    name="long-history",
    source="chosen here: a ~600-token document opens each conversation, so that later turns pass "
    "1,000 tokens and prefill shows on a CPU",
    min_turns=3,
    mean_turns=4.0,
    user_tokens=150.0,
    assistant_tokens=120.0,
    sigma=0.4,
)


@dataclass
class Served:
    request: Request
    ids: list[int]
    vllm_cached: int = 0
    sim_cached: int = 0


def workload(replica: ReplicaConfig, n: int, seed: int, max_prompt: int) -> list[Served]:
    """The conversations' turns, interleaved: turn 1 of each, then turn 2 of each, ..."""
    if replica.build is not None:
        ensure_built(replica.source, replica.build)
    prompts = PromptTokenizer(load_tokenizer(replica.source), replica)
    convs = conversations(LONG_HISTORY, n, seed)
    # The first message becomes a document: a long shared head for every later turn.
    rng = np.random.default_rng([seed, 5])
    convs = [
        replace(c, messages=(replace(c.messages[0], content=filler(600, rng)), *c.messages[1:]))
        for c in convs
    ]
    by_conv = [turns([c]) for c in convs]
    order = [ts[k] for k in range(max(map(len, by_conv))) for ts in by_conv if k < len(ts)]
    out = []
    for request in order:
        ids = prompts.encode(request)
        if len(ids) <= max_prompt:
            out.append(Served(request, ids))
    return out


def simulate(served: Sequence[Served], blocks: int, replica: ReplicaConfig) -> None:
    """Each request alone through the simulator's batcher, as vLLM served them."""
    deployment = load_deployment(ROOT / "models.yaml", "embedded")
    assert deployment.profile is not None
    batch = Batcher(deployment.profile.models[replica.model], 8, kv=KvCache(blocks, BLOCK))
    now = 0.0
    for s in served:
        request = Request(
            s.request.request_id, now, "", 1, "free-tier", prompt_tokens=len(s.ids),
            blocks=block_hashes(s.ids, BLOCK),
        )  # fmt: skip
        job = Job(request, now, float("inf"), 1, 1)
        batch.add(job)
        while (cost := batch.begin()) is not None:
            now += cost
            batch.end(now)
        s.sim_cached = job.cached_tokens


def make_llm(replica: ReplicaConfig, blocks: int, max_model_len: int) -> Any:
    """Real vLLM on CPU with prefix caching and a KV cache of `blocks` blocks, as the embedded
    engines run (float32, eager)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM

    assert replica.build is not None, "an embedded model, whose shape sizes the cache"
    per_token = 2 * replica.build.num_layers * replica.build.hidden_size * 4
    return LLM(
        model=replica.source, dtype="float32", enforce_eager=True, max_model_len=max_model_len,
        enable_prefix_caching=True, block_size=BLOCK, max_num_seqs=8, seed=0,
        kv_cache_memory_bytes=blocks * BLOCK * per_token, disable_log_stats=False,
    )  # fmt: skip


def kv_blocks(llm: Any) -> int:
    """The blocks vLLM's cache ended up with."""
    return int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)


def server(llm: Any) -> Callable[[Served], float]:
    """Serves one request alone, asking one token; its seconds, and its cached tokens noted."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def serve(s: Served) -> float:
        start = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=s.ids)], one, use_tqdm=False)
        elapsed = time.perf_counter() - start
        s.vllm_cached = out.num_cached_tokens or 0
        return elapsed

    return serve


def serve_all(llm: Any, served: Sequence[Served]) -> None:
    """Every request in order, one at a time, from an empty cache."""
    serve = server(llm)
    serve(Served(served[0].request, served[0].ids[:64]))  # the first run's one-off costs
    llm.reset_prefix_cache()
    for s in served:
        serve(s)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-m", help="an embedded model")
    parser.add_argument("--kv-blocks", type=int, default=40)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=8, help="turns timed warm and cold")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "results")
    args = parser.parse_args()
    deployment = load_deployment(ROOT / "models.yaml", "embedded")
    replica = next(r for r in deployment.replicas if r.model == args.model)
    max_model_len = 2048
    served = workload(replica, args.conversations, args.seed, max_model_len - 8)
    print(f"{len(served)} requests, {sum(len(s.ids) for s in served)} prompt tokens, longest "
          f"{max(len(s.ids) for s in served)}", file=sys.stderr)  # fmt: skip

    llm = make_llm(replica, args.kv_blocks, max_model_len)
    blocks = kv_blocks(llm)
    serve = server(llm)
    serve_all(llm, served)
    simulate(served, blocks, replica)

    prompt = sum(len(s.ids) for s in served)
    vllm_rate = sum(s.vllm_cached for s in served) / prompt
    sim_rate = sum(s.sim_cached for s in served) / prompt
    same = sum(s.vllm_cached == s.sim_cached for s in served)
    gap = 100 * (sim_rate - vllm_rate)
    print(f"KV cache: {blocks} blocks of {BLOCK} tokens ({args.model})")
    print(f"hit rate: vLLM {vllm_rate:.3f}, simulator {sim_rate:.3f} ({gap:+.1f} points; "
          f"target within 5); {same} of {len(served)} requests found as many cached")  # fmt: skip

    # 2. Warm against cold, where the history was cached.
    profile = deployment.profile
    assert profile is not None
    model = profile.models[replica.model]
    step = model.step_s[min(model.step_s)]
    index = {s.request.request_id: i for i, s in enumerate(served)}
    pairs: list[tuple[Served, Served]] = []
    for s in sorted(served, key=lambda s: -len(s.ids)):  # the longest prompts
        head, _, k = s.request.request_id.rpartition("t")
        previous = index.get(f"{head}t{int(k) - 1}") if int(k) > 0 else None
        if previous is not None and len(pairs) < args.pairs:
            pairs.append((served[previous], s))
    rows, ratios, predicted = [], [], []
    for before, s in pairs:
        warm, cold = [], []
        for _ in range(3):
            llm.reset_prefix_cache()
            serve(before)
            warm.append(serve(s))
            hit = s.vllm_cached
            llm.reset_prefix_cache()
            cold.append(serve(s))
            assert s.vllm_cached == 0
        ratio = statistics.median(warm) / statistics.median(cold)
        model_ratio = (step + (len(s.ids) - hit) * model.prefill_s_per_token) / (
            step + len(s.ids) * model.prefill_s_per_token
        )
        ratios.append(ratio)
        predicted.append(model_ratio)
        rows.append({"request": s.request.request_id, "prompt_tokens": len(s.ids),
                     "cached_tokens": hit, "warm_ms": 1000 * statistics.median(warm),
                     "cold_ms": 1000 * statistics.median(cold), "ratio": ratio,
                     "simulator_ratio": model_ratio})  # fmt: skip
        print(f"  {s.request.request_id}: {len(s.ids)} tokens, {hit} cached: warm "
              f"{1000 * statistics.median(warm):.1f} ms, cold {1000 * statistics.median(cold):.1f}"
              f" ms, ratio {ratio:.3f}; simulator {model_ratio:.3f}")  # fmt: skip
    if ratios:
        real, sim = statistics.median(ratios), statistics.median(predicted)
        off = 100 * (sim / real - 1)
        print(
            f"TTFT with a hit / without: vLLM {real:.3f}, simulator {sim:.3f} ({off:+.0f}%; "
            "target within 20%)"
        )
    write_csv(args.out / "cache_fidelity.csv", [
        {"request": s.request.request_id, "prompt_tokens": len(s.ids),
         "vllm_cached": s.vllm_cached, "sim_cached": s.sim_cached} for s in served
    ] + rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
