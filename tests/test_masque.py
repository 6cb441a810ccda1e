"""MASQUE's sans-IO protocol logic (transport/masque/): capsules against bytes built by hand from
RFC 9297/9298/9000's definitions, the incremental parser under any chunking and under fuzzing,
and CONNECT-UDP request checks with the status each refusal gets. No network, no servers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from transport.masque import (
    DATAGRAM,
    AllowList,
    Capsule,
    CapsuleError,
    CapsuleParser,
    CapsuleTooLarge,
    ConnectUdpError,
    DatagramPayloadError,
    UdpTarget,
    encode_capsule,
    encode_datagram_capsule,
    is_allowed,
    parse_connect_udp,
    parse_udp_payload,
    template_path,
    udp_capsule,
    udp_payload,
)

GREASE = 0x29 * 1 + 0x17
"""A capsule type RFC 9297's IANA section reserves for greasing (0x29 * N + 0x17): never known, so a
receiver must skip it. 0x40 needs a 2-byte varint: 0x40 0x40."""


# --- encoding, against hand-built bytes ---------------------------------------------------------


def test_a_udp_datagram_capsule_is_type_length_context_payload() -> None:
    # Type 0x00 (DATAGRAM), Length 4 (1-byte varint), Context ID 0, then the UDP payload.
    assert udp_capsule(b"abc") == bytes([0x00, 0x04, 0x00]) + b"abc"
    assert encode_datagram_capsule(udp_payload(0, b"abc")) == b"\x00\x04\x00abc"
    assert udp_payload(0, b"abc") == b"\x00abc"


def test_an_empty_udp_payload_still_carries_its_context_id() -> None:
    assert udp_capsule(b"") == b"\x00\x01\x00"


def test_a_length_of_68_takes_a_two_byte_varint() -> None:
    # RFC 9000 §16: 0b01 prefix, 14 bits: 68 = 0x0044 -> 0x40 0x44.
    payload = bytes(range(67))
    assert udp_capsule(payload) == b"\x00\x40\x44\x00" + payload


def test_rfc9000_sample_varints_as_capsule_types() -> None:
    # RFC 9000 Appendix A.1's samples: 4-byte 0x9d7f3e7d is 494878333, 2-byte 0x7bbd is 15293,
    # 8-byte 0xc2197c5eff14e88c is 151288809941952652.
    assert encode_capsule(494_878_333, b"") == bytes.fromhex("9d7f3e7d") + b"\x00"
    assert encode_capsule(15_293, b"x") == bytes.fromhex("7bbd") + b"\x01x"
    assert encode_capsule(151_288_809_941_952_652, b"") == bytes.fromhex("c2197c5eff14e88c00")
    assert encode_capsule(GREASE, b"\xff") == b"\x40\x40\x01\xff"


def test_context_ids_encode_as_varints() -> None:
    assert udp_payload(2, b"x") == b"\x02x"
    assert udp_payload(64, b"x") == b"\x40\x40x"
    with pytest.raises(ValueError):
        udp_payload(1 << 62, b"")
    with pytest.raises(ValueError):
        udp_payload(-1, b"")
    with pytest.raises(ValueError):
        encode_capsule(1 << 62, b"")


def test_context_zero_is_a_udp_payload_and_any_other_is_dropped() -> None:
    assert parse_udp_payload(b"\x00abc") == b"abc"
    assert parse_udp_payload(b"\x00") == b""
    assert parse_udp_payload(b"\x40\x00abc") == b"abc"  # non-minimal 0 is still 0
    assert parse_udp_payload(b"\x02abc") is None
    assert parse_udp_payload(b"\x40\x40abc") is None


def test_a_payload_without_a_whole_context_id_is_malformed() -> None:
    with pytest.raises(DatagramPayloadError, match="empty"):
        parse_udp_payload(b"")
    with pytest.raises(DatagramPayloadError, match="context ID"):
        parse_udp_payload(b"\x40")


# --- incremental parsing ------------------------------------------------------------------------

STREAM_CAPSULES = [
    Capsule(DATAGRAM, b"\x00abc"),
    Capsule(GREASE, b"opaque"),
    Capsule(DATAGRAM, b"\x00" + bytes(range(67))),
    Capsule(DATAGRAM, b""),
    Capsule(494_878_333, b""),
    Capsule(DATAGRAM, b"\x02other context"),
]
STREAM = b"".join(c.encode() for c in STREAM_CAPSULES)


def test_one_chunk_gives_every_capsule_unknown_types_kept_opaque() -> None:
    parser = CapsuleParser()
    assert parser.feed(STREAM) == STREAM_CAPSULES
    parser.close()
    assert parser.at_eof


def test_the_consumer_skips_unknown_types_and_other_contexts() -> None:
    parser = CapsuleParser()
    udp = [
        parse_udp_payload(c.value)
        for c in parser.feed(udp_capsule(b"one") + encode_capsule(GREASE, b"?") + udp_capsule(b""))
        if c.is_datagram
    ]
    assert udp == [b"one", b""]


@pytest.mark.parametrize("split", range(len(STREAM) + 1))
def test_a_split_at_any_byte_gives_the_same_capsules(split: int) -> None:
    parser = CapsuleParser()
    got = parser.feed(STREAM[:split]) + parser.feed(STREAM[split:])
    parser.close()
    assert got == STREAM_CAPSULES


def test_byte_at_a_time_gives_the_same_capsules() -> None:
    parser = CapsuleParser()
    got: list[Capsule] = []
    for i in range(len(STREAM)):
        got += parser.feed(STREAM[i : i + 1])
    parser.close()
    assert got == STREAM_CAPSULES


def test_a_non_minimal_length_varint_is_accepted() -> None:
    # RFC 9000 §16 allows any encoding length; 0x4004 is 4 in two bytes.
    assert CapsuleParser().feed(b"\x00\x40\x04\x00abc") == [Capsule(DATAGRAM, b"\x00abc")]


def test_a_capsule_at_the_limit_passes_and_one_past_it_is_refused_on_its_header() -> None:
    assert CapsuleParser(max_length=4).feed(b"\x00\x04\x00abc") == [Capsule(DATAGRAM, b"\x00abc")]
    parser = CapsuleParser(max_length=4)
    with pytest.raises(CapsuleTooLarge, match="5 bytes, over the limit of 4") as caught:
        parser.feed(b"\x00\x05")  # no value bytes yet: the header alone is enough to refuse
    assert (caught.value.capsule_type, caught.value.length) == (DATAGRAM, 5)


def test_a_2_to_the_62_capsule_is_refused_before_any_value_is_buffered() -> None:
    parser = CapsuleParser()
    with pytest.raises(CapsuleTooLarge):
        parser.feed(encode_capsule(GREASE, b"")[:2] + b"\xff" * 8 + b"x" * 1000)
    assert parser.buffered <= 16 + 1000
    with pytest.raises(CapsuleError, match="already failed"):
        parser.feed(b"\x00\x00")


def test_the_default_limit_holds_the_largest_udp_datagram() -> None:
    payload = bytes(65_527)
    parser = CapsuleParser()
    (capsule,) = parser.feed(udp_capsule(payload))
    assert parse_udp_payload(capsule.value) == payload


@pytest.mark.parametrize(
    ("stream", "where"),
    [
        (b"\x40", "header"),  # a 2-byte type cut after one byte
        (b"\x00", "header"),  # a type with no length
        (b"\x00\x40", "header"),  # a 2-byte length cut after one byte
        (b"\x00\x04\x00ab", "3 of 4 bytes"),  # the value cut short
        (udp_capsule(b"whole") + b"\x00\x04", "0 of 4 bytes"),
    ],
)
def test_a_stream_that_ends_inside_a_capsule_is_malformed_at_eof(stream: bytes, where: str) -> None:
    parser = CapsuleParser()
    parser.feed(stream)  # not an error yet: the next chunk could complete it
    with pytest.raises(CapsuleError, match=where):
        parser.close()


def test_a_clean_end_and_an_empty_stream_are_fine() -> None:
    for stream in (b"", udp_capsule(b"x")):
        parser = CapsuleParser()
        parser.feed(stream)
        parser.close()
    with pytest.raises(CapsuleError, match="closed"):
        parser.feed(b"")


# --- fuzzing ------------------------------------------------------------------------------------

FUZZ_LIMIT = 40


def _parse(data: bytes, cuts: list[int]) -> tuple[list[Capsule], type[Exception] | None]:
    """Feed `data` cut at `cuts`, then close; the capsules, and the error class if any. Checks on
    the way that the parser never holds more than one header plus its limit."""
    parser = CapsuleParser(max_length=FUZZ_LIMIT)
    got: list[Capsule] = []
    try:
        for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
            got += parser.feed(data[start:end])
            assert parser.buffered <= 16 + FUZZ_LIMIT
        parser.close()
    except CapsuleError as error:
        return got, type(error)
    # A capsule takes at least its 2 header bytes plus its value (more if its varints are not
    # minimal), so a parser that yields more has invented bytes.
    assert sum(len(c.encode()) for c in got) <= len(data)
    return got, None


def _cuts(rng: random.Random, n: int) -> list[int]:
    return sorted(rng.sample(range(n + 1), k=min(n + 1, rng.randint(0, 6))))


def _check(data: bytes, rng: random.Random) -> type[Exception] | None:
    # Only CapsuleError escapes (anything else fails the test), and the chunking never changes
    # the outcome. Fed a byte at a time, the parser returns every capsule before an error; fed
    # larger chunks, it drops those the failing chunk completed (the stream is aborted anyway).
    reference, error = _parse(data, list(range(1, len(data))))
    for cuts in ([], _cuts(rng, len(data))):
        got, chunked_error = _parse(data, cuts)
        assert chunked_error is error
        assert got == reference if error is None else got == reference[: len(got)]
    return error


@pytest.mark.timeout(120)
def test_random_bytes_only_ever_raise_capsule_errors() -> None:
    rng = random.Random(9297)
    outcomes: Counter[type[Exception] | None] = Counter()
    for _ in range(5000):
        size = rng.choice([0, 1, 2, 3, 5, 9, 17, 40, 100])
        data = rng.randbytes(size)
        if rng.random() < 0.5:  # small types and lengths, so that many inputs parse
            data = bytes(b & rng.choice([0x3F, 0x7F, 0xFF]) for b in data)
        outcomes[_check(data, rng)] += 1
    # Not vacuous: clean ends, truncations and over-long capsules all occur.
    assert min(outcomes[None], outcomes[CapsuleError], outcomes[CapsuleTooLarge]) > 200, outcomes


def _valid_stream(rng: random.Random) -> bytes:
    parts = []
    for _ in range(rng.randint(1, 6)):
        capsule_type = rng.choice([DATAGRAM, DATAGRAM, GREASE, 1, 494_878_333, (1 << 62) - 1])
        parts.append(encode_capsule(capsule_type, rng.randbytes(rng.randint(0, FUZZ_LIMIT))))
    return b"".join(parts)


def _mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(5)
        i = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(i, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            out[i:i] = rng.randbytes(rng.randint(1, 4))
        elif op == 2:
            del out[i : i + rng.randint(1, 4)]
        elif op == 3:
            del out[i:]
        else:
            out[i:i] = out[rng.randrange(len(out) + 1) :][: rng.randint(1, 20)]
    return bytes(out)


@pytest.mark.timeout(120)
def test_valid_streams_parse_and_mutations_only_raise_capsule_errors() -> None:
    rng = random.Random(9298)
    outcomes: Counter[type[Exception] | None] = Counter()
    for _ in range(2000):
        data = _valid_stream(rng)
        got, error = _parse(data, _cuts(rng, len(data)))
        assert error is None and b"".join(c.encode() for c in got) == data
        outcomes[_check(_mutate(data, rng), rng)] += 1
    assert min(outcomes[None], outcomes[CapsuleError], outcomes[CapsuleTooLarge]) > 100, outcomes


# --- CONNECT-UDP requests -----------------------------------------------------------------------


VALID_PATH = "/.well-known/masque/udp/192.0.2.6/443/"


def request(
    path: str = VALID_PATH, changes: dict[str, str | None] | None = None
) -> list[tuple[bytes, bytes]]:
    """A valid HTTP/3 CONNECT-UDP request's headers, with fields changed (None: left out)."""
    fields: dict[str, str | None] = {
        ":method": "CONNECT",
        ":protocol": "connect-udp",
        ":scheme": "https",
        ":authority": "proxy.example.org",
        ":path": path,
        "capsule-protocol": "?1",
    }
    fields.update(changes or {})
    return [(k.encode(), v.encode()) for k, v in fields.items() if v is not None]


def refusal(headers: list[tuple[bytes, bytes]]) -> ConnectUdpError:
    with pytest.raises(ConnectUdpError) as caught:
        parse_connect_udp(headers)
    return caught.value


@pytest.mark.parametrize(
    ("path", "target"),
    [
        ("/.well-known/masque/udp/192.0.2.6/443/", UdpTarget("192.0.2.6", 443)),
        ("/.well-known/masque/udp/example.org/53/", UdpTarget("example.org", 53)),
        ("/.well-known/masque/udp/Example.ORG./1/", UdpTarget("example.org", 1)),
        ("/.well-known/masque/udp/2001%3Adb8%3A%3A42/65535/", UdpTarget("2001:db8::42", 65535)),
        ("/.well-known/masque/udp/2001%3aDB8%3a0%3a%3a42/8443/", UdpTarget("2001:db8::42", 8443)),
        ("/.well-known/masque/udp/%31%32%37.0.0.1/80/", UdpTarget("127.0.0.1", 80)),
    ],
)
def test_valid_requests_name_their_target(path: str, target: UdpTarget) -> None:
    assert parse_connect_udp(request(path)) == target


def test_capsule_protocol_parameters_are_ignored() -> None:
    # RFC 9297 §3.4: receivers ignore unknown parameters.
    target = parse_connect_udp(request(changes={"capsule-protocol": '?1;foo=bar;x;n=1.5;s="a"'}))
    assert target == UdpTarget("192.0.2.6", 443)


@pytest.mark.parametrize(
    ("path", "names"),
    [
        ("/masque/udp/192.0.2.6/443/", "template"),
        ("/.well-known/masque/tcp/192.0.2.6/443/", "template"),
        ("/.well-known/masque/udp/192.0.2.6/443", "with the slash"),
        ("/.well-known/masque/udp/192.0.2.6/", "with the slash"),
        ("/.well-known/masque/udp/192.0.2.6/443/extra/", "with the slash"),
        ("/.well-known/masque/udp/192.0.2.6/443/?x=1", "query"),
        ("/.well-known/masque/udp//443/", "target_host is empty"),
        ("/.well-known/masque/udp/192.0.2.6/0/", "outside 1..65535"),
        ("/.well-known/masque/udp/192.0.2.6/70000/", "outside 1..65535"),
        ("/.well-known/masque/udp/192.0.2.6/http/", "not a number"),
        ("/.well-known/masque/udp/192.0.2.6/+443/", "not a number"),
        ("/.well-known/masque/udp/192.0.2.6//", "not a number"),
        ("/.well-known/masque/udp/192.0.2.6/000443/", "not a number"),
        ("/.well-known/masque/udp/fe80%3A%3A1%25eth0/443/", "zone"),
        ("/.well-known/masque/udp/%5B2001%3Adb8%3A%3A1%5D/443/", "not an IPv6 address"),
        ("/.well-known/masque/udp/2001%3Azz%3A%3A1/443/", "not an IPv6 address"),
        ("/.well-known/masque/udp/127.1/443/", "non-standard form"),
        ("/.well-known/masque/udp/0x7f.0.0.1/443/", "non-standard form"),
        ("/.well-known/masque/udp/a%2Fb/443/", "not a DNS name"),
        ("/.well-known/masque/udp/a%00b/443/", "not a DNS name"),
        ("/.well-known/masque/udp/-bad-.org/443/", "not a DNS name"),
        ("/.well-known/masque/udp/host.123/443/", "numeric label"),
        ("/.well-known/masque/udp/%C3%A9.org/443/", "not ASCII"),
    ],
)
def test_a_malformed_path_gets_400_naming_the_problem(path: str, names: str) -> None:
    error = refusal(request(path))
    assert error.status == 400
    assert names in error.message


@pytest.mark.parametrize(
    ("changes", "status", "names"),
    [
        ({":method": "GET"}, 405, ":method must be CONNECT"),
        ({":method": None}, 405, ":method must be CONNECT for connect-udp, got missing"),
        ({":protocol": "websocket"}, 400, ":protocol must be connect-udp, got 'websocket'"),
        ({":protocol": None}, 400, ":protocol must be connect-udp"),
        ({":scheme": "http"}, 400, ":scheme must be https"),
        ({":authority": ""}, 400, ":authority"),
        ({":path": None}, 400, ":path is missing"),
        ({"capsule-protocol": None}, 400, "capsule-protocol: ?1 is required"),
        ({"capsule-protocol": "?0"}, 400, "must be the boolean ?1"),
        ({"capsule-protocol": "1"}, 400, "must be the boolean ?1"),
        ({"capsule-protocol": "?1, ?1"}, 400, "must be the boolean ?1"),
        ({"capsule-protocol": '"?1"'}, 400, "must be the boolean ?1"),
        ({"capsule-protocol": "?1;"}, 400, "must be the boolean ?1"),
    ],
)
def test_a_malformed_request_gets_its_status_naming_the_problem(
    changes: dict[str, str | None], status: int, names: str
) -> None:
    error = refusal(request(changes=changes))
    assert error.status == status
    assert names in error.message


def test_repeated_fields_are_refused() -> None:
    headers = request()
    assert "capsule-protocol appears more than once" in refusal([*headers, headers[-1]]).message
    assert ":path appears more than once" in refusal([*headers, headers[4]]).message


@pytest.mark.parametrize(
    ("host", "port", "path"),
    [
        ("192.0.2.6", 443, "/.well-known/masque/udp/192.0.2.6/443/"),
        ("example.org", 53, "/.well-known/masque/udp/example.org/53/"),
        ("2001:db8::42", 443, "/.well-known/masque/udp/2001%3Adb8%3A%3A42/443/"),
        ("[2001:DB8::42]", 443, "/.well-known/masque/udp/2001%3Adb8%3A%3A42/443/"),
    ],
)
def test_template_path_round_trips(host: str, port: int, path: str) -> None:
    assert template_path(host, port) == path
    assert parse_connect_udp(request(path)) == UdpTarget(host.strip("[]").lower(), port)


def test_template_path_refuses_what_a_proxy_would() -> None:
    for host, port in [("a/b", 443), ("example.org", 0), ("fe80::1%eth0", 443)]:
        with pytest.raises(ValueError):
            template_path(host, port)


# --- the allow-list -----------------------------------------------------------------------------


def test_an_empty_allow_list_allows_nothing() -> None:
    assert not is_allowed(UdpTarget("192.0.2.6", 443), [])
    assert not AllowList.parse([]).allows(UdpTarget("localhost", 53))


def test_host_port_and_host_star() -> None:
    allowed = AllowList.parse(["192.0.2.6:443", "Example.ORG:*", "[2001:DB8::1]:53"])
    assert allowed.allows(UdpTarget("192.0.2.6", 443))
    assert not allowed.allows(UdpTarget("192.0.2.6", 444))
    assert not allowed.allows(UdpTarget("192.0.2.7", 443))
    assert allowed.allows(UdpTarget("example.org", 1))
    assert allowed.allows(UdpTarget("example.org", 65535))
    assert not allowed.allows(UdpTarget("sub.example.org", 443))
    ipv6 = parse_connect_udp(request("/.well-known/masque/udp/2001%3Adb8%3A%3A1/53/"))
    assert allowed.allows(ipv6)
    assert not allowed.allows(UdpTarget("2001:db8::1", 54))


def test_names_and_addresses_match_only_as_themselves() -> None:
    assert not is_allowed(UdpTarget("127.0.0.1", 53), ["localhost:53"])
    assert not is_allowed(UdpTarget("localhost", 53), ["127.0.0.1:53"])
    assert not is_allowed(UdpTarget("::ffff:127.0.0.1", 53), ["127.0.0.1:53"])


@pytest.mark.parametrize(
    "pattern",
    ["*:*", "*:443", "*.example.org:443", "example.org", "example.org:", ":443", "host:0",
     "host:99999", "2001:db8::1:443", "[2001:db8::1:443", "a/b:1", "127.1:53"],
)  # fmt: skip
def test_a_bad_or_open_pattern_is_refused_when_the_list_is_built(pattern: str) -> None:
    with pytest.raises(ValueError, match="allowed target"):
        AllowList.parse([pattern])
