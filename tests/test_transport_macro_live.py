"""`python -m experiments.transport_macro_live`: the same requests in virtual time and live over
the emulator, scored alike. Plumbing, not agreement (that is timing, for the run's note): both
modes account for every request, the live server runs the stack asked of it, and the comparison
and its plot are written. The live run needs root and /dev/net/tun, as the emulator does."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from experiments import transport_macro_live
from experiments.transport_macro import workload
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec
from workloads.summary import Outcome


@pytest.mark.usefixtures("netns")  # root and /dev/net/tun, as the emulator needs
def test_a_small_run_accounts_for_every_request_both_ways(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--policies", "dqn", "--stacks", "ml,h2-tls", "--rates", "2", "--seconds", "4",
            "--out", str(tmp_path)]  # fmt: skip
    assert transport_macro_live.main(argv) == 0
    with (tmp_path / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    sent = len(workload(WorkloadSpec(Poisson(2.0)), 0, 4.0))
    assert {(r["mode"], r["stack"]) for r in rows} == {
        (m, s) for m in ("virtual", "live") for s in ("ml", "h2-tls")
    }
    for r in rows:
        assert int(r["requests"]) == sent
        assert (r["errors"], r["unfinished"]) == ("0", "0"), r  # 2 req/s is calm
        assert 0 < float(r["score"]) <= 1
    for r in (r for r in rows if r["mode"] == "live"):
        assert r["client_kept_up"] == "True"
        # The long requests' prompts, as the live server's tokenizer counted them.
        assert 1000 < int(r["prompt_tokens_long"]) < 2000
    for stack in ("ml", "h2-tls"):
        record = tmp_path / "live" / f"dqn-{stack}-r2-s0.server.log"
        assert record.exists()
    with (tmp_path / "comparison.csv").open() as f:
        comparison = list(csv.DictReader(f))
    assert {(c["stack"], c["rate"]) for c in comparison} == {
        (s, r) for s in ("ml", "h2-tls") for r in ("2", "all")
    }
    assert (tmp_path / "comparison.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "of 2 cells (mean over their rates) within 0.05" in out
    # The report reprints it without running anything.
    assert transport_macro_live.main(["--report", "--out", str(tmp_path)]) == 0
    assert "of 2 runs (one rate) within 0.05" in capsys.readouterr().out


def test_a_live_outcome_is_put_on_the_co_simulations_clock() -> None:
    request = workload(WorkloadSpec(Poisson(2.0)), 0, 4.0)[0]

    def outcome(**fields: object) -> Outcome:
        return Outcome(request.request_id, request.qos_class, request.task, request.arrival,
                       lag_s=0.01, credit_wait_s=0.5, **fields)  # type: ignore[arg-type]  # fmt: skip

    done = transport_macro_live.as_delivery(
        request, outcome(status=200, model="opt-1.3b", ttft_s=0.2, e2el_s=1.0, output_tokens=9)
    )
    assert (done.status, done.model, done.tokens) == (200, "opt-1.3b", 9)
    # The SLO's clock starts at the scheduled sending: lateness and the wait for credit count.
    assert done.first_token == pytest.approx(request.arrival + 0.71)
    assert done.done == pytest.approx(request.arrival + 1.51)
    assert done.sent == request.arrival
    refused = transport_macro_live.as_delivery(
        request, outcome(status=504, error_kind="http_504", error="deadline", e2el_s=1.0)
    )
    assert refused.status == 504
    cut = transport_macro_live.as_delivery(request, outcome(error_kind="connection", error="reset"))
    assert (cut.status, cut.done) == (0, None)
    broken = transport_macro_live.as_delivery(
        request, outcome(status=200, error_kind="stream", error="ended without [DONE]", e2el_s=1.0)
    )
    assert broken.status == 0  # its 200 came, but not the whole answer: not a success
    late = transport_macro_live.as_delivery(request, outcome(error_kind="timeout", error="late"))
    assert late.status is None  # not done, as the co-simulation leaves one at its horizon


@pytest.mark.parametrize(
    "args, says",
    [
        (["--stacks", "quic"], "unknown stacks"),
        (["--policies", "threshold"], "no live twin"),
        (["--rates", "1,x"], "--rates takes numbers"),
        (["--seconds", "0"], "finite numbers above 0"),
        (["--report", "--out", "/nonexistent"], "no run to report"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        transport_macro_live.main(args)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
