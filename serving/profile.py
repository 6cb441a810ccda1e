"""`python -m serving.profile --deployment embedded`: measure a deployment's real engines and write
the latency profile the router's simulator runs on.

For each model (its first replica), alone:
- step time by batch size: `batch` concurrent requests that each generate exactly `--tokens`
  tokens; the step is the median gap between a request's tokens after its first.
- prefill time per prompt token: the slope of time-to-first-token over prompt length, one request
  at a time, so that no decode step shares the iteration.
Then every replica at once, each at `--interference-batch`: the simulator's interference factor is
(step time with k busy neighbours / step time alone - 1) / k, averaged over the replicas.

The result is a models.yaml `profiles:` entry, printed and written to `--out`. Paste it under
`profiles:` and name it in the deployment's `profile:`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import yaml

from config import DEFAULT_PATH, ConfigError, Deployment, load_deployment
from serving.engines.base import Engine, Sampling
from serving.replicas import Replica, ReplicaSet
from workloads import Request

_ids = itertools.count()
_GREEDY = Sampling(temperature=0.0, ignore_eos=True)


def _prompt(tokens: int) -> str:
    # One common word per token for the tiny tokenizers and OPT's alike; the engine reports the
    # true length, and the fit uses that.
    return " ".join(itertools.repeat("the", tokens))


async def _token_times(engine: Engine, prompt_tokens: int, tokens: int) -> tuple[list[float], int]:
    """Wall-clock time of each output token of one request, and its true prompt length."""
    request = Request(f"profile-{next(_ids)}", time.monotonic(), _prompt(prompt_tokens), tokens,
                      "profile")  # fmt: skip
    times: list[float] = []
    prompt_len = 0
    async for delta in engine.generate(request, _GREEDY):
        now = time.monotonic()
        prompt_len = delta.prompt_tokens
        if times and delta.tokens > 1:
            # A delta that carries n tokens spans n steps (vLLM merges outputs the reader was too
            # late for): spread them evenly since the previous one, not n gaps of 0 and one long.
            times += list(np.linspace(times[-1], now, delta.tokens + 1)[1:])
        else:
            times += [now] * delta.tokens
    return times, prompt_len


def _steps(runs: list[tuple[list[float], int]]) -> list[float]:
    gaps: list[float] = []
    for times, _ in runs:
        gaps += list(np.diff(times[1:]))
    return gaps


async def step_time(engine: Engine, batch: int, tokens: int, prompt_tokens: int) -> float:
    runs = await asyncio.gather(
        *(_token_times(engine, prompt_tokens, tokens) for _ in range(batch))
    )
    return float(statistics.median(_steps(runs)))


async def prefill_per_token(engine: Engine, lengths: list[int], repeats: int) -> float:
    xs: list[int] = []
    ys: list[float] = []
    for length in lengths:
        for _ in range(repeats):
            start = time.monotonic()
            times, true_len = await _token_times(engine, length, 1)
            xs.append(true_len)
            ys.append(times[0] - start)
    slope = float(np.polyfit(xs, ys, 1)[0])
    return max(0.0, slope)


async def interference(
    replicas: list[Replica], alone: dict[str, float], batch: int, tokens: int, prompt_tokens: int
) -> float:
    """(shared / alone - 1) / neighbours, averaged over replicas; 0 with a single replica."""
    if len(replicas) < 2:
        return 0.0
    shared = await asyncio.gather(
        *(step_time(r.engine, batch, tokens, prompt_tokens) for r in replicas)
    )
    k = len(replicas) - 1
    factors = [(s / alone[r.name] - 1.0) / k for r, s in zip(replicas, shared, strict=True)]
    return max(0.0, float(statistics.mean(factors)))


async def measure(deployment: Deployment, args: argparse.Namespace) -> dict[str, object]:
    replicas = ReplicaSet.from_deployment(deployment)
    await replicas.start()
    try:
        firsts: dict[str, Replica] = {}
        for r in replicas:
            firsts.setdefault(r.model, r)
        models: dict[str, object] = {}
        alone: dict[str, float] = {}
        for model, replica in firsts.items():
            engine = replica.engine
            await step_time(engine, 2, 4, args.prompt_tokens)  # warm-up: first calls compile
            steps = {}
            for batch in args.batches:
                steps[batch] = round(
                    await step_time(engine, batch, args.tokens, args.prompt_tokens), 6
                )
                print(f"{model}: batch {batch:>3}: {steps[batch] * 1e3:7.2f} ms/step", flush=True)
            prefill = await prefill_per_token(engine, args.prefill_lengths, args.repeats)
            print(f"{model}: prefill {prefill * 1e6:.1f} us/token", flush=True)
            models[model] = {"prefill_s_per_token": round(prefill, 9), "step_s": steps}
            alone[replica.name] = await step_time(
                engine, args.interference_batch, args.tokens, args.prompt_tokens
            )
        factor = await interference(
            list(firsts.values()), alone, args.interference_batch, args.tokens, args.prompt_tokens
        )
        print(f"interference per busy neighbour: {factor:.3f}", flush=True)
    finally:
        await replicas.close()
    command = " ".join(["python -m serving.profile", *sys.argv[1:]])
    return {
        "hardware": f"{platform.processor() or platform.machine()}, {_cpu_count()} cores "
        f"({platform.node()})",
        "source": "measured",
        "how": f"`{command}` on {datetime.now(UTC):%Y-%m-%d}: {args.tokens} tokens per request "
        f"after a {args.prompt_tokens}-token prompt; step = median inter-token gap; prefill = "
        f"slope of TTFT over prompt lengths {args.prefill_lengths}.",
        "interference": round(factor, 4),
        "models": models,
    }


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m serving.profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=DEFAULT_PATH, help="models.yaml path")
    parser.add_argument("--deployment", default=None, help="default: the file's default")
    parser.add_argument(
        "--name", default=None, help="profile name (default: <deployment>-measured)"
    )
    parser.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument(
        "--tokens", type=int, default=32, help="output tokens per request (at least 3)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--prefill-lengths", type=_ints, default=[32, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interference-batch", type=int, default=4)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: results/profile-<name>.yaml"
    )
    args = parser.parse_args()
    try:
        deployment = load_deployment(args.config, args.deployment)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.tokens < 3:
        parser.error("--tokens must be at least 3: the step is a gap between later tokens")
    name = args.name or f"{deployment.name}-measured"
    profile = asyncio.run(measure(deployment, args))
    text = yaml.safe_dump({name: profile}, sort_keys=False, width=100)
    out = args.out or Path("results") / f"profile-{name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
