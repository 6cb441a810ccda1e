"""How the API stops waiting for work when its client leaves (serving.api._unless_disconnected).

A unit test of the race logic; tests/test_api.py checks the same path end to end against real
engines (a client hanging up on a non-streamed request).
"""

from __future__ import annotations

import asyncio

import pytest

from serving.api import ClientGone, _unless_disconnected


class Client:
    """An ASGI `receive` that reports a disconnect when told to."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_work_that_finishes_first_returns_its_result() -> None:
    async def work() -> str:
        return "done"

    assert await _unless_disconnected(Client().receive, work()) == "done"


async def test_work_that_fails_first_raises_its_own_error() -> None:
    async def work() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await _unless_disconnected(Client().receive, work())


async def test_a_client_that_leaves_first_cancels_the_work() -> None:
    client, cancelled = Client(), asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.Event().wait()  # never finishes by itself
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiting = asyncio.create_task(_unless_disconnected(client.receive, work()))
    await asyncio.sleep(0)
    client.gone.set()
    with pytest.raises(ClientGone):
        await waiting
    assert cancelled.is_set()


async def test_work_done_as_the_client_leaves_is_handed_to_abandon() -> None:
    client, abandoned = Client(), []
    client.gone.set()

    async def work() -> str:
        return "generation"

    async def abandon(result: str) -> None:
        abandoned.append(result)

    with pytest.raises(ClientGone):
        await _unless_disconnected(client.receive, work(), abandon)
    assert abandoned == ["generation"]
