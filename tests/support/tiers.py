"""The test tiers: the markers of pyproject.toml that a test gets from the fixtures it uses
(`starts`), and the rule that a test which starts a server is in one (`require_tier`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., object])


def starts(*markers: str) -> Callable[[F], F]:
    """Declares what a fixture starts, as the tiers' markers of pyproject.toml: every test that
    uses it, however indirectly, gets those markers at collection. Put it under
    `@pytest.fixture`."""

    def declare(fixture: F) -> F:
        fixture._starts = markers  # type: ignore[attr-defined]  # read at collection
        return fixture

    return declare


TIERS = ("vllm", "twin", "netns", "browser")
"""The markers that place a test in a tier (pyproject.toml): a test that starts a server has one."""


running: pytest.Item | None = None
"""The test being set up, run or torn down (None between tests): tests/conftest.py keeps it."""


def require_tier(name: str) -> None:
    """Fail the running test if it is in no tier: a fixture that starts a server declares what
    it starts (`starts`), so that the fast tier's `-m` sees it; a test that starts one itself
    carries the marker. (Servers started for the session, in other threads, are declared by
    their fixtures.)"""
    item = running
    if item is not None and not any(item.get_closest_marker(tier) for tier in TIERS):
        pytest.fail(f"{item.nodeid} starts {name!r} but has none of the markers {TIERS}: "
                    "give the fixture that starts it @starts(...), or the test the marker",
                    pytrace=False)  # fmt: skip
