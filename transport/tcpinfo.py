"""A TCP connection's path, as the kernel has measured it (Linux `TCP_INFO`).

For HTTP/1.1 and HTTP/2, what HTTP/3 reads from QUIC's recovery state: the smoothed RTT and its
variation, the share of segments that had to be sent again, and the delivery rate. The kernel has
an RTT sample from the handshake on, so even a connection's first request has one.
"""

from __future__ import annotations

import socket
import struct

from config.paths import PathEstimate

# struct tcp_info (include/uapi/linux/tcp.h): 8 one-byte fields, then 24 u32 up to
# tcpi_total_retrans, then (8-aligned) pacing_rate, max_pacing_rate, bytes_acked and
# bytes_received (u64), segs_out, segs_in, notsent_bytes, min_rtt, data_segs_in and
# data_segs_out (u32), and delivery_rate (u64), in bytes per second. Older kernels stop sooner.
_HEAD = struct.Struct("=8B24I")
_TAIL = struct.Struct("=4Q6IQ")
_RTT, _RTTVAR, _TOTAL_RETRANS = 8 + 15, 8 + 16, 8 + 23
_SEGS_OUT, _DELIVERY_RATE = 4, 10


def tcp_path(sock: socket.socket | None) -> PathEstimate | None:
    """The path of a connected TCP socket; None where the kernel tells nothing (not Linux, not
    TCP, closed, or no RTT sample yet)."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _HEAD.size + _TAIL.size)
    except OSError:
        return None
    if len(raw) < _HEAD.size:
        return None
    head = _HEAD.unpack_from(raw)
    rtt_us, rttvar_us = head[_RTT], head[_RTTVAR]
    if rtt_us == 0:
        return None
    loss, rate = 0.0, None
    if len(raw) >= _HEAD.size + _TAIL.size:
        tail = _TAIL.unpack_from(raw, _HEAD.size)
        if tail[_SEGS_OUT]:
            loss = min(1.0, head[_TOTAL_RETRANS] / tail[_SEGS_OUT])
        if tail[_DELIVERY_RATE]:
            rate = tail[_DELIVERY_RATE] * 8.0
    return PathEstimate(rtt_us / 1e6, rttvar_us / 1e6, loss, rate).clamped()
