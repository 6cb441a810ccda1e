"""Arrival processes: when requests come, as seconds from the start of a run.

Every process is seeded and lazy: `process.iter(seed)` yields increasing arrival times one at a
time (an infinite process never ends), and `process.times(seed, duration)` collects them. The same
seed gives the same stream. The inter-arrival time of a Gamma process at rate λ with coefficient of
variation CV is Gamma(shape = 1/CV², scale = CV²/λ); CV = 1 is Poisson (see ../shared/WORKLOADS.md).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

_CHUNK = 1024
"""Inter-arrival gaps drawn per numpy call: one draw per arrival would dominate long runs."""


class ArrivalProcess(ABC):
    @abstractmethod
    def _generate(self, rng: np.random.Generator) -> Iterator[float]:
        """Increasing arrival times from 0, drawn from `rng` only."""

    def iter(self, seed: int) -> Iterator[float]:
        return self._generate(np.random.default_rng(seed))

    def times(
        self, seed: int, duration: float | None = None, limit: int | None = None
    ) -> np.ndarray:
        """Arrivals before `duration` seconds, at most `limit` of them; an infinite process
        needs one of the two."""
        stream: Iterable[float] = self.iter(seed)
        if duration is not None:
            stream = itertools.takewhile(lambda t: t < duration, stream)
        if limit is not None:
            stream = itertools.islice(stream, limit)
        elif duration is None and not self.finite:
            raise ValueError("an infinite arrival process needs a duration or a limit")
        return np.fromiter(stream, dtype=float)

    @property
    def finite(self) -> bool:
        return False


def _gamma_gaps(rng: np.random.Generator, rate: float, cv: float) -> Iterator[float]:
    shape = 1.0 / cv**2
    scale = cv**2 / rate
    while True:
        yield from rng.gamma(shape, scale, _CHUNK).tolist()


@dataclass(frozen=True)
class Gamma(ArrivalProcess):
    """A renewal process at `rate` requests/s whose gaps have coefficient of variation `cv`."""

    rate: float
    cv: float = 1.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.cv <= 0:
            raise ValueError(f"Gamma needs rate > 0 and cv > 0, got rate={self.rate}, cv={self.cv}")

    def _generate(self, rng: np.random.Generator) -> Iterator[float]:
        return itertools.accumulate(_gamma_gaps(rng, self.rate, self.cv))


def Poisson(rate: float) -> Gamma:  # noqa: N802 - reads as the process it makes
    """The stable workload of Chuppala (2024): exponential gaps at a fixed rate."""
    return Gamma(rate, 1.0)


@dataclass(frozen=True)
class Segment:
    duration: float
    rate: float


@dataclass(frozen=True)
class PiecewiseRate(ArrivalProcess):
    """A Gamma process whose rate is constant within each segment, restarted at each boundary
    (as AlpaServe turns per-interval counts into arrivals). A rate of 0 leaves a segment empty."""

    segments: tuple[Segment, ...]
    cv: float = 1.0

    @property
    def finite(self) -> bool:
        return True

    def _generate(self, rng: np.random.Generator) -> Iterator[float]:
        return _piecewise(rng, iter(self.segments), self.cv)


def _piecewise(rng: np.random.Generator, segments: Iterator[Segment], cv: float) -> Iterator[float]:
    start = 0.0
    for segment in segments:
        end = start + segment.duration
        if segment.rate > 0:
            t = start
            for gap in _gamma_gaps(rng, segment.rate, cv):
                t += gap
                if t >= end:
                    break
                yield t
        start = end


def maf1(
    counts: Sequence[float], interval_s: float = 60.0, rate_scale: float = 1.0, cv: float = 4.0
) -> PiecewiseRate:
    """MAF1-style arrivals, AlpaServe's method: each interval's invocation count becomes a Gamma
    process at count / interval × rate_scale. The CV is chosen, not measured, because per-minute
    counts say nothing about gaps within a minute; AlpaServe's default is 4."""
    segments = tuple(Segment(interval_s, c / interval_s * rate_scale) for c in counts)
    return PiecewiseRate(segments, cv)


@dataclass(frozen=True)
class SwitchingRate(ArrivalProcess):
    """MAF2-style unpredictable load, as in Chuppala (2024) §5.1.3: the rate jumps between
    `levels`, staying at each for an exponentially distributed time of mean `mean_duration_s`.
    The next level is drawn uniformly from the others, so every switch is a real jump.
    Infinite."""

    levels: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 48.0)
    mean_duration_s: float = 10.0
    cv: float = 1.0

    def __post_init__(self) -> None:
        if len(self.levels) < 2 or min(self.levels) <= 0:
            raise ValueError("SwitchingRate needs at least two positive rate levels")

    def segments(self, rng: np.random.Generator) -> Iterator[Segment]:
        level = int(rng.integers(len(self.levels)))
        while True:
            yield Segment(float(rng.exponential(self.mean_duration_s)), self.levels[level])
            level = (level + 1 + int(rng.integers(len(self.levels) - 1))) % len(self.levels)

    def _generate(self, rng: np.random.Generator) -> Iterator[float]:
        # The switching process draws from a child of the seed's generator, so `schedule` can
        # replay the levels alone without drawing every arrival again.
        return _piecewise(rng, self.segments(rng.spawn(1)[0]), self.cv)

    def schedule(self, seed: int, duration: float) -> list[tuple[float, float]]:
        """(start, rate) of each level `iter(seed)` visits before `duration`, for plotting."""
        out: list[tuple[float, float]] = []
        start = 0.0
        for segment in self.segments(np.random.default_rng(seed).spawn(1)[0]):
            if start >= duration:
                return out
            out.append((start, segment.rate))
            start += segment.duration
        return out


@dataclass(frozen=True)
class Replay(ArrivalProcess):
    """Fixed arrival times, for example from a trace; the seed changes nothing."""

    arrivals: tuple[float, ...]

    @property
    def finite(self) -> bool:
        return True

    def _generate(self, rng: np.random.Generator) -> Iterator[float]:
        return iter(self.arrivals)


@dataclass(frozen=True)
class ArrivalStats:
    count: int
    span_s: float
    rate: float
    """Arrivals per second over the span from the first to the last."""
    cv: float
    """Coefficient of variation of the gaps; 1 for Poisson."""

    def __str__(self) -> str:
        rate = f"{self.rate:.3g} req/s, CV {self.cv:.3g}"
        return f"{self.count} arrivals over {self.span_s:.1f} s: {rate}"


def arrival_stats(times: Sequence[float] | np.ndarray) -> ArrivalStats:
    """The achieved rate and gap CV, which every generated trace should report (AlpaServe does)."""
    t = np.asarray(times, dtype=float)
    if len(t) < 2:
        return ArrivalStats(len(t), 0.0, 0.0, 0.0)
    gaps = np.diff(t)
    span = float(t[-1] - t[0])
    mean = float(gaps.mean())
    return ArrivalStats(
        len(t),
        span,
        (len(t) - 1) / span if span else 0.0,
        float(gaps.std()) / mean if mean else 0.0,
    )
