"""The link model (`netsim.link`): rate, drop-tail queue and delay, on a virtual clock."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from netsim.link import DeliveryTrace, GilbertElliott, LinkConfig, LinkDirection

SIZE = 1000
"""Bytes a datagram: 1.6 ms on the wire at 5 Mbit/s."""


def direction(**config: float) -> LinkDirection:
    return LinkDirection(LinkConfig(**config), random.Random(0))  # type: ignore[arg-type]


def test_datagrams_leave_one_after_another_then_cross_the_delay() -> None:
    link = direction(rate_bps=5e6, delay_s=0.025)
    arrivals = [link.admit(SIZE, now=0.0) for _ in range(3)]
    assert arrivals == pytest.approx([0.0266, 0.0282, 0.0298])
    assert link.admit(SIZE, now=1.0) == pytest.approx(1.0266)  # an idle link starts at once


def test_a_full_queue_drops_the_tail_and_frees_as_datagrams_leave() -> None:
    link = direction(rate_bps=5e6, delay_s=0.0, queue_bytes=10 * SIZE)
    offered = [link.admit(SIZE, now=0.0) for _ in range(12)]
    assert [a is not None for a in offered] == [True] * 10 + [False] * 2
    assert (link.sent, link.dropped, link.queued_bytes) == (10, 2, 10 * SIZE)
    # 3 have left by 5 ms (1.6, 3.2, 4.8 ms): room for 3 more, not 4.
    later = [link.admit(SIZE, now=0.005) for _ in range(4)]
    assert [a is not None for a in later] == [True] * 3 + [False]
    assert link.queued_bytes == 10 * SIZE
    # Once everything has left, the queue is empty again.
    assert link.admit(SIZE, now=1.0) is not None
    assert link.queued_bytes == SIZE


def test_iid_loss_drops_its_share_under_a_seed() -> None:
    link = direction(rate_bps=1e9, loss=0.1)
    lost = sum(link.admit(SIZE, now=i * 0.001) is None for i in range(20_000))
    assert lost == link.dropped
    assert lost / 20_000 == pytest.approx(0.1, abs=0.01)


def test_each_direction_has_its_own_settings() -> None:
    link = LinkConfig(rate_bps=1e6, delay_s=0.01, downlink=LinkConfig(rate_bps=8e6))
    up, down = link.directions()
    assert up.admit(SIZE, now=0.0) == pytest.approx(0.008 + 0.01)
    assert down.admit(SIZE, now=0.0) == pytest.approx(0.001 + 0.025)


def test_gilbert_elliott_in_slots_reproduces_its_mean_loss() -> None:
    bursts = GilbertElliott(good_slots=8, bad_slots=4, bad_loss=0.6, good_loss=0.01, slot_s=0.01)
    assert bursts.mean_loss == pytest.approx(4 / 12 * 0.6 + 8 / 12 * 0.01)
    link = LinkDirection(LinkConfig(rate_bps=1e9, bursts=bursts), random.Random(5))
    # 2,000 s, a packet every 2 ms: about 17,000 good and bad periods.
    lost = [link.admit(SIZE, now=i * 0.002) is None for i in range(1_000_000)]
    assert sum(lost) / len(lost) == pytest.approx(bursts.mean_loss, rel=0.03)
    # Losses come in bursts: one loss makes the next far likelier than the mean.
    after_loss = [b for a, b in zip(lost, lost[1:], strict=False) if a]
    assert sum(after_loss) / len(after_loss) > 2.5 * bursts.mean_loss


def test_gilbert_elliott_refuses_periods_shorter_than_a_slot() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        GilbertElliott(good_slots=0.5)
    with pytest.raises(ValueError, match="bad_loss"):
        GilbertElliott(bad_loss=1.5)


def test_a_trace_delivers_an_mtu_per_opportunity_and_loops() -> None:
    trace = DeliveryTrace((0, 0, 5, 10))  # 4 opportunities every 10 ms: 4.8 Mbit/s
    assert trace.mean_rate_bps == pytest.approx(4 * 1500 * 8 / 0.010)
    link = LinkDirection(LinkConfig(trace=trace, delay_s=0.0), random.Random(0))
    arrivals = [link.admit(1500, now=0.0) for _ in range(6)]
    # Opportunities at 0, 0, 5, 10 ms, then the loop's 10 (its 0), 10, 15...
    assert arrivals == pytest.approx([0.0, 0.0, 0.005, 0.010, 0.010, 0.010])
    # Small packets share an opportunity; one opportunity's unused bytes are lost when the
    # queue runs dry, so a packet arriving later waits for the next one.
    link = LinkDirection(LinkConfig(trace=trace, delay_s=0.0), random.Random(0))
    assert [link.admit(500, now=0.0) for _ in range(4)] == pytest.approx([0, 0, 0, 0])
    assert link.admit(500, now=0.001) == pytest.approx(0.005)
    # A packet of 2 MTUs takes two opportunities. The trace starts at the first packet.
    link = LinkDirection(LinkConfig(trace=trace, delay_s=0.0), random.Random(0))
    assert link.admit(1500, now=0.002) == pytest.approx(0.002)
    assert link.admit(3000, now=0.002) == pytest.approx(0.007)


def test_a_trace_reproduces_its_rate_over_many_loops() -> None:
    trace = DeliveryTrace(tuple(sorted(random.Random(1).choices(range(1, 101), k=300))) + (100,))
    link = LinkDirection(LinkConfig(trace=trace, delay_s=0.0, queue_bytes=10**9), random.Random(0))
    last = max(link.admit(1500, now=0.0) or 0 for _ in range(30_000))
    assert 30_000 * 1500 * 8 / last == pytest.approx(trace.mean_rate_bps, rel=0.01)


def test_a_trace_file_is_read_or_refused_with_its_line(tmp_path: Path) -> None:
    good = tmp_path / "good.trace"
    good.write_text("1\n1\n3\n\n4\n")
    assert DeliveryTrace.read(good).opportunities_ms == (1, 1, 3, 4)
    bad = tmp_path / "bad.trace"
    bad.write_text("1\nfast\n")
    with pytest.raises(ValueError, match=r"bad.trace:2: expected a millisecond"):
        DeliveryTrace.read(bad)
    with pytest.raises(ValueError, match="cannot read"):
        DeliveryTrace.read(tmp_path / "missing.trace")
    with pytest.raises(ValueError, match="never decrease"):
        DeliveryTrace((5, 3))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rate_bps": -1.0}, "rate"),
        ({"rate_bps": 0.0}, "rate"),
        ({"loss": 1.5}, "loss rate"),
        ({"loss": -0.1}, "loss rate"),
        ({"delay_s": -0.01}, "delay"),
    ],
)
def test_bad_link_settings_are_refused(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkConfig(**settings)  # type: ignore[arg-type]


def test_a_backlogged_trace_uses_every_opportunity_on_a_live_clock() -> None:
    # A live clock reads thousands of seconds; rounding there once skipped the second of two
    # opportunities in one millisecond, and a saturated 12 Mbit/s trace carried 9.
    trace = DeliveryTrace((2, 2, 4, 4, 6, 6, 8, 8, 10, 10))
    link = LinkDirection(LinkConfig(trace=trace, delay_s=0.0), random.Random(0))
    jitter = random.Random(1)
    offered = [(k * 0.0016 + jitter.random() * 0.0005 + 1000.123) for k in range(2000)]
    arrivals = [a for t in offered for a in (link.admit(1500, t), link.admit(1500, t))]
    delivered = [a for a in arrivals if a is not None]
    rate = len(delivered) * 1500 * 8 / (max(delivered) - offered[0])
    assert rate == pytest.approx(trace.mean_rate_bps, rel=0.01)
