"""A cap on request body size, as ASGI middleware, for any server that hosts the app.

uvicorn reads whatever body a client sends; without a cap one request can take the server's memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        on_refuse: Callable[[Scope], None] = lambda scope: None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, send)
            return
        received = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # a chunked body that did not say its size
                    # Answer now, and tell the app its client is gone: frameworks turn errors
                    # raised while they read the body into their own 400.
                    refused = True
                    await self._refuse(scope, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:  # after the 413, whatever the app answers goes nowhere
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        self.on_refuse(scope)
        body = json.dumps(
            {
                "error": {
                    "message": f"The request body is larger than {self.max_bytes} bytes.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "body_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
