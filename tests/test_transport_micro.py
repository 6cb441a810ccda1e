"""`python -m experiments.transport_micro` end to end, small: one seed of 10 requests over the
emulated 3G link, on one QUIC stack and one TLS/TCP stack. Plumbing, not the figures: every
request comes back whole and is counted, and the tables and plots are written. Needs root and
/dev/net/tun, as the emulator does; skipped without them."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from experiments import transport_micro

# Root and /dev/net/tun, as the emulator needs: skipped without them, with the reason.
pytestmark = pytest.mark.usefixtures("netns")


def test_one_seed_on_two_stacks_echoes_every_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--stacks", "ml,h2-tls", "--seeds", "1", "--requests", "10", "--out", str(tmp_path)]
    assert transport_micro.main(argv) == 0
    with (tmp_path / "requests.csv").open() as f:
        requests = list(csv.DictReader(f))
    assert len(requests) == 20
    assert {r["stack"] for r in requests} == {"ml", "h2-tls"}
    classes = transport_micro.draw(0, 10)
    for stack in ("ml", "h2-tls"):
        mine = sorted((r for r in requests if r["stack"] == stack), key=lambda r: int(r["index"]))
        assert [r["qos_class"] for r in mine] == classes
        for r in mine:
            assert r["error"] == "", r  # an echo of the whole body, timed
            assert float(r["latency_s"]) > 0.05  # at least a round trip of the 50 ms link
    with (tmp_path / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    assert {(r["stack"], r["class"]) for r in summary} == {
        (s, c) for s in ("ml", "h2-tls") for c in set(classes)
    }
    assert (tmp_path / "fig7_completion.png").stat().st_size > 0
    assert (tmp_path / "fig8_latency.png").stat().st_size > 0
    assert "TLS/TCP on one connection" in capsys.readouterr().out


def test_an_unknown_stack_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        transport_micro.main(["--stacks", "ml,quic"])
    assert exit_.value.code == 2
    assert "unknown stacks ['quic']" in capsys.readouterr().err
