"""Eloquent streaming core (transport/eloquent.py): pure logic, virtual time, seeded, no network."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import random

import pytest

from transport.eloquent import (
    DEFAULT_MAX_PAYLOAD,
    MAX_ACK_POSITIONS,
    Ack,
    EloquentFormatError,
    EloquentReceiver,
    EloquentSender,
    TokenEntry,
    Tokens,
    decode_message,
    late_share,
    redundancy_rate,
    stall_ratio,
)

ALPHABET = "abcdefghij klmnop,.éß漢字🙂"


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def tokens_of(payload: bytes) -> tuple[TokenEntry, ...]:
    message = decode_message(payload)
    assert isinstance(message, Tokens)
    return message.entries


def ack(below: int, *held: int) -> bytes:
    return Ack(below, tuple(held)).encode()


# --------------------------------------------------------------------------------------------
# Sender: size limit, repeats oldest first, cap


@pytest.mark.parametrize("max_payload", [80, 300, DEFAULT_MAX_PAYLOAD])
def test_sender_never_exceeds_max_payload_and_repeats_oldest_unacked_first(max_payload):
    """Any mix of batch sizes (tiny, mid, larger than a datagram), random ACKs and timer calls:
    every payload fits, carries at most max_repeats earlier entries, and those are the oldest
    unacknowledged ones that fit (an older one left out would not have fit)."""
    rng = random.Random(max_payload)
    sender = EloquentSender(max_payload=max_payload, max_repeats=10)
    unacked: dict[tuple[int, int], TokenEntry] = {}  # the test's own model, oldest first
    sizes = [1, 2, 3, 5, 8, 20, 40, 100, 700, 1500, 3000]
    now = 0.0
    fragmented = 0

    def check(payload: bytes, new_position: int | None) -> list[TokenEntry]:
        assert len(payload) <= max_payload
        entries = list(tokens_of(payload))
        positions = [e.position for e in entries]
        assert positions == sorted(positions)
        earlier = [e for e in entries if e.position != new_position]
        new = [e for e in entries if e.position == new_position]
        assert len(new) <= 1
        assert len(earlier) <= sender.max_repeats
        keys = [(e.position, e.offset) for e in earlier]
        model_keys = list(unacked)
        assert all(k in unacked for k in keys), "repeated something acknowledged or never sent"
        assert keys == sorted(keys, key=model_keys.index), "repeats not oldest first"
        for key, entry in unacked.items():
            if key in keys:
                continue
            if len(earlier) == sender.max_repeats and key > keys[-1]:
                break  # the cap, not the room, kept it out
            candidate = sorted([*earlier, entry], key=lambda e: (e.position, e.offset)) + new
            assert Tokens(tuple(candidate)).wire_size() > max_payload, f"{key} fitted"
        return new

    for _ in range(400):
        now += rng.choice([0.01, 0.05, 0.1, 0.3])
        action = rng.random()
        if action < 0.6:
            text = random_text(rng, rng.choice(sizes))
            position = sender.next_position
            payloads = sender.on_tokens(text, now)
            fragmented += len(payloads) > 1
            new_entries = [check(p, position)[0] for p in payloads]
            assert b"".join(e.data for e in new_entries) == text.encode()
            for entry in new_entries:
                unacked[(entry.position, entry.offset)] = entry
        elif action < 0.8 and unacked:
            positions = sorted({p for p, _ in unacked})
            below = rng.choice(positions)
            above = [p for p in positions if p > below]
            held = tuple(sorted(rng.sample(above, k=min(len(above), rng.randint(0, 5)))))
            sender.on_ack(ack(below, *held), now)
            for key in [k for k in unacked if k[0] < below or k[0] in held]:
                del unacked[key]
        else:
            for payload in sender.on_timer(now):
                check(payload, None)
        assert sender.unacked_positions == sorted({p for p, _ in unacked})
    assert fragmented > 0, "the mix must include batches larger than one datagram"
    assert sender.stats.payload_bytes <= sender.stats.datagrams * max_payload


def test_new_batch_carries_the_ten_oldest_unacked_batches():
    sender = EloquentSender(max_repeats=10)
    for i in range(14):
        sender.on_tokens(f"tok{i} ", now=i * 0.1)
    (payload,) = sender.on_tokens("tok14 ", now=1.4)
    assert [e.position for e in tokens_of(payload)] == [*range(10), 14]


def test_acknowledged_batches_are_not_sent_again():
    sender = EloquentSender(max_repeats=10)
    for i in range(6):
        sender.on_tokens(f"t{i}", now=i * 0.1)
    sender.on_ack(ack(2, 3), now=0.6)  # holds 0, 1 and 3
    (payload,) = sender.on_tokens("t6", now=0.7)
    assert [e.position for e in tokens_of(payload)] == [2, 4, 5, 6]
    sender.on_ack(ack(7), now=0.8)
    assert sender.unacked_positions == []
    (payload,) = sender.on_tokens("t7", now=0.9)
    assert [e.position for e in tokens_of(payload)] == [7]
    assert sender.on_timer(now=5.0) != []  # 7 is still unacked
    sender.on_ack(ack(8), now=5.1)
    assert sender.timer() is None and sender.on_timer(now=9.0) == []


def test_timer_resends_only_after_resend_after_without_new_tokens():
    sender = EloquentSender(resend_after=0.2)
    assert sender.timer() is None
    sender.on_tokens("a", now=0.0)
    sender.on_tokens("b", now=0.1)
    assert sender.timer() == pytest.approx(0.3)  # new tokens push the re-send back
    assert sender.on_timer(now=0.25) == []
    sender.on_tokens("c", now=0.25)
    assert sender.on_timer(now=0.3) == []
    (payload,) = sender.on_timer(now=0.45)
    assert [e.position for e in tokens_of(payload)] == [0, 1, 2]
    assert sender.stats.timer_datagrams == 1
    assert sender.timer() == pytest.approx(0.65)  # the next one is resend_after later
    sender.on_ack(ack(3), now=0.5)
    assert sender.timer() is None
    assert sender.on_timer(now=0.7) == []


def test_timer_datagram_carries_at_most_max_repeats_oldest_entries():
    sender = EloquentSender(max_repeats=4)
    for i in range(9):
        sender.on_tokens(f"t{i}", now=0.0)
    (payload,) = sender.on_timer(now=0.2)
    assert [e.position for e in tokens_of(payload)] == [0, 1, 2, 3]


def test_finish_keeps_resending_until_acked_then_stops_for_good():
    sender = EloquentSender()
    sender.on_tokens("last words", now=0.0)
    sender.finish()
    with pytest.raises(RuntimeError):
        sender.on_tokens("more", now=0.1)
    assert not sender.done
    assert len(sender.on_timer(now=0.2)) == 1
    assert len(sender.on_timer(now=0.4)) == 1
    sender.on_ack(ack(1), now=0.5)
    assert sender.done and sender.timer() is None
    assert sender.on_timer(now=10.0) == []


def test_resending_gives_up_when_nothing_is_heard():
    sender = EloquentSender(resend_after=0.25, give_up_after=1.0)
    sender.on_tokens("hello", now=0.0)
    sender.finish()
    sent_at = []
    now = 0.0
    while (deadline := sender.timer()) is not None:
        now = deadline
        assert sender.on_timer(now)
        sent_at.append(now)
    assert sent_at and max(sent_at) <= 1.0 + 1e-9
    assert sent_at == [0.25, 0.5, 0.75, 1.0]


def test_close_drops_everything():
    sender = EloquentSender()
    sender.on_tokens("x", now=0.0)
    sender.close()
    assert sender.done and sender.timer() is None and sender.on_timer(now=1.0) == []


def test_max_repeats_zero_sends_each_batch_once():
    sender = EloquentSender(max_repeats=0)
    sender.on_tokens("a", now=0.0)
    (payload,) = sender.on_tokens("b", now=0.1)
    assert [e.position for e in tokens_of(payload)] == [1]
    assert sender.timer() is None


# --------------------------------------------------------------------------------------------
# Receiver


def test_receiver_renders_contiguous_prefix_once_each():
    sender = EloquentSender(max_repeats=0)
    payloads = [sender.on_tokens(t, now=0.0)[0] for t in ["a", "b", "c", "d"]]
    receiver = EloquentReceiver()
    assert decode_message(receiver.on_datagram(payloads[2], now=1.0)) == Ack(0, (2,))
    assert receiver.rendered() == "" and receiver.events == []
    receiver.on_datagram(payloads[0], now=2.0)
    assert receiver.rendered() == "a"
    assert decode_message(receiver.on_datagram(payloads[1], now=3.0)) == Ack(3)
    receiver.on_datagram(payloads[1], now=3.5)  # duplicate
    assert receiver.rendered() == "abc"
    assert [(e.position, e.time) for e in receiver.events] == [(0, 2.0), (1, 3.0), (2, 3.0)]
    assert receiver.stats.duplicate_entries == 1
    assert receiver.on_stream_delta(0, "a", now=4.0) is None  # already held: nothing to ack
    ack_payload = receiver.on_stream_delta(1, "b", now=4.0)
    assert ack_payload is None
    receiver.on_stream_delta(2, "c", now=4.0)
    assert decode_message(receiver.on_stream_delta(3, "d", now=4.0)) == Ack(4)
    assert receiver.rendered() == "abcd"
    assert [e.source for e in receiver.events] == ["datagram"] * 3 + ["stream"]


def test_stream_deltas_must_come_in_order():
    receiver = EloquentReceiver()
    with pytest.raises(ValueError):
        receiver.on_stream_delta(1, "x", now=0.0)


def test_stream_copy_wins_when_copies_differ():
    receiver = EloquentReceiver()
    receiver.on_datagram(Tokens((TokenEntry(0, b"foo"),)).encode(), now=0.0)
    receiver.on_stream_delta(0, "bar", now=0.1)
    assert receiver.rendered() == "bar" and receiver.stats.mismatches == 1
    receiver.on_stream_delta(1, "baz", now=0.2)
    receiver.on_datagram(Tokens((TokenEntry(1, b"qux"),)).encode(), now=0.3)
    assert receiver.rendered() == "barbaz" and receiver.stats.mismatches == 2
    receiver.on_datagram(Tokens((TokenEntry(1, b"baz"),)).encode(), now=0.4)
    assert receiver.stats.mismatches == 2


def test_ack_lists_at_most_the_lowest_held_positions():
    receiver = EloquentReceiver()
    entries = tuple(TokenEntry(p, b"x") for p in range(1, 400, 2))
    payload = receiver.on_datagram(Tokens(entries).encode(), now=0.0)
    message = decode_message(payload)
    assert isinstance(message, Ack)
    assert message.below == 0
    assert message.held == tuple(range(1, 2 * MAX_ACK_POSITIONS, 2))
    assert len(payload) == 4 + MAX_ACK_POSITIONS  # kind, below, count (2 bytes), 1 per gap


def test_oversize_batch_is_fragmented_and_reassembled_in_any_order():
    rng = random.Random(7)
    text = random_text(rng, 2500)  # multi-byte characters: cuts fall inside some of them
    sender = EloquentSender(max_payload=200)
    payloads = sender.on_tokens(text, now=0.0)
    assert len(payloads) > 10 and all(len(p) <= 200 for p in payloads)
    rng.shuffle(payloads)
    receiver = EloquentReceiver()
    for payload in payloads[:-1]:
        assert decode_message(receiver.on_datagram(payload, now=0.1)) == Ack(0)
    assert receiver.rendered() == ""
    assert decode_message(receiver.on_datagram(payloads[-1], now=0.2)) == Ack(1)
    assert receiver.rendered() == text and len(receiver.events) == 1


# --------------------------------------------------------------------------------------------
# End to end under heavy loss, in virtual time


def simulate(texts: list[str], *, loss: float, seed: int, stream_delay: float, max_payload: int):
    """Generate a batch every 100 ms; datagrams and ACKs each lost with probability `loss` and
    reordered by jitter; the stream delivers every batch in order, `stream_delay` late plus
    head-of-line blocking. Returns (sender, receiver, stream arrival times, payloads sent)."""
    rng = random.Random(seed)
    sender = EloquentSender(max_payload=max_payload)
    receiver = EloquentReceiver()
    queue: list[tuple[float, int, str, object]] = []
    order = itertools.count()

    def at(time: float, kind: str, data: object) -> None:
        heapq.heappush(queue, (time, next(order), kind, data))

    stream_at: list[float] = []
    for i, text in enumerate(texts):
        at(i * 0.1, "generate", (i, text))
        arrival = i * 0.1 + stream_delay + rng.expovariate(1 / 0.3)
        stream_at.append(max(arrival, stream_at[-1] if stream_at else 0.0))  # in order
        at(stream_at[-1], "stream", (i, text))
    sent: list[bytes] = []

    def carry(payloads: list[bytes], now: float, kind: str) -> None:
        for payload in payloads:
            if kind == "datagram":
                sent.append(payload)
            if rng.random() >= loss:
                at(now + 0.1 + rng.uniform(0.0, 0.15), kind, payload)

    timer_at = None
    while queue:
        now, _, kind, data = heapq.heappop(queue)
        if kind == "generate":
            i, text = data
            carry(sender.on_tokens(text, now), now, "datagram")
            if i == len(texts) - 1:
                sender.finish()
        elif kind == "datagram":
            carry([receiver.on_datagram(data, now)], now, "ack")
        elif kind == "ack":
            sender.on_ack(data, now)
        elif kind == "stream":
            reply = receiver.on_stream_delta(*data, now)
            carry([reply] if reply is not None else [], now, "ack")
        elif kind == "timer":
            carry(sender.on_timer(now), now, "datagram")
        deadline = sender.timer()
        if deadline is not None and deadline != timer_at:
            timer_at = deadline
            at(deadline, "timer", None)
    return sender, receiver, stream_at, sent


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_heavy_loss_renders_exact_text_in_order_never_later_than_the_stream(seed):
    rng = random.Random(100 + seed)
    texts = [random_text(rng, rng.choice([1, 2, 4, 8, 16])) for _ in range(200)]
    texts[50] = random_text(rng, 900)  # more than one datagram at max_payload=400
    texts[120] = ""  # an empty delta still takes its position
    sender, receiver, stream_at, sent = simulate(
        texts, loss=0.7, seed=seed, stream_delay=1.0, max_payload=400
    )
    assert receiver.rendered() == "".join(texts)
    assert [e.position for e in receiver.events] == list(range(len(texts)))
    times = receiver.render_times()
    assert times == sorted(times)
    assert all(t <= s for t, s in zip(times, stream_at, strict=True))
    early = sum(t < s for t, s in zip(times, stream_at, strict=True))
    assert early > len(texts) // 4, "datagrams should beat the delayed stream often"
    assert any(e.source == "datagram" for e in receiver.events)
    assert all(len(p) <= 400 for p in sent)
    assert receiver.stats.mismatches == 0
    assert sender.done or sender.timer() is None


def test_without_loss_every_batch_renders_from_its_first_datagram():
    rng = random.Random(5)
    texts = [random_text(rng, 4) for _ in range(50)]
    sender, receiver, stream_at, sent = simulate(
        texts, loss=0.0, seed=5, stream_delay=1.0, max_payload=DEFAULT_MAX_PAYLOAD
    )
    assert receiver.rendered() == "".join(texts)
    assert all(e.source == "datagram" for e in receiver.events)
    assert sender.done
    gen = [i * 0.1 for i in range(len(texts))]
    assert late_share(gen, receiver.render_times()) == 0.0


# --------------------------------------------------------------------------------------------
# Wire format


def test_wire_format_round_trips():
    entries = (
        TokenEntry(0, b""),
        TokenEntry(3, "héllo 漢".encode()),
        TokenEntry(3, b"\xf0\x9f", offset=0, total=4),  # half an emoji: fine in a fragment
        TokenEntry(2**40, b"x" * 100),
    )
    message = Tokens(entries)
    payload = message.encode()
    assert len(payload) == message.wire_size()
    assert decode_message(payload) == message
    for acknowledgement in (Ack(0), Ack(7, (9, 10, 300)), Ack(2**50, (2**50 + 1,))):
        assert decode_message(acknowledgement.encode()) == acknowledgement
    assert len(Ack(12).encode()) == 3
    assert len(Tokens((TokenEntry(5, b"tok"),)).encode()) == 2 + 2 + 3


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00",  # unknown kind
        b"\x07\x01\x00\x02a",  # unknown kind
        b"\x01",  # TOKENS without a count
        b"\x01\x00",  # no entries
        b"\x01\x01\x00\x06ab",  # data shorter than its length
        b"\x01\x01\x00\x02ab",  # one trailing byte
        b"\x01\x01\x00\x02\xff",  # whole batch not UTF-8
        b"\x01\x01\x00\x05\x03\x04ab",  # fragment [3, 5) of a 4-byte batch
        b"\x01\x01\x00\x01\x00\x04",  # empty fragment
        b"\x01\x05\x00\x02a",  # count larger than the payload can hold
        b"\x01\x02" + b"\xff" * 8 + b"\x02a\x01\x02b",  # second position past 2**62 - 1
        b"\x02",  # ACK without below
        b"\x02\x00\x02\x00",  # ACK missing a gap
        bytes([0x02, 0x00, 0x40, MAX_ACK_POSITIONS + 1]) + b"\x00" * 65,  # too many positions
    ],
)
def test_malformed_payloads_raise_the_format_error(payload):
    with pytest.raises(EloquentFormatError):
        decode_message(payload)


def test_fuzzed_payloads_decode_or_raise_the_format_error_only():
    rng = random.Random(11)
    valid = [
        Tokens((TokenEntry(1, b"ab"), TokenEntry(2, "é".encode()))).encode(),
        Tokens((TokenEntry(9, b"xyz", offset=3, total=10),)).encode(),
        Ack(4, (6, 9)).encode(),
    ]
    for _ in range(5000):
        if rng.random() < 0.3:
            payload = bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
        else:
            payload = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 3)):
                payload[rng.randrange(len(payload))] = rng.randrange(256)
            payload = bytes(payload[: rng.randint(0, len(payload) + 1)])
        with contextlib.suppress(EloquentFormatError):
            decode_message(payload)


def test_each_end_rejects_the_other_ends_messages():
    with pytest.raises(EloquentFormatError):
        EloquentReceiver().on_datagram(Ack(0).encode(), now=0.0)
    with pytest.raises(EloquentFormatError):
        EloquentSender().on_ack(Tokens((TokenEntry(0, b"a"),)).encode(), now=0.0)
    receiver = EloquentReceiver()
    with pytest.raises(EloquentFormatError):
        receiver.on_datagram(b"\x01\x02\x00\x02a\x01\x02\xff", now=0.0)  # second entry bad
    assert receiver.rendered() == "" and receiver.stats.datagrams == 0


# --------------------------------------------------------------------------------------------
# Metrics


def test_stall_ratio_counts_whole_gaps_above_the_threshold():
    # gaps: 0.125, 0.5 (stall), 0.125, 0.25 (stall), 0.0; session 0..2
    times = [0.0, 0.125, 0.625, 0.75, 1.0, 1.0]
    assert stall_ratio(times, session_end=2.0, session_start=0.0) == pytest.approx(0.75 / 2.0)
    # The default session starts at the first render.
    assert stall_ratio([1.0, 1.5, 2.0], session_end=3.0) == pytest.approx(1.0 / 2.0)
    # A gap of exactly the threshold is not a stall.
    assert stall_ratio([0.0, 0.25, 0.5], session_end=1.0, threshold=0.25) == 0.0
    assert stall_ratio([], session_end=1.0) == 0.0
    with pytest.raises(ValueError):
        stall_ratio([0.5, 0.25], session_end=1.0)
    with pytest.raises(ValueError):
        stall_ratio([0.0, 2.0], session_end=1.0)


def test_redundancy_rate_is_extra_bytes_per_token_byte():
    assert redundancy_rate(1500, 1000) == 0.5
    assert redundancy_rate(1000, 1000) == 0.0
    with pytest.raises(ValueError):
        redundancy_rate(10, 0)
    with pytest.raises(ValueError):
        redundancy_rate(5, 10)


def test_late_share_counts_tokens_rendered_over_threshold_after_generation():
    generated = [0.0, 1.0, 2.0, 3.0]
    rendered = [0.25, 1.5, 2.5, None]  # 0.25 on time, 0.5 late, 0.5 late, never rendered late
    assert late_share(generated, rendered) == 0.75
    assert late_share(generated, rendered, threshold=0.5) == 0.25  # exactly 0.5 is not late
    assert late_share([], []) == 0.0
    with pytest.raises(ValueError):
        late_share([0.0], [])
