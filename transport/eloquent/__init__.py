"""Eloquent token streaming: redundant HTTP/3 datagrams beside the reliable stream.

Eloquent (NAIC '24) and Chatterbox, its longer version with the same design, §3: every
outgoing packet carries the newly generated tokens plus the earlier tokens not yet acknowledged,
so any packet that arrives can be rendered on its own and one lost packet does not hold back the
tokens behind it. Here the HTTP/3 response stream still carries every event, reliably and in
order; the datagrams are a fast path beside it, carrying each event's text, token-sized, with
what surrounds the text (the envelope: id, model, replica) sent once. The receiver renders the
longest contiguous prefix from whichever copy of each position arrives first (Algorithm 2), so a
lost datagram costs nothing and a stalled stream costs only until a datagram carries the
position.

- `wire`: the datagram format.
- `sse`: cutting the event stream into events, and an event into envelope and text.
- `endpoints`: the sans-IO sender and receiver.
- `driver`: the lanes that bind them to an HTTP/3 stream and a clock, for the server, the client
  and the simulation alike.
"""

from transport.eloquent.driver import Clock, ReceiverLane, SenderLane
from transport.eloquent.endpoints import EloquentReceiver, EloquentSender
from transport.eloquent.wire import EloquentFormatError

HEADER = b"x-eloquent"
"""A request asks for Eloquent datagrams with `x-eloquent: 1`; a response that has them (an
event stream, over HTTP/3 with datagrams on) says so with the same header."""

DATAGRAM_ALLOWANCE = 1200
"""The congestion-window excess a server grants a connection's waiting Eloquent datagrams: one
packet (`transport.connection.ScheduledQuicConnection.datagram_allowance` says why)."""

__all__ = [
    "DATAGRAM_ALLOWANCE",
    "HEADER",
    "Clock",
    "EloquentFormatError",
    "EloquentReceiver",
    "EloquentSender",
    "ReceiverLane",
    "SenderLane",
]
