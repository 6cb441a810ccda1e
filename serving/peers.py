"""Where the workers of one server (`--workers N`) ask each other what only each one knows:
each answers on a Unix socket of its own in the shared view's folder.

Only the dashboard asks, once per snapshot, for the others' recent decisions and outcomes
(`serving.recent.Recent.export`), which are too varied for the shared rows. A question is a
connection; the answer is the whole JSON body, then the close. A worker that does not answer
within the timeout (dead, restarting, or stalled) is left out of that snapshot, which says how
many workers it covers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

from serving.shared_view import SharedView

ASK_TIMEOUT_S = 0.5


class Peers:
    def __init__(self, view: SharedView, index: int, answer: Callable[[], Any]) -> None:
        """`answer()`: what this worker tells the others, as JSON-able data."""
        self.view = view
        self.index = index
        self.answer = answer
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        path = self.view.socket(self.index)
        path.unlink(missing_ok=True)  # left by this worker's previous life
        self._server = await asyncio.start_unix_server(self._answer, path=str(path))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self.view.socket(self.index).unlink(missing_ok=True)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(json.dumps(self.answer(), separators=(",", ":")).encode())
            await writer.drain()
        except ConnectionError:
            pass  # the asker gave up (its timeout): nothing to answer
        finally:
            writer.close()

    async def ask(self, timeout_s: float = ASK_TIMEOUT_S) -> list[Any]:
        """Every other worker's answer, in no order; those that gave none within `timeout_s`
        left out."""
        others = [i for i in range(self.view.workers) if i != self.index]
        answers = await asyncio.gather(
            *(asyncio.wait_for(self._ask(i), timeout_s) for i in others), return_exceptions=True
        )
        return [a for a in answers if not isinstance(a, BaseException)]

    async def _ask(self, index: int) -> Any:
        reader, writer = await asyncio.open_unix_connection(str(self.view.socket(index)))
        try:
            return json.loads(await reader.read())
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
