"""The link model (`transport.link`): rate, drop-tail queue and delay, on a virtual clock."""

from __future__ import annotations

import random

import pytest

from transport.link import LinkConfig, LinkDirection

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
