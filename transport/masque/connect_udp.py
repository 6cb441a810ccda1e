"""Validating a CONNECT-UDP request (RFC 9298 §3 over RFC 9220's Extended CONNECT), sans-IO.

An HTTP/3 UDP proxying request looks like

    :method CONNECT
    :protocol connect-udp
    :scheme https
    :authority proxy.example.org
    :path /.well-known/masque/udp/192.0.2.6/443/
    capsule-protocol ?1

where the path is the default URI template `/.well-known/masque/udp/{target_host}/{target_port}/`
(RFC 9298 §2) after RFC 6570 simple expansion, which percent-encodes everything outside the
unreserved set: an IPv6 literal's colons arrive as `%3A`. `parse_connect_udp` checks a request's
headers and returns the target, or raises ConnectUdpError with the status to answer. Whether the
caller may reach that target is a separate question (`AllowList`); 401/403 belong to access
control, which sits above this module. DNS resolution is also left to the caller: this module does
no I/O, and an allow-list match on a name says nothing about the addresses it resolves to.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes

PROTOCOL = b"connect-udp"
"""The `:protocol` of a UDP proxying request (RFC 9298 §3.4), the upgrade token of HTTP/1.1."""

PATH_PREFIX = "/.well-known/masque/udp/"
"""The default template's fixed part (RFC 9298 §2; its IANA well-known URI is `masque`)."""

_PSEUDO = (b":method", b":protocol", b":scheme", b":authority", b":path")

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
"""One DNS label (RFC 1123 §2.1): letters, digits, inner hyphens, 1-63 characters."""

# RFC 8941 §3.3.6 boolean, then §3.1.2 parameters (`;key` or `;key=bare-item`), whitespace as
# §4.2 allows. A value that is not one boolean item (a string, a list, two header lines that
# join into `?1, ?1`) fails the match.
_SF_KEY = r"[a-z*][a-z0-9_.*-]*"
_SF_BARE_ITEM = (
    r'(?:"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"'  # string
    r"|:[A-Za-z0-9+/=]*:"  # byte sequence
    r"|\?[01]"  # boolean
    r"|-?[0-9]{1,15}(?:\.[0-9]{1,3})?"  # integer or decimal
    r"|[A-Za-z*][A-Za-z0-9!#$%&'*+.^_`|~:/-]*)"  # token
)
_SF_BOOLEAN_ITEM = re.compile(
    rf"[ \t]*\?([01])(?:;[ ]*{_SF_KEY}(?:={_SF_BARE_ITEM})?)*[ \t]*", re.ASCII
)


class ConnectUdpError(ValueError):
    """A request this proxy will not open a tunnel for, with the status to answer it with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class UdpTarget:
    """Where a tunnel's UDP packets go."""

    host: str
    """A DNS name (lower case, no trailing dot), or an IPv4 or IPv6 address in its canonical
    text form (`ipaddress`'s: IPv6 compressed and lower case, no brackets)."""
    port: int
    """1..65535."""

    @property
    def is_ip(self) -> bool:
        return _ip(self.host) is not None

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def template_path(host: str, port: int) -> str:
    """The default template's `:path` for a target, as a client sends it (RFC 6570 simple
    expansion: everything outside the unreserved set percent-encoded, so `:` becomes `%3A`).
    Raises ValueError for a host or port `parse_connect_udp` would refuse."""
    target = UdpTarget(_canonical_host(host.strip("[]")), _port(str(port)))
    return f"{PATH_PREFIX}{quote(target.host, safe='')}/{target.port}/"


def parse_connect_udp(headers: Iterable[tuple[bytes, bytes]]) -> UdpTarget:
    """The target of a UDP proxying request, or ConnectUdpError.

    Status 405 for a method other than CONNECT: the well-known resource exists, but only for
    that method (RFC 9110 §15.5.6; the answer should carry `allow: CONNECT`). Status 400 for
    everything else this checks: a missing, repeated or wrong pseudo-header, a path outside the
    template, a host or port that is not one, and a missing `capsule-protocol: ?1`. RFC 9298
    §3 has the client send that field (as we recall the text; we had no copy to check), and it
    means "this stream carries capsules" (RFC 9297 §3.4): without it the proxy could not read
    the stream. An unknown `:protocol` gets 400, not 501: this function is the connect-udp
    resource's check, and whether the server speaks another protocol is its dispatcher's
    answer. The message names what is wrong.
    """
    pseudo: dict[bytes, bytes] = {}
    capsule_protocol: list[bytes] = []
    for name, value in headers:
        if name in _PSEUDO:
            if name in pseudo:
                raise ConnectUdpError(400, f"{name.decode()} appears more than once")
            pseudo[name] = value
        elif name == b"capsule-protocol":
            capsule_protocol.append(value)

    method = pseudo.get(b":method")
    if method != b"CONNECT":
        shown = "missing" if method is None else repr(method.decode("latin-1"))
        raise ConnectUdpError(405, f":method must be CONNECT for connect-udp, got {shown}")
    protocol = pseudo.get(b":protocol")
    if protocol != PROTOCOL:
        shown = "missing" if protocol is None else repr(protocol.decode("latin-1"))
        raise ConnectUdpError(400, f":protocol must be connect-udp, got {shown}")
    scheme = pseudo.get(b":scheme")
    if scheme != b"https":
        shown = "missing" if scheme is None else repr(scheme.decode("latin-1"))
        raise ConnectUdpError(400, f":scheme must be https, got {shown}")
    if not pseudo.get(b":authority"):
        raise ConnectUdpError(400, ":authority is missing or empty")
    path = pseudo.get(b":path")
    if not path:
        raise ConnectUdpError(400, ":path is missing or empty")
    target = _parse_path(path)

    # RFC 9297 §3.4: an Item that is not a Boolean, or a field sent twice (which joins into a
    # List), is handled as if the field were absent; unknown parameters are ignored.
    if len(capsule_protocol) != 1:
        raise ConnectUdpError(
            400,
            "capsule-protocol: ?1 is required"
            if not capsule_protocol
            else "capsule-protocol appears more than once, so it is ignored; send it once as ?1",
        )
    item = capsule_protocol[0].decode("latin-1")
    match = _SF_BOOLEAN_ITEM.fullmatch(item)
    if match is None or match.group(1) != "1":
        raise ConnectUdpError(400, f"capsule-protocol must be the boolean ?1, got {item!r}")
    return target


def _parse_path(raw: bytes) -> UdpTarget:
    try:
        path = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ConnectUdpError(400, ":path is not ASCII") from None
    if not path.startswith(PATH_PREFIX):
        raise ConnectUdpError(
            400, f":path {path!r} is not the template {PATH_PREFIX}{{target_host}}/{{target_port}}/"
        )
    if "?" in path or "#" in path:
        raise ConnectUdpError(400, ":path has a query or fragment; the template has none")
    parts = path[len(PATH_PREFIX) :].split("/")
    if len(parts) != 3 or parts[2] != "":
        raise ConnectUdpError(
            400,
            f":path {path!r} does not end in {{target_host}}/{{target_port}}/ (with the slash)",
        )
    raw_host, raw_port = parts[0], parts[1]
    try:
        host = unquote_to_bytes(raw_host).decode("ascii")
    except UnicodeDecodeError:
        raise ConnectUdpError(400, f"target_host {raw_host!r} is not ASCII once decoded") from None
    try:
        return UdpTarget(_canonical_host(host), _port(raw_port))
    except ValueError as error:
        raise ConnectUdpError(400, str(error)) from None


def _port(text: str) -> int:
    # RFC 3986's port is *DIGIT; int() alone would also take "+80", " 80" and "8_0".
    if not text or len(text) > 5 or not text.isascii() or not text.isdigit():
        raise ValueError(f"target_port {text!r} is not a number from 1 to 65535")
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"target_port {port} is outside 1..65535")
    return port


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _canonical_host(host: str) -> str:
    """`host` as one spelling per target, so an allow-list compares like with like.

    RFC 9298 §2 allows a DNS name, an IPv4 literal or an IPv6 literal; IPv6 zone identifiers
    (`fe80::1%eth0`) are not supported there, and `ipaddress` would accept them, so `%` is
    refused first. A name must be one the resolver will treat as a name: LDH labels, and not
    something `inet_aton` reads as an address (`127.1`, `0x7f.0.0.1`), which would otherwise
    reach 127.0.0.1 under a name no allow-list entry spells.
    """
    if not host:
        raise ValueError("target_host is empty")
    if "%" in host:
        raise ValueError(f"target_host {host!r}: IPv6 zone identifiers are not supported")
    address = _ip(host)
    if address is not None:
        return str(address)
    if ":" in host:
        raise ValueError(f"target_host {host!r} is not an IPv6 address")
    try:
        socket.inet_aton(host)
    except (OSError, ValueError):  # ValueError: an embedded NUL, from a decoded %00
        pass
    else:
        raise ValueError(f"target_host {host!r} is an IPv4 address in a non-standard form")
    name = host.lower()
    name = name[:-1] if name.endswith(".") else name
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"target_host {host!r} is not a DNS name or IP address")
    if labels[-1].isdigit():
        raise ValueError(f"target_host {host!r} ends in a numeric label, so it is not a DNS name")
    return name


@dataclass(frozen=True)
class AllowList:
    """The targets a tunnel may reach: `host:port` or `host:*`, IPv6 as `[addr]:port`.

    Never an open relay: an empty list allows nothing, and there is no wildcard host (a `*`
    host, or `*.example.org`, is refused when the list is built), so every host a tunnel
    reaches is named here. Names and addresses are compared in `UdpTarget`'s canonical form,
    so `Example.ORG.` and `example.org`, or `2001:DB8:0::1` and `2001:db8::1`, are one entry.
    A name is matched as a name: `localhost:*` does not allow `127.0.0.1`, nor the other way.
    """

    entries: frozenset[tuple[str, int | None]]
    """(host, port), port None for `*`."""

    @classmethod
    def parse(cls, patterns: Iterable[str]) -> AllowList:
        """Raises ValueError naming the first pattern that is not `host:port` or `host:*`."""
        entries: set[tuple[str, int | None]] = set()
        for pattern in patterns:
            host, sep, port = pattern.strip().rpartition(":")
            if not sep or not host:
                raise ValueError(f"allowed target {pattern!r} is not host:port or host:*")
            if host.startswith("["):
                if not host.endswith("]"):
                    raise ValueError(f"allowed target {pattern!r}: unclosed [")
                host = host[1:-1]
            elif ":" in host:
                raise ValueError(f"allowed target {pattern!r}: write an IPv6 host as [addr]:port")
            if "*" in host:
                raise ValueError(f"allowed target {pattern!r}: a wildcard host is an open relay")
            try:
                canonical = _canonical_host(host)
                entries.add((canonical, None if port == "*" else _port(port)))
            except ValueError as error:
                raise ValueError(f"allowed target {pattern!r}: {error}") from None
        return cls(frozenset(entries))

    def allows(self, target: UdpTarget) -> bool:
        return (target.host, target.port) in self.entries or (target.host, None) in self.entries


def is_allowed(target: UdpTarget, allowed: Iterable[str]) -> bool:
    """Whether `allowed` (patterns as `AllowList.parse` reads them) lets a tunnel reach `target`.
    Parses the list on every call; a proxy parses it once, when it loads its configuration."""
    return AllowList.parse(allowed).allows(target)
