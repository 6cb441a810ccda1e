"""MASQUE: proxying UDP over HTTP/3 (RFC 9298 CONNECT-UDP, RFC 9297 capsules), as in chapter 2
of Chuppala (2024).

Nothing here imports serving or router. `capsule` and `connect_udp` are the protocol logic,
sans-IO; `proxy` and `tunnel` run it on plain aioquic.

- `capsule`: the Capsule Protocol's encoding and an incremental parser, and the UDP proxying
  HTTP Datagram Payload (context ID, then the UDP payload).
- `connect_udp`: checking an Extended CONNECT request for `connect-udp` against the default
  URI template, the allow-list of targets, and the template's path for a client.
- `access`: `TunnelAccess`, who may open tunnels to where (models.yaml's tiers and keys), and
  each tunnel's `StreamSpec` (its RFC 9218 `priority` header, or its owner's class).
- `proxy`: `MasqueProxy`, the CONNECT-UDP proxy (keys, allow-lists, capsules and HTTP/3
  datagrams both ways, tunnels scheduled on each client connection);
  `python -m transport.masque.proxy`, or `python -m transport.frontend --masque PORT`.
- `tunnel`: `MasqueClient`, the client side: one connection to the proxy, its tunnels scheduled
  as streams, each a local UDP socket that an inner QUIC connection uses as its network;
  `UdpTunnel`, one tunnel on a connection of its own.
"""

from transport.masque.capsule import (
    DATAGRAM,
    Capsule,
    CapsuleError,
    CapsuleParser,
    CapsuleTooLarge,
    DatagramPayloadError,
    encode_capsule,
    encode_datagram_capsule,
    parse_udp_payload,
    udp_capsule,
    udp_payload,
)
from transport.masque.connect_udp import (
    AllowList,
    ConnectUdpError,
    UdpTarget,
    is_allowed,
    parse_connect_udp,
    template_path,
)

__all__ = [
    "DATAGRAM",
    "AllowList",
    "Capsule",
    "CapsuleError",
    "CapsuleParser",
    "CapsuleTooLarge",
    "ConnectUdpError",
    "DatagramPayloadError",
    "UdpTarget",
    "encode_capsule",
    "encode_datagram_capsule",
    "is_allowed",
    "parse_connect_udp",
    "parse_udp_payload",
    "template_path",
    "udp_capsule",
    "udp_payload",
]
