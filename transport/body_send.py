"""A response's body past the app's middleware.

An ASGI middleware that wraps `send` sees every message a response sends: for a token stream, a
call per token through each wrapper (six between a response and the server in our app, five of
them interested only in the response's start). So the app offers its server's own `send` in the
scope (`offer`), and a response that sends many body messages sends its start through the chain
as usual and its body to `body_send(scope, send)` instead.

The rule for a middleware that wraps `send` and must see body messages (the drain's gate, which
cuts a stream) is that it replaces the offer with its own body-only send, around the one it
found, as `transport.drain.Draining` does. One that looks at the start only (tagging, Starlette's
error handling) leaves it be, and so may the body limit: it refuses while the body is read, and
a response that streams starts only after the whole body was read. A middleware of someone
else's that rewrites bodies (a compressor) would have to follow the rule too: this is the app's
own contract, not ASGI's.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Scope, Send

BODY_SEND = "body_send"
"""The scope extension: where a response's body messages go once its start has gone out."""


def offer(scope: Scope, send: Send) -> None:
    """Where the app meets its server: the server's `send` is where bodies go, unless a
    middleware says otherwise."""
    scope.setdefault("extensions", {})[BODY_SEND] = send


def offered(scope: Scope) -> Send | None:
    """The body send on offer now; None where the app made no offer."""
    found: Any = scope.get("extensions", {}).get(BODY_SEND)
    return found


def body_send(scope: Scope, send: Send) -> Send:
    """Where a response sends its body, given the `send` it was called with (which its start
    goes through): the offer, else `send` itself."""
    return offered(scope) or send


def replace(scope: Scope, wrapper: Send) -> None:
    """A middleware's own body-only send in place of the offer, where there is one."""
    if offered(scope) is not None:
        scope["extensions"][BODY_SEND] = wrapper
