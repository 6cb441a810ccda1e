"""Eloquent over real aioquic connections and a bursty lossy link, in virtual time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from experiments.eloquent_sim import SCHEMES, Session, loss_limit, server_events, words
from netsim.link import GilbertElliott, LinkConfig, LinkDirection
from transport.tls import ensure_certificate


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return ensure_certificate(tmp_path_factory.mktemp("certs"), deterministic=True)


def test_gilbert_elliott_loses_its_mean_share_in_bursts() -> None:
    bursts = GilbertElliott()  # good 1 s, lossy 0.2 s at 90%
    assert bursts.mean_loss == pytest.approx(0.15)
    direction = LinkDirection(LinkConfig(rate_bps=1e12, bursts=bursts), random.Random(7))
    lost = [direction.admit(100, t * 0.01) is None for t in range(200_000)]  # 2,000 s
    assert sum(lost) / len(lost) == pytest.approx(0.15, abs=0.02)
    runs = [n for n in _runs(lost) if n > 1]
    assert max(runs) >= 10  # losses come in bursts: ten packets (0.1 s) in a row at least once


def _runs(flags: list[bool]) -> list[int]:
    out, n = [], 0
    for flag in flags:
        n = n + 1 if flag else 0
        if n == 1 or (not flag and out and out[-1] == 0):
            out.append(0)
        if flag:
            out[-1] = n
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_scheme_renders_exactly_the_streamed_text_under_heavy_loss(
    scheme: str, certificate: tuple[Path, Path]
) -> None:
    link = LinkConfig(delay_s=0.1, bursts=GilbertElliott(good_slots=2, bad_slots=2), seed=3)
    session = Session(scheme, link, certificate, count=60)
    session.run()
    receiver = session.receiver
    # At 45% loss both ways QUIC itself may give up (a run of lost probes backs its timeout
    # off past the idle timeout): what rendered until then must still be exact.
    shown = receiver.next_position if session.died else 60
    assert scheme not in ("stream", "eloquent") or not session.died
    assert "".join(receiver.text_of(p) for p in range(shown)) == "".join(words(60)[:shown])
    assert [e.position for e in receiver.events][:shown] == list(range(shown))
    # What the client's reader got is the server's event stream, byte for byte.
    events = server_events(words(60))
    got = [receiver.event_of(p) for p in range(receiver.next_event)]
    assert got == events[: receiver.next_event]
    assert receiver.stats.mismatches == 0
    assert sum(session.path.losses) > 0
    m = session.metrics()
    assert 0 <= m["stall_ratio"] <= 1 and 0 <= m["late_share"] <= 1


def test_eloquent_renders_earlier_than_the_stream_alone_and_runs_repeat(
    certificate: tuple[Path, Path],
) -> None:
    def run(scheme: str) -> dict[str, float]:
        link = LinkConfig(delay_s=0.2, bursts=GilbertElliott(), seed=1)
        session = Session(scheme, link, certificate, count=100)
        session.run()
        return session.metrics()

    stream, eloquent = run("stream"), run("eloquent")
    assert eloquent["mean_delay_s"] < stream["mean_delay_s"]
    assert eloquent["late_share"] < stream["late_share"]
    assert run("eloquent") == eloquent  # virtual time and a seed: the same run twice


def test_the_loss_limit_is_zero_without_loss_and_grows_with_the_bursts() -> None:
    calm = LinkConfig(delay_s=0.2)
    assert loss_limit(calm, 300) == 0.0
    limits = [loss_limit(calm.replace(bursts=GilbertElliott(bad_slots=b), seed=0), 300)
              for b in (2, 5)]  # fmt: skip
    assert 0 < limits[0] < limits[1] < 1
