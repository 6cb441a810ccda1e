"""Per-request outcomes of a load run and their summary.

The summary uses `vllm bench serve`'s metric set and definitions, so the two can be compared:
TTFT (send to first content), TPOT ((E2EL - TTFT) / (output tokens - 1)), ITL (every gap between
content chunks), E2EL (send to the last content), each as mean, median, std and p99; request, output
and total token throughput over the run's duration. On top of them: SLO attainment and goodput per
QoS class (the SLO is models.yaml's, tested by `Slo.met`), each model's share, and the router's
reward (quality if the SLO was met, else 0), over the run and over sliding windows of 20 requests
as in Table 2 of Chuppala (2024).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

WINDOW_THRESHOLDS = (1.0, 0.99, 0.98, 0.96, 0.94)
"""The rows of the thesis's Table 2: windows whose mean reward is = 1.00, >= 0.99, and so on."""


@dataclass
class Outcome:
    """What happened to one request. `error_kind` is None exactly when it completed."""

    request_id: str
    qos_class: str
    task: str | None
    arrival_s: float
    """Scheduled send time, from the start of the run."""
    lag_s: float = 0.0
    """How late the generator actually sent it; large values mean the client could not keep up."""
    credit_wait_s: float = 0.0
    """HTTP/3: how long it then waited in the client for stream credit (not in TTFT or E2EL)."""
    server_request_id: str | None = None
    """The server's x-request-id, to find the request in the server's log."""
    response_id: str | None = None
    """The id in its answer's chunks (vLLM's, where a peer gateway passes them on)."""
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None
    model: str | None = None
    replica: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """Of those, what the engine found cached, where the server says
    (`usage.prompt_tokens_details.cached_tokens`)."""
    output_tokens: int = 0
    slo_met: bool = False
    reward: float = 0.0
    end_s: float | None = None
    """When it ended, completed or failed, from the start of the run."""
    connection: str | None = None
    """HTTP/3: the client connection that carried it, as `slot.generation` of the load
    generator's pool (a slot's generation goes up each time its connection is reopened)."""

    @property
    def completed(self) -> bool:
        return self.error_kind is None

    @property
    def ttft_from_arrival_s(self) -> float | None:
        """The first token's wait from the request's scheduled arrival, on the clock the SLO and
        a simulator use: the client's lateness and its wait for stream credit included."""
        if self.ttft_s is None:
            return None
        return self.lag_s + self.credit_wait_s + self.ttft_s

    @property
    def tpot_s(self) -> float | None:
        if self.e2el_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def _stats(name: str, values: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std/p99 in milliseconds, as `vllm bench serve` prints them."""
    if not len(values):
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", "p99")}
    ms = np.asarray(values, dtype=float) * 1000
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def _latencies(done: Sequence[Outcome]) -> dict[str, float | None]:
    return {
        **_stats("ttft", [o.ttft_s for o in done if o.ttft_s is not None]),
        **_stats("tpot", [t for o in done if (t := o.tpot_s) is not None]),
        **_stats("itl", [gap for o in done for gap in o.itl_s]),
        **_stats("e2el", [o.e2el_s for o in done if o.e2el_s is not None]),
    }


def _slo(group: Sequence[Outcome], duration_s: float, scored: bool) -> dict[str, float | None]:
    met = sum(o.slo_met for o in group)
    reward = float(np.mean([o.reward for o in group])) if group else 0.0
    return {
        "slo_attainment": met / len(group) if group else 0.0,
        "goodput": met / duration_s if duration_s > 0 else 0.0,
        "mean_reward": reward if scored else None,
    }


def sliding_means(values: Sequence[float], window: int) -> np.ndarray:
    """The mean of every run of `window` consecutive values (none if there are fewer)."""
    if len(values) < window:
        return np.empty(0)
    sums = np.cumsum(np.concatenate(([0.0], np.asarray(values, dtype=float))))
    return (sums[window:] - sums[:-window]) / window


def summarize(
    outcomes: Sequence[Outcome], duration_s: float, window: int = 20, scored: bool = True
) -> dict:
    """Everything a run reports, as plain JSON-ready data. Every outcome counts: an error scores
    reward 0 and misses its SLO, so a run cannot look better by failing requests. `scored`
    False: the rewards mean nothing (no quality table of the serving deployment was known), and
    every reward is None."""
    ordered = sorted(outcomes, key=lambda o: o.arrival_s)
    done = [o for o in ordered if o.completed]
    output = sum(o.output_tokens for o in done)
    prompt = sum(o.prompt_tokens or 0 for o in done)
    models = Counter(o.model or "?" for o in done)
    rewards = sliding_means([o.reward for o in ordered] if scored else [], window)
    slo_windows = sliding_means([float(o.slo_met) for o in ordered], window)
    per_class = {}
    for cls in sorted({o.qos_class for o in ordered}):
        group = [o for o in ordered if o.qos_class == cls]
        group_done = [o for o in group if o.completed]
        per_class[cls] = {
            "sent": len(group),
            "completed": len(group_done),
            **_slo(group, duration_s, scored),
            **_latencies(group_done),
        }
    return {
        "sent": len(ordered),
        "completed": len(done),
        "errored": len(ordered) - len(done),
        "errors": dict(Counter(o.error_kind for o in ordered if o.error_kind).most_common()),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (output + prompt) / duration_s if duration_s > 0 else 0.0,
        "total_output_tokens": output,
        "total_input_tokens": prompt,
        **_latencies(done),
        **_slo(ordered, duration_s, scored),
        "max_lag_ms": max((o.lag_s for o in ordered), default=0.0) * 1000,
        "model_share": {m: n / len(done) for m, n in sorted(models.items())},
        "per_class": per_class,
        "window": window,
        "windows": {
            "mean_reward": rewards.tolist(),
            "slo_attainment": slo_windows.tolist(),
            "reward_at_least": {
                f"{t:.2f}": int((rewards >= t - 1e-9).sum()) for t in WINDOW_THRESHOLDS
            }
            if scored
            else {},
        },
    }


def format_summary(summary: dict, title: str = "Load run") -> str:
    """A printed table in `vllm bench serve`'s layout, then the per-class and reward rows."""
    lines = [f"{f' {title} ':=^60}"]

    def row(label: str, value: object, fmt: str = "{:.2f}") -> None:
        text = "-" if value is None else fmt.format(value) if isinstance(value, float) else value
        lines.append(f"{label:<44}{text:>16}")

    row("Requests sent:", summary["sent"])
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["errored"])
    for kind, n in summary["errors"].items():
        row(f"  {kind}:", n)
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    row("Request goodput (req/s):", summary["goodput"])
    row("SLO attainment:", summary["slo_attainment"], "{:.1%}")
    row("Mean reward:", summary["mean_reward"], "{:.3f}")
    row("Max send lag (ms):", summary["max_lag_ms"])
    for metric, name in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append(f"{f' {name} ':-^60}")
        for stat in ("mean", "median", "p99"):
            row(f"{stat.capitalize()} {metric.upper()} (ms):", summary[f"{stat}_{metric}_ms"])
    lines.append(f"{' Per QoS class ':-^60}")
    lines.append(
        f"{'class':<12}{'sent':>6}{'done':>6}{'SLO':>8}{'goodput':>9}{'reward':>8}{'p50 TTFT':>11}"
    )
    for cls, c in summary["per_class"].items():
        ttft = c["median_ttft_ms"]
        reward = c["mean_reward"]
        lines.append(
            f"{cls:<12}{c['sent']:>6}{c['completed']:>6}{c['slo_attainment']:>8.1%}"
            f"{c['goodput']:>9.2f}"
            + (f"{reward:>8.3f}" if reward is not None else f"{'-':>8}")
            + (f"{ttft:>8.1f} ms" if ttft is not None else f"{'-':>11}")
        )
    shares = ", ".join(f"{m} {s:.0%}" for m, s in summary["model_share"].items()) or "-"
    lines.append(f"Model share: {shares}")
    if counts := summary["windows"]["reward_at_least"]:
        lines.append(
            f"Windows of {summary['window']} by mean reward: "
            + ", ".join(f"{'=' if t == '1.00' else '>='}{t}: {n}" for t, n in counts.items())
        )
    lines.append("=" * 60)
    return "\n".join(lines)


# Token-streaming smoothness (Chatterbox §4.1, §4.3), for Eloquent


_CLOCK_NOISE_S = 1e-6
"""Gaps within this of the threshold are the threshold: in virtual time two renders one lost
token apart are 0.20000000000000018 s apart, which is 200 ms, not a stall."""


def stall_ratio(
    render_times: Sequence[float],
    session_end: float,
    threshold: float = 0.2,
    session_start: float | None = None,
) -> float:
    """Share of the session spent waiting in stalls: gaps between consecutive renders > threshold.

    Chatterbox §4.1 defines the stall ratio as "the amount of time that client side is waiting for
    tokens to render when stall is longer than 200ms" (footnote 1: "proportion of token wait
    time when inter-token gap exceeds 200ms"). A gap longer than `threshold` therefore counts
    whole, not only its part beyond the threshold, and shorter gaps count nothing; a gap of
    exactly `threshold` is not a stall. Only gaps between two renders count: the wait for the
    first token (prefill, not transport) and the time after the last are not inter-token gaps.
    The session runs from `session_start` (default: the first render) to `session_end`.
    `render_times` are per position, non-decreasing; several positions rendered at one instant
    make gaps of zero.
    """
    times = list(render_times)
    if any(later < earlier for earlier, later in zip(times, times[1:], strict=False)):
        raise ValueError("render_times must be non-decreasing")
    if not times:
        return 0.0
    start = times[0] if session_start is None else session_start
    if start > times[0] or session_end < times[-1]:
        raise ValueError("the session must span every render time")
    duration = session_end - start
    if duration <= 0:
        return 0.0
    stalled = sum(
        later - earlier
        for earlier, later in zip(times, times[1:], strict=False)
        if later - earlier > threshold + _CLOCK_NOISE_S
    )
    return stalled / duration


def late_share(
    generated_times: Sequence[float],
    rendered_times: Sequence[float | None],
    threshold: float = 0.4,
) -> float:
    """Share of tokens rendered more than `threshold` after generation (Chatterbox §4.3, "late
    tokens (delay since generation over 400ms)"). A token never rendered (None) is late; a delay
    of exactly `threshold` is not."""
    if len(generated_times) != len(rendered_times):
        raise ValueError("one render time per generated token")
    if not generated_times:
        return 0.0
    late = sum(
        1
        for generated, rendered in zip(generated_times, rendered_times, strict=True)
        if rendered is None or rendered - generated > threshold
    )
    return late / len(generated_times)
