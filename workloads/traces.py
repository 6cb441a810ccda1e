"""Real request traces: the Azure LLM inference traces (Patel et al., Splitwise, ISCA 2024,
CC-BY 4.0) and the per-minute invocation counts of the Azure Functions 2019 trace (MAF1).

The LLM traces are CSV files `TIMESTAMP,ContextTokens,GeneratedTokens` whose timestamps carry seven
fractional digits. They are read from where the user keeps them (by default ../shared/traces);
nothing here copies them.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

DEFAULT_TRACE_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
NAMED_TRACES = {
    "code": "AzureLLMInferenceTrace_code.csv",
    "conv": "AzureLLMInferenceTrace_conv.csv",
}


class TraceError(ValueError):
    """A trace file is missing or malformed; the message names the file and the line."""


@dataclass(frozen=True)
class TraceRecord:
    arrival: float
    """Seconds from the first request of the window."""
    prompt_tokens: int
    output_tokens: int


def resolve_trace(name_or_path: str, trace_dir: str | Path = DEFAULT_TRACE_DIR) -> Path:
    """'code' or 'conv' name a file in `trace_dir`; anything else is a path."""
    if name_or_path in NAMED_TRACES:
        return Path(trace_dir) / NAMED_TRACES[name_or_path]
    return Path(name_or_path)


def _timestamp(text: str) -> float:
    # Python's %f takes at most six digits; the traces carry seven (100 ns ticks).
    head, _, frac = text.strip().partition(".")
    stamp = datetime.strptime(f"{head}.{frac[:6] or '0'}", "%Y-%m-%d %H:%M:%S.%f")
    return stamp.replace(tzinfo=UTC).timestamp()


def read_azure_trace(
    path: str | Path,
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    time_scale: float = 1.0,
    target_rate: float | None = None,
) -> list[TraceRecord]:
    """The requests of one window of a trace, with arrivals from the window's start.

    The window is [start_s, start_s + duration_s) seconds after the trace's first request, in
    the trace's own time. Then time is compressed: t' = t / time_scale, so 2 replays twice as
    fast; or, with `target_rate`, by whatever factor gives that mean rate.
    """
    path = Path(path)
    try:
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from exc
    if not rows or [c.strip() for c in rows[0]] != [
        "TIMESTAMP",
        "ContextTokens",
        "GeneratedTokens",
    ]:
        raise TraceError(f"{path}: expected the header TIMESTAMP,ContextTokens,GeneratedTokens")
    parsed: list[tuple[float, int, int]] = []
    for line, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        try:
            stamp, context, generated = row
            parsed.append((_timestamp(stamp), int(context), int(generated)))
        except ValueError as exc:
            raise TraceError(f"{path}:{line}: {exc}") from None
    if not parsed:
        raise TraceError(f"{path}: no requests")
    parsed.sort(key=lambda r: r[0])
    t0 = parsed[0][0] + start_s
    end = float("inf") if duration_s is None else t0 + duration_s
    window = [(t - t0, c, g) for t, c, g in parsed if t0 <= t < end]
    if not window:
        raise TraceError(f"{path}: no requests in the window [{start_s}, {start_s}+{duration_s}) s")
    if target_rate is not None:
        span = window[-1][0] - window[0][0]
        if len(window) < 2 or span <= 0:
            raise TraceError(f"{path}: the window is too short to rescale to a rate")
        time_scale = target_rate / ((len(window) - 1) / span)
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    first = window[0][0]
    return [TraceRecord((t - first) / time_scale, c, g) for t, c, g in window]


def per_interval_counts(arrivals: Sequence[float], interval_s: float = 60.0) -> list[int]:
    """How many arrivals fall in each interval: a rate histogram, as MAF1 gives per function."""
    if not len(arrivals):
        return []
    bins = int(np.floor(max(arrivals) / interval_s)) + 1
    counts, _ = np.histogram(arrivals, bins=bins, range=(0, bins * interval_s))
    return counts.tolist()


def read_maf1_counts(path: str | Path, top_functions: int | None = None) -> list[int]:
    """Per-minute invocation counts, summed over functions, from one day of the Azure Functions
    2019 trace (invocations_per_function_md.anon.dNN.csv: four hash/trigger columns, then one
    column per minute). `top_functions` keeps only the busiest ones, as Clockwork does."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            rows = [[int(x) for x in row[4:]] for row in reader if row]
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from exc
    except ValueError as exc:
        raise TraceError(f"{path}: {exc}") from None
    if header is None or not rows or len(header) < 5:
        raise TraceError(f"{path}: expected HashOwner,HashApp,HashFunction,Trigger,1,2,...")
    counts = np.array(rows)
    if top_functions is not None:
        counts = counts[np.argsort(-counts.sum(axis=1), kind="stable")[:top_functions]]
    return counts.sum(axis=0).tolist()
