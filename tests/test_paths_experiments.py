"""`python -m experiments.paths` and `python -m experiments.paths_live`: plumbing, not results
(those are timing and training, for the run's note): every run and policy is accounted for, the
files are written, and on the LAN the network-aware DQN routes as the network-blind one does. The
live run needs root and /dev/net/tun, as the emulator does."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from experiments import paths, paths_live


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_small_simulated_run_compares_both_routers_on_both_mixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["paths", "--rates", "4", "--rate-seconds", "20", "--seconds", "30", "--seeds", "1",
            "--results", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert paths.main() == 0
    rows = _rows(tmp_path / "runs.csv")
    policies = {"dqn-blind", "dqn-net", "path-rule"} | {
        f"{m}-only" for m in ("opt-125m", "opt-1.3b", "opt-6.7b")
    }
    runs = {(r["mix"], r["workload"], r["policy"]) for r in rows}
    assert runs == {
        (m, w, p) for m in ("mixed", "lan") for w in ("stable", "unpredictable") for p in policies
    }
    for r in rows:
        assert int(r["requests"]) > 0 and 0 <= float(r["reward"]) <= 1
    # With every client on the LAN the path inputs are (nearly) zero: the same choices.
    lan = {(r["workload"], r["policy"]): float(r["reward"]) for r in rows if r["mix"] == "lan"}
    for kind in ("stable", "unpredictable"):
        assert abs(lan[kind, "dqn-net"] - lan[kind, "dqn-blind"]) <= 0.01
    summary = _rows(tmp_path / "summary.csv")
    assert {(s["mix"], s["workload"]) for s in summary} == {
        (m, w) for m in ("mixed", "lan") for w in ("stable", "unpredictable")
    }
    assert (tmp_path / "fig5-paths.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "LAN only, stable" in out and "mixed paths, unpredictable" in out


@pytest.mark.usefixtures("netns")  # root and /dev/net/tun, as the emulator needs
def test_a_small_live_run_accounts_for_every_request_on_every_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 8 s at 4 req/s draws a client on every path (the bad one once), seed 0.
    argv = ["paths_live", "--rates", "4", "--rate-seconds", "8", "--seconds", "0",
            "--results", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    assert paths_live.main() == 0
    rows = _rows(tmp_path / "runs.csv")
    assert [r["policy"] for r in rows] == ["dqn-blind", "dqn-net"]
    for r in rows:
        assert (r["errors"], r["unfinished"]) == ("0", "0"), r  # 4 req/s is calm
        assert 0 < float(r["live"]) <= 1 and 0 < float(r["simulated"]) <= 1
    for policy in ("dqn-blind", "dqn-net"):
        # One load generator a path, each behind its own link; the server measured each.
        for path in ("lan", "lte", "3g", "bad"):
            assert (tmp_path / f"{policy}-stable-4-s0.{path}.json").exists()
        log = (tmp_path / f"{policy}-stable-4-s0.requests-log.jsonl").read_text().splitlines()
        assert len(log) == int(rows[0]["requests"])
        rtts = sorted(float(line.split('"client_rtt_s":')[1].split(",")[0]) for line in log)
        assert rtts[0] < 0.03 and rtts[-1] > 0.35  # the LAN's client and the bad path's
