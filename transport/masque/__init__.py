"""MASQUE: proxying UDP over HTTP/3 (RFC 9298 CONNECT-UDP, RFC 9297 capsules), seed 004 ch. 2.

This step is the protocol logic alone, sans-IO, with no aioquic connection and nothing from
serving or router: the proxy, the client tunnel and access control build on it.

- `capsule`: the Capsule Protocol's encoding and an incremental parser, and the UDP proxying
  HTTP Datagram Payload (context ID, then the UDP payload).
- `connect_udp`: checking an Extended CONNECT request for `connect-udp` against the default
  URI template, the allow-list of targets, and the template's path for a client.
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
