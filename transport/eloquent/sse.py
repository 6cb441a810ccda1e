"""Cutting a text/event-stream into events, and an event into its envelope and its text.

Both ends of an HTTP/3 response cut its body here, so position n names the same bytes on the
server's datagrams and in the client's copy of the stream, however QUIC split the stream into
frames. Inside an event, the text is the value of the first `"content"` or `"text"` key whose
value is a JSON string: OpenAI's chat and completion chunks put each token's text there, and
everything around it (id, model, replica, framing) repeats from event to event, so it travels
once, as the envelope. The cut is a slice of the event's bytes, so head + text + tail is the
event exactly, whatever the server's JSON encoder did; an event without such a key has no text.
"""

from __future__ import annotations

import json
import re

TEXT_KEYS = (b"content", b"text")

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
"""A JSON string literal. Matched from an event's start, the matches are exactly its strings:
a quote inside a string is escaped, so a match cannot begin inside one."""
_COLON = re.compile(rb"\s*:\s*")


class SseEvents:
    """Cuts a text/event-stream body into whole events, each with its blank-line terminator."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._pending += data
        *events, self._pending = self._pending.split(b"\n\n")
        return [event + b"\n\n" for event in events]

    def rest(self) -> bytes:
        """What follows the last whole event (empty for a well-formed stream)."""
        return self._pending


def split_text(event: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(head, text, tail) with head + text + tail == event, `text` the string literal's inside
    (escapes kept); None when the event has no text key with a string value."""
    strings = list(_STRING.finditer(event))
    for key, value in zip(strings, strings[1:], strict=False):
        if event[key.start() + 1 : key.end() - 1] not in TEXT_KEYS:
            continue
        if _COLON.fullmatch(event, key.end(), value.start()):
            return (
                event[: value.start() + 1],
                event[value.start() + 1 : value.end() - 1],
                (event[value.end() - 1 :]),
            )
    return None


def decode_text(literal: bytes) -> str:
    """The text a string literal's inside stands for: `\\n` is a newline, `\\u00e9` an é."""
    try:
        return json.loads(b'"' + literal + b'"')
    except ValueError:
        return literal.decode("utf-8", "replace")  # not JSON after all; show it as it is
