"""`python -m experiments.masque` end to end, small: one seed of a few tunnels over the emulated
chain (client, proxy, target, each in its own namespace). Plumbing, not the figures: every inner
echo comes back whole and is counted, and the tables and plots are written. Needs root and
/dev/net/tun, as the emulator does; skipped without them."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from experiments import masque

# Root and /dev/net/tun, as the emulator needs: skipped without them, with the reason.
pytestmark = pytest.mark.usefixtures("netns")


def test_both_emulated_experiments_echo_every_stream_through_the_proxy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--experiments", "tunnels,nested", "--seeds", "1", "--tunnels", "3", "--streams", "4",
            "--out", str(tmp_path)]  # fmt: skip
    assert masque.main(argv) == 0
    with (tmp_path / "records.csv").open() as f:
        records = list(csv.DictReader(f))
    runs = {(r["experiment"], r["scheduler"]) for r in records}
    assert runs == {("tunnels", "fcfs"), ("tunnels", "rr"),
                    ("nested", "rr"), ("nested", "fcfs"), ("nested", "abs")}  # fmt: skip
    assert len(records) == 5 * 3 * 4  # every stream of every tunnel of every run
    for r in records:
        assert r["error"] == "", r
        assert float(r["latency_s"]) > 0.05  # at least a round trip of the 50 ms access link
        assert float(r["handshake_s"]) > 0.05
    # The inner packets went through the tunnels: counted on each group's first stream.
    firsts = [r for r in records if r["stream"] == "0"]
    assert all(int(r["packets_up"]) > 0 and int(r["packets_down"]) > 0 for r in firsts)
    assert {r["group"] for r in records if r["experiment"] == "nested"} == {"1", "2", "3"}
    out = capsys.readouterr().out
    assert "rr completes at least 2x fcfs" in out and "under outer abs" in out
    for name in ("tunnels.png", "nested.png", "tunnels.csv", "nested.csv"):
        assert (tmp_path / name).stat().st_size > 0


def test_an_unknown_experiment_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        masque.main(["--experiments", "tunnels,warp"])
    assert exit_.value.code == 2
    assert "unknown experiments ['warp']" in capsys.readouterr().err
