"""Workload generators: rates and CVs for fixed seeds, trace parsing, contents and sessions."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from workloads.arrivals import (
    Gamma,
    PiecewiseRate,
    Poisson,
    Segment,
    SwitchingRate,
    arrival_stats,
    maf1,
)
from workloads.generate import (
    Sessions,
    TaskShape,
    WorkloadSpec,
    from_trace,
    load_prompts,
    parse_mix,
    requests,
)
from workloads.summary import Outcome, sliding_means, summarize
from workloads.traces import (
    NAMED_TRACES,
    TraceError,
    per_interval_counts,
    read_azure_trace,
    read_maf1_counts,
    resolve_trace,
)


@pytest.mark.parametrize(
    "process, rate, cv",
    [(Poisson(5.0), 5.0, 1.0), (Gamma(2.0, 0.5), 2.0, 0.5), (Gamma(8.0, 4.0), 8.0, 4.0)],
)
def test_renewal_processes_have_their_rate_and_cv(process: Gamma, rate: float, cv: float) -> None:
    stats = arrival_stats(process.times(seed=7, limit=20_000))
    # 20,000 gaps: the sample rate is within ~1% (CV 1) to ~4% (CV 4) of the truth at 1 sigma.
    assert stats.rate == pytest.approx(rate, rel=0.12 if cv > 1 else 0.04)
    assert stats.cv == pytest.approx(cv, rel=0.12 if cv > 1 else 0.04)


@pytest.mark.parametrize(
    "process",
    [Poisson(3.0), Gamma(3.0, 2.0), maf1([30, 0, 90]), SwitchingRate(mean_duration_s=2.0)],
    ids=["poisson", "gamma", "maf1", "switching"],
)
def test_same_seed_same_stream_and_lazy_matches_eager(process) -> None:
    eager = process.times(seed=3, duration=120.0)
    assert np.array_equal(eager, process.times(seed=3, duration=120.0))
    assert not np.array_equal(eager[:20], process.times(seed=4, duration=120.0)[:20])
    lazy = list(itertools.islice(process.iter(3), 25))
    assert lazy == process.times(seed=3, limit=25).tolist() == eager[:25].tolist()
    assert np.all(np.diff(eager) >= 0)  # CV 4 gaps can underflow to simultaneous arrivals


def test_an_infinite_process_needs_a_bound() -> None:
    with pytest.raises(ValueError, match="duration or a limit"):
        Poisson(1.0).times(seed=0)


def test_piecewise_rates_follow_their_histogram() -> None:
    counts = [600, 0, 3000, 1200]
    times = maf1(counts, interval_s=60.0, cv=1.0).times(seed=11)
    achieved = per_interval_counts(times.tolist(), 60.0)
    assert achieved[1] == 0
    for want, got in zip(counts, achieved, strict=True):
        assert got == pytest.approx(want, abs=4 * np.sqrt(want) + 1)


def test_maf1_uses_the_chosen_cv() -> None:
    # AlpaServe's default CV of 4, at 100 req/s for ten minutes.
    stats = arrival_stats(maf1([6000] * 10, cv=4.0).times(seed=5))
    assert stats.cv == pytest.approx(4.0, rel=0.12)
    assert stats.rate == pytest.approx(100.0, rel=0.12)


def test_switching_rate_jumps_between_levels_at_random_times() -> None:
    process = SwitchingRate(levels=(1.0, 10.0, 40.0), mean_duration_s=20.0)
    duration = 4000.0
    times = process.times(seed=9, duration=duration)
    schedule = process.schedule(seed=9, duration=duration)
    starts = [s for s, _ in schedule] + [duration]
    rates = [r for _, r in schedule]
    assert all(a != b for a, b in itertools.pairwise(rates))
    lengths = np.diff(starts[:-1])
    assert lengths.mean() == pytest.approx(20.0, rel=0.25)
    expected = sum(r * (b - a) for r, a, b in zip(rates, starts, starts[1:], strict=False))
    assert len(times) == pytest.approx(expected, rel=0.05)
    # Each level's own stretch has that level's rate, so the schedule describes the stream.
    ends = np.searchsorted(times, starts)
    for rate, a, b, lo, hi in zip(rates, starts, starts[1:], ends, ends[1:], strict=False):
        if rate * (b - a) > 400:
            assert (hi - lo) == pytest.approx(rate * (b - a), rel=0.2)


def test_piecewise_segments_are_empty_at_rate_zero() -> None:
    times = PiecewiseRate((Segment(10.0, 0.0), Segment(10.0, 5.0))).times(seed=1)
    assert times.min() >= 10.0 and times.max() < 20.0


TRACE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:47.1805901,396,109\n"
    "2023-11-16 18:15:50.0000000,879,2\n"
    "2023-11-16 18:16:10.4000000,91,0"  # no trailing newline, as in the real conv file
)


def test_trace_parsing_handles_seven_digits_and_no_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    records = read_azure_trace(path)
    assert [r.arrival for r in records] == pytest.approx([0.0, 0.5000001, 3.3194100, 23.71941])
    assert [(r.prompt_tokens, r.output_tokens) for r in records] == [
        (374, 44), (396, 109), (879, 2), (91, 0)
    ]  # fmt: skip
    window = read_azure_trace(path, start_s=0.4, duration_s=5.0, time_scale=2.0)
    assert [r.prompt_tokens for r in window] == [396, 879]
    assert [r.arrival for r in window] == pytest.approx([0.0, (3.31941 - 0.5000001) / 2])
    rescaled = read_azure_trace(path, target_rate=1.0)
    assert arrival_stats([r.arrival for r in rescaled]).rate == pytest.approx(1.0)


def test_a_malformed_trace_is_named_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(TRACE.replace("879,2", "879,two"))
    with pytest.raises(TraceError, match=r"bad.csv:4"):
        read_azure_trace(path)
    path.write_text("a,b\n1,2")
    with pytest.raises(TraceError, match="header"):
        read_azure_trace(path)
    with pytest.raises(TraceError, match="cannot read"):
        read_azure_trace(tmp_path / "missing.csv")


def test_the_real_traces_measure_as_documented() -> None:
    path = resolve_trace("conv")
    if not path.exists():
        pytest.skip(f"{path} is not here")
    stats = arrival_stats([r.arrival for r in read_azure_trace(path)])
    assert (stats.count, round(stats.rate, 2), round(stats.cv, 2)) == (19366, 5.53, 1.09)
    assert set(NAMED_TRACES) == {"code", "conv"}


def test_maf1_counts_sum_the_busiest_functions(tmp_path: Path) -> None:
    path = tmp_path / "invocations_per_function_md.anon.d01.csv"
    path.write_text(
        "HashOwner,HashApp,HashFunction,Trigger,1,2,3\n"
        "o1,a1,f1,http,1,0,2\no2,a2,f2,timer,10,10,10\no3,a3,f3,queue,0,5,0\n"
    )
    assert read_maf1_counts(path) == [11, 15, 12]
    assert read_maf1_counts(path, top_functions=2) == [10, 15, 10]


def test_mixes_and_lengths_follow_the_spec() -> None:
    spec = WorkloadSpec(
        Poisson(10.0),
        tasks=parse_mix("hellaswag,copa,piqa,openbookqa"),
        classes=parse_mix("real-time=3,free-tier=1"),
        shapes={"copa": TaskShape((300, 400), (5, 9))},
    )
    reqs = list(requests(spec, seed=2, limit=8000))
    tasks = {t: sum(r.task == t for r in reqs) / len(reqs) for t in spec.tasks}
    assert all(share == pytest.approx(0.25, abs=0.03) for share in tasks.values())
    assert sum(r.qos_class == "real-time" for r in reqs) / len(reqs) == pytest.approx(
        0.75, abs=0.03
    )
    copa = [r for r in reqs if r.task == "copa"]
    assert {r.max_tokens for r in copa} == set(range(5, 10))
    assert all(280 <= r.prompt_tokens <= 460 for r in copa)
    assert all(32 <= r.max_tokens <= 128 for r in reqs if r.task != "copa")
    assert reqs == list(requests(spec, seed=2, limit=8000))


def test_the_mix_does_not_move_the_arrivals() -> None:
    a = [r.arrival for r in requests(WorkloadSpec(Poisson(4.0)), seed=5, limit=200)]
    other = WorkloadSpec(Poisson(4.0), classes={"long": 1.0}, sessions=Sessions())
    assert a == [r.arrival for r in requests(other, seed=5, limit=200)]


def test_a_trace_sets_arrivals_and_lengths(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    spec = from_trace(read_azure_trace(path), max_prompt_tokens=500, max_output_tokens=100)
    reqs = list(requests(spec, seed=0))
    assert [r.max_tokens for r in reqs] == [44, 100, 2, 1]
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 0.5000001, 3.31941, 23.71941])
    assert reqs[0].prompt_tokens == pytest.approx(374, rel=0.1)
    assert all(r.prompt_tokens <= 500 for r in reqs)


def text_of(request) -> str:
    return "".join(f"<{m.role}>{m.content}" for m in request.prompt)


def test_multi_turn_prompts_share_growing_prefixes() -> None:
    spec = WorkloadSpec(Poisson(5.0), sessions=Sessions(turns=(3, 5), new_share=0.3))
    reqs = list(requests(spec, seed=4, limit=300))
    by_session: dict[str, list] = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert len(multi) > 20
    for turns in by_session.values():
        assert len(turns) <= 5
        assert len({(r.task, r.qos_class) for r in turns}) == 1
        for earlier, later in itertools.pairwise(turns):
            # Turn n repeats turns 1..n-1 (with their answers), then asks one more question.
            assert later.prompt[: len(earlier.prompt)] == earlier.prompt
            assert text_of(later).startswith(text_of(earlier))
            assert [m.role for m in later.prompt[len(earlier.prompt) :]] == ["assistant", "user"]
            assert later.prompt_tokens > earlier.prompt_tokens
    firsts = [turns[0].prompt[0].content for turns in by_session.values()]
    assert len(set(firsts)) == len(firsts), "each conversation's prefix is its own"


def test_prompts_can_come_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"task": "copa", "prompt": "Premise: it rained."}\n\n'
                    '{"task": "copa", "prompt": "Premise: it snowed."}\n')  # fmt: skip
    spec = WorkloadSpec(Poisson(1.0), tasks={"copa": 1.0}, prompts=load_prompts(path))
    texts = {r.prompt[0].content for r in requests(spec, seed=0, limit=40)}
    assert texts == {"Premise: it rained.", "Premise: it snowed."}
    path.write_text('{"task": "copa"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        load_prompts(path)


def test_bad_specs_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="no prompts for task"):
        WorkloadSpec(Poisson(1.0), tasks={"gsm8k": 1.0})
    with pytest.raises(ValueError, match="classes mix"):
        WorkloadSpec(Poisson(1.0), classes={"free-tier": 0.0})
    with pytest.raises(ValueError, match="bad weight"):
        parse_mix("a=x")
    with pytest.raises(ValueError, match="rate > 0"):
        Gamma(0.0)


def outcome(i: int, reward: float, error: str | None = None, **kw) -> Outcome:
    return Outcome(f"r{i}", "free-tier", "copa", float(i), error_kind=error, reward=reward,
                   slo_met=reward > 0, **kw)  # fmt: skip


def test_the_summary_counts_every_request_and_its_windows() -> None:
    outcomes = [outcome(i, 1.0, ttft_s=0.1, e2el_s=1.1, output_tokens=11, model="m")
                for i in range(25)]  # fmt: skip
    outcomes += [outcome(25 + i, 0.0, error="http_503") for i in range(5)]
    summary = summarize(outcomes, duration_s=10.0, window=20)
    assert (summary["sent"], summary["completed"], summary["errored"]) == (30, 25, 5)
    assert summary["errors"] == {"http_503": 5}
    assert summary["median_tpot_ms"] == pytest.approx(100.0)
    assert summary["goodput"] == pytest.approx(2.5)
    assert summary["mean_reward"] == pytest.approx(25 / 30)
    # 11 windows of 20: the first six hold only rewards of 1.
    assert summary["windows"]["reward_at_least"]["1.00"] == 6
    assert len(summary["windows"]["mean_reward"]) == 11
    assert sliding_means([1, 2, 3], 2).tolist() == [1.5, 2.5]
