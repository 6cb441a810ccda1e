"""Eloquent's sans-IO core (transport/eloquent/): the wire format, event cutting, the sender
and the receiver. Pure logic, virtual time, seeded, no network; the events are the ones the
real server renders (`serving.api`, through `experiments.eloquent_sim.server_events`)."""

from __future__ import annotations

import json
import random

import pytest

from experiments.eloquent_sim import server_events
from transport.eloquent.endpoints import MAX_ENVELOPES, EloquentReceiver, EloquentSender
from transport.eloquent.sse import SseEvents, decode_text, split_text
from transport.eloquent.wire import (
    DEFAULT_MAX_PAYLOAD,
    EVENT,
    MAX_ACK_POSITIONS,
    TEXT,
    TEXT_ONLY,
    Ack,
    EloquentFormatError,
    Envelope,
    TokenEntry,
    Tokens,
    decode_message,
)
from workloads.summary import late_share, stall_ratio

ALPHABET = 'abcdefghij klmnop,."\\\n\téß漢字🙂'


def texts(rng: random.Random, n: int) -> list[str]:
    return [
        "".join(rng.choice(ALPHABET) for _ in range(rng.choice([1, 2, 3, 5]))) for _ in range(n)
    ]


def entries_of(payload: bytes) -> tuple[TokenEntry, ...]:
    message = decode_message(payload)
    assert isinstance(message, Tokens)
    return message.entries


def simulate(
    events: list[bytes],
    loss: float,
    seed: int,
    ack_loss: float | None = None,
    stream_delay: float = 1.0,
    gap: float = 0.1,
    delay: float = 0.05,
    **sender_options: object,
) -> tuple[EloquentSender, EloquentReceiver, list[float], list[bytes]]:
    """One response over a lossy datagram path beside a late, reliable stream, in virtual time."""
    rng = random.Random(seed)
    sender = EloquentSender(**sender_options)  # type: ignore[arg-type]
    sender.rtt = 2 * delay
    receiver = EloquentReceiver()
    arrivals: list[tuple[float, int, str, bytes]] = []  # (time, order, kind, payload)
    sent: list[bytes] = []
    order = iter(range(10**9))

    def transmit(payloads: list[bytes], now: float) -> None:
        for payload in payloads:
            sent.append(payload)
            if rng.random() >= loss:
                arrivals.append((now + delay, next(order), "tokens", payload))

    for i in range(len(events)):
        arrivals.append((i * gap, next(order), "generate", b""))
    stream_at: list[float] = []
    stream_next = generated = 0
    while arrivals or (sender.timer() is not None):
        timer = sender.timer()
        arrivals.sort()
        if timer is not None and (not arrivals or timer < arrivals[0][0]):
            transmit(sender.on_timer(timer), timer)
            continue
        now, _, kind, payload = arrivals.pop(0)
        if kind == "generate":
            event = events[generated]
            generated += 1
            transmit(sender.on_event(event, now), now)
            arrivals.append((now + stream_delay, next(order), "stream", event))
            if generated == len(events):
                sender.finish()
            continue
        if kind == "ack":
            sender.on_ack(payload, now)
            continue
        if kind == "stream":
            acks = receiver.on_stream_event(stream_next, payload, now)
            stream_next += 1
            stream_at.append(now)
        else:
            acks = receiver.on_datagram(payload, now)
        for ack in acks:
            if rng.random() >= (loss if ack_loss is None else ack_loss):
                arrivals.append((now + delay, next(order), "ack", ack))
    return sender, receiver, stream_at, sent


# --------------------------------------------------------------------------------------------
# Token-sized positions, rebuilt exactly


@pytest.mark.parametrize("seed", range(4))
def test_rebuilt_chunks_equal_the_streams_events_exactly_under_heavy_loss(seed):
    rng = random.Random(seed)
    words = texts(rng, 150)
    words[40] = "x" * 3000  # more than a datagram: the fragment path
    words[90] = ""  # an empty delta still takes its position
    events = server_events(words)
    sender, receiver, stream_at, sent = simulate(events, loss=0.6, seed=seed, max_payload=400)
    assert receiver.next_event == receiver.next_position == len(events)
    assert [receiver.event_of(p) for p in range(len(events))] == events
    assert receiver.stats.mismatches == 0
    # Renders: each position once, in order, never later than the stream delivered it.
    assert [e.position for e in receiver.events] == list(range(len(events)))
    times = receiver.render_times()
    assert times == sorted(times)
    assert all(t <= s for t, s in zip(times, stream_at, strict=True))
    assert sum(e.source == "datagram" for e in receiver.events) > len(events) // 4
    assert all(len(p) <= 400 for p in sent)
    assert "".join(receiver.text_of(p) for p in range(len(words))) == "".join(words)


def test_datagrams_carry_token_sized_entries_and_the_envelope_until_it_is_acknowledged():
    events = server_events([" Hello", ",", " world", "!"] * 10)
    sender, receiver, _, sent = simulate(events, loss=0.0, seed=0, stream_delay=5.0)
    first = decode_message(sent[0])
    assert isinstance(first, Tokens) and first.envelope is not None
    assert b'"model":"opt-1.3b"' in first.envelope.head and b'"replica"' in first.envelope.head
    assert first.entries == (TokenEntry(0, b" Hello", TEXT),)
    # Once the receiver has said it holds the middle chunks' envelope, datagrams carry text.
    middle = [decode_message(p) for p in sent[5:30]]
    assert all(isinstance(m, Tokens) and m.envelope is None for m in middle)
    assert max(len(p) for p in sent[5:30]) < 40
    assert all(e.source == "datagram" for e in receiver.events)
    assert sender.done


def test_split_text_cuts_the_first_text_value_and_nothing_else():
    event = (
        b'data: {"id":"a\\"content\\":\\"x","choices":[{"delta":{"content":"hi \\"you\\""}}]}\n\n'
    )
    head, text, tail = split_text(event)  # type: ignore[misc]
    assert head + text + tail == event
    assert decode_text(text) == 'hi "you"'
    assert split_text(b'data: {"text": "a\\u00e9"}\n\n')[1] == b"a\\u00e9"  # type: ignore[index]
    assert split_text(b"data: [DONE]\n\n") is None
    assert split_text(b'data: {"content":[1,2],"x":"y"}\n\n') is None
    cutter = SseEvents()
    assert cutter.feed(b"data: a\n\nda") == [b"data: a\n\n"]
    assert cutter.feed(b"ta: b\n\n") == [b"data: b\n\n"] and cutter.rest() == b""


def test_logprobs_events_go_as_text_only_and_their_events_come_by_the_stream():
    def event(i: int) -> bytes:
        token = f" t{i}"
        lp = {"content": [{"token": token, "logprob": -0.1 * i, "top_logprobs": []}]}
        chunk = {"id": "x", "choices": [{"delta": {"content": token}, "logprobs": lp}]}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    events = [event(i) for i in range(20)]
    sender, receiver, stream_at, sent = simulate(events, loss=0.0, seed=1, stream_delay=3.0)
    entries = [e for p in sent for e in entries_of(p)]
    assert all(e.kind == TEXT_ONLY for e in entries if e.position >= MAX_ENVELOPES)
    assert all(e.kind != EVENT for e in entries[MAX_ENVELOPES * 2 :])
    # The text rendered from the datagrams alone, long before the stream came...
    assert all(e.source == "datagram" for e in receiver.events)
    assert receiver.render_times()[-1] < stream_at[0]
    # ...and every whole event, logprobs and all, is the stream's.
    assert [receiver.event_of(p) for p in range(20)] == events


# --------------------------------------------------------------------------------------------
# The sender


def test_repeats_are_the_oldest_unacknowledged_within_the_window_and_the_window_follows_rtt():
    events = server_events([f" w{i}" for i in range(30)])
    sender = EloquentSender(tail_resend=False)
    for i, event in enumerate(events[:20]):
        sender.on_event(event, i * 0.1)  # nothing is ever acknowledged
    sender.on_ack(Ack(0, (), 0).encode(), 1.9)  # an ACK at 1.9: L is 0, nothing held
    for rtt, oldest in ((0.22, 15), (0.47, 10), (None, 0)):
        sender.rtt = rtt
        window = sender.repeat_window(2.0)
        assert window == (None if rtt is None else pytest.approx(2 * rtt + 0.1))
        positions = [e.position for e in entries_of(sender.on_event(events[20], 2.0)[0])]
        assert positions[0] == oldest and positions == sorted(positions)
        sender = EloquentSender(tail_resend=False)
        for i, event in enumerate(events[:20]):
            sender.on_event(event, i * 0.1)
        sender.on_ack(Ack(0, (), 0).encode(), 1.9)


def test_l_is_the_longest_silence_between_acks_or_the_present_one():
    sender = EloquentSender()
    sender.rtt = 0.1
    for i in range(5):
        sender.on_event(b"data: x\n\n", i * 0.1)
    for t in (0.1, 0.2, 0.9, 1.0):
        sender.on_ack(Ack(0).encode(), t)
    assert sender.repeat_window(1.0) == pytest.approx(0.2 + 0.7)
    assert sender.repeat_window(3.0) == pytest.approx(0.2 + 2.0)  # silent for 2 s now
    assert sender.repeat_window(12.0) == pytest.approx(0.2 + 11.0)


def test_tail_goes_again_while_acks_are_missing_even_as_new_tokens_flow():
    events = server_events([f" w{i}" for i in range(40)])
    for tail in (False, True):
        sender = EloquentSender(tail_resend=tail, tail_interval=0.05)
        sender.rtt = 0.1
        timer_sends = 0
        for i, event in enumerate(events[:30]):
            now = i * 0.1
            sender.on_event(event, now)
            while (due := sender.timer()) is not None and due < now + 0.1:
                timer_sends += len(sender.on_timer(due))
        # No ACK ever came: the tail went every 50 ms once overdue, or never without it.
        assert (timer_sends > 30) is tail
        assert (sender.stats.timer_datagrams > 0) is tail


def test_events_faster_than_min_gap_or_a_sixth_of_the_rtt_go_together():
    events = server_events([f" w{i}" for i in range(40)])
    for rtt, gap in ((None, 0.05), (0.6, 0.1)):
        sender = EloquentSender(min_gap=0.05, tail_resend=False)
        sender.rtt = rtt
        sent: list[tuple[float, bytes]] = []
        for i, event in enumerate(events):
            now = i * 0.01  # a hundred tokens a second
            while (due := sender.timer()) is not None and due <= now:
                sent += [(due, p) for p in sender.on_timer(due)]
            sent += [(now, p) for p in sender.on_event(event, now)]
        due = sender.timer()
        assert due is not None
        sent += [(due, p) for p in sender.on_timer(due)]  # the last ones, held until now
        times = [t for t, _ in sent]
        assert all(b - a >= gap - 1e-9 for a, b in zip(times, times[1:], strict=False))
        assert len(sent) <= 0.4 / gap + 2
        # Nothing is lost by waiting: every event went out in some datagram.
        assert {e.position for _, p in sent for e in entries_of(p)} == set(range(len(events)))


def test_idle_resend_finish_give_up_and_close():
    event = server_events([" a"])[0]
    sender = EloquentSender(resend_after=0.2, give_up_after=1.0, tail_resend=False)
    sender.on_event(event, 0.0)
    assert sender.timer() == pytest.approx(0.2)
    assert sender.on_timer(0.1) == []
    assert len(sender.on_timer(0.2)) == 1
    sender.finish()
    while (due := sender.timer()) is not None:
        sender.on_timer(due)
    assert not sender.done and sender.stats.timer_datagrams == 5  # gave up after 1 s unheard
    sender.close()
    assert sender.done and sender.timer() is None
    with pytest.raises(RuntimeError):
        sender.on_event(event, 2.0)


def test_an_ack_for_positions_never_sent_is_refused_and_counted():
    sender = EloquentSender()
    sender.on_event(server_events([" a"])[0], 0.0)
    for bogus in (Ack(5).encode(), Ack(0, (7,)).encode(), Ack(1, (), 9).encode(),
                  Tokens((TokenEntry(0, b"x", EVENT),)).encode(), b"\xff"):  # fmt: skip
        with pytest.raises(EloquentFormatError):
            sender.on_ack(bogus, 0.1)
    assert sender.stats.bad_acks == 5 and sender.unacked_positions == [0]
    sender.on_ack(Ack(1).encode(), 0.2)
    assert sender.unacked_positions == []


@pytest.mark.parametrize("max_payload", [80, 300, DEFAULT_MAX_PAYLOAD])
def test_no_payload_exceeds_max_payload(max_payload):
    rng = random.Random(max_payload)
    words = texts(rng, 80)
    words[10], words[50] = "y" * 5000, "é" * 700
    events = server_events(words)
    _, receiver, _, sent = simulate(events, loss=0.3, seed=3, max_payload=max_payload)
    assert sent and all(len(p) <= max_payload for p in sent)
    assert [receiver.event_of(p) for p in range(len(events))] == events


# --------------------------------------------------------------------------------------------
# The receiver, and hostile input


def test_the_receiver_never_renders_a_position_twice_or_out_of_order():
    rng = random.Random(9)
    events = server_events(texts(rng, 60))
    sender = EloquentSender(max_payload=200)
    payloads = [p for i, e in enumerate(events) for p in sender.on_event(e, i * 0.01)]
    receiver = EloquentReceiver()
    for step in range(600):  # duplicates, reordering, and the stream interleaved
        receiver.on_datagram(rng.choice(payloads), step * 0.01)
        if step % 20 == 0 and step // 20 < len(events):
            receiver.on_stream_event(step // 20, events[step // 20], step * 0.01)
    positions = [e.position for e in receiver.events]
    assert positions == list(range(len(positions)))
    with pytest.raises(ValueError):
        receiver.on_stream_event(0, events[0], 7.0)  # the stream is in order


def test_ack_delay_coalesces_in_order_acks_and_answers_gaps_at_once():
    events = server_events([f" {i}" for i in range(4)])
    sender = EloquentSender(max_repeats=0, min_gap=0.0)  # one entry a datagram
    payloads = [sender.on_event(e, 0.0)[0] for e in events]
    receiver = EloquentReceiver(ack_delay=0.05)
    assert receiver.on_datagram(payloads[0], 1.0) == [] and receiver.timer() == 1.05
    assert receiver.on_datagram(payloads[1], 1.01) == [] and receiver.timer() == 1.05
    assert receiver.on_timer(1.04) == []
    (ack,) = receiver.on_timer(1.05)
    assert decode_message(ack) == Ack(2, (), 1) and receiver.timer() is None
    (ack,) = receiver.on_datagram(payloads[3], 1.1)  # past a gap: at once, naming what it holds
    assert decode_message(ack) == Ack(2, (3,), 1)


def test_the_stream_wins_when_copies_differ():
    events = server_events([" a", " b", " c"])
    sender = EloquentSender()
    receiver = EloquentReceiver()
    forged = events[1].replace(b'" b"', b'" B"')
    for payload in sender.on_event(events[0], 0.0) + sender.on_event(forged, 0.1):
        receiver.on_datagram(payload, 0.2)
    for i, event in enumerate(events[:2]):
        receiver.on_stream_event(i, event, 0.3)
    assert receiver.stats.mismatches == 1
    assert receiver.event_of(1) == events[1] and receiver.text_of(1) == " b"


def test_malformed_or_hostile_datagrams_are_dropped_and_counted():
    receiver = EloquentReceiver()
    envelope = Envelope(0, b'data: {"content":"', b'"}\n\n')
    hostile = [
        b"",
        b"\x07",  # unknown kind
        Ack(3).encode(),  # an ACK at the receiver
        b"\x01\x00\x00\x01\x00\x0e\xff",  # an EVENT entry that is not UTF-8
        Tokens((TokenEntry(2**40, b"far", EVENT),)).encode(),  # a position far ahead
        Tokens((TokenEntry(0, b"ab", TEXT, 0, 2**30),), 0, envelope).encode(),  # a huge entry
    ]
    for payload in hostile:
        for ack in receiver.on_datagram(payload, 0.0):
            assert decode_message(ack) in (Ack(0), Ack(0, (), 0))
    assert receiver.stats.dropped == len(hostile)
    assert receiver.next_position == 0 and receiver.events == []
    # A TEXT entry whose envelope never came renders its text; its event waits for the stream.
    receiver = EloquentReceiver()
    receiver.on_datagram(Tokens((TokenEntry(0, b"hi", TEXT),), 5).encode(), 0.0)
    assert receiver.next_position == 1 and receiver.next_event == 0
    assert receiver.stats.text_only == 1


def test_fuzzed_datagrams_never_raise_or_corrupt_the_stream():
    rng = random.Random(11)
    events = server_events(texts(rng, 40))
    sender = EloquentSender(max_payload=300)
    valid = [p for i, e in enumerate(events) for p in sender.on_event(e, i * 0.1)]
    receiver = EloquentReceiver()
    for step in range(5000):
        payload = bytearray(rng.choice(valid))
        for _ in range(rng.randrange(4)):
            payload[rng.randrange(len(payload))] = rng.randrange(256)
        if rng.random() < 0.2:
            payload = payload[: rng.randrange(len(payload) + 1)]
        receiver.on_datagram(bytes(payload), step * 0.001)
        positions = [e.position for e in receiver.events]
        assert positions == list(range(len(positions)))
    for i, event in enumerate(events):
        receiver.on_stream_event(i, event, 10.0)
    # Whatever the fuzz rendered, the stream's copy of every event is what is kept.
    assert [receiver.event_of(p) for p in range(len(events))] == events
    assert receiver.stats.dropped > 0


def test_an_ack_lists_at_most_the_lowest_held_positions():
    receiver = EloquentReceiver()
    sender = EloquentSender(max_repeats=0, min_gap=0.0)
    events = server_events([f" {i}" for i in range(200)])
    payloads = [sender.on_event(e, 0.0)[0] for e in events]
    acks = [a for p in payloads[1:] for a in receiver.on_datagram(p, 0.0)]
    last = decode_message(acks[-1])
    assert isinstance(last, Ack) and last.below == 0
    assert last.held == tuple(range(1, MAX_ACK_POSITIONS + 1))


# --------------------------------------------------------------------------------------------
# Wire format


def test_wire_format_round_trips():
    envelope = Envelope(3, b'data: {"content":"', b'"}\n\n')
    entries = (
        TokenEntry(0, b"", EVENT),
        TokenEntry(3, "héllo 漢".encode(), TEXT),
        TokenEntry(3, b"\xf0\x9f", TEXT, offset=0, total=4),  # half an emoji: fine in a fragment
        TokenEntry(4, b"x", TEXT_ONLY),
        TokenEntry(2**40, b"x" * 100, EVENT),
    )
    for message in (Tokens(entries, 3, envelope), Tokens(entries, 3), Tokens(entries[:1])):
        payload = message.encode()
        assert len(payload) == message.wire_size()
        assert decode_message(payload) == message
    for acknowledgement in (Ack(0), Ack(7, (9, 10, 300), 2), Ack(2**50, (2**50 + 1,))):
        assert decode_message(acknowledgement.encode()) == acknowledgement
    # Hand-built bytes: kind, below, envelope+1, count; kind, flags, ref, count, step, head, data
    assert Ack(12, (), 0).encode() == bytes([0x02, 12, 1, 0])
    assert (
        Tokens((TokenEntry(5, b"tok", TEXT),), 0).encode()
        == bytes([1, 0, 1, 1, 5, 3 << 3]) + b"tok"
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00",  # unknown kind
        b"\x01",  # TOKENS without flags
        b"\x01\x02\x00\x01\x00\x08a",  # unknown flags
        b"\x01\x01\x00\x01\x00\x08a",  # an envelope with no position
        b"\x01\x00\x00\x00",  # no entries
        b"\x01\x00\x00\x01\x00\x00",  # a TEXT entry with no envelope
        b"\x01\x00\x00\x01\x00\x0e\xff",  # an EVENT that is not UTF-8
        b"\x01\x00\x00\x01\x00\x16a",  # unknown entry kind 3
        b"\x01\x00\x00\x01\x00\x30ab",  # data shorter than its length
        b"\x01\x00\x00\x01\x00\x0aab",  # one trailing byte
        b"\x01\x00\x00\x01\x00\x13\x03\x04ab",  # fragment [3, 5) of a 4-byte entry
        b"\x01\x00\x00\x05\x00\x0aa",  # count larger than the payload can hold
        b"\x02",  # ACK without below
        b"\x02\x00\x00\x02\x00",  # ACK missing a gap
        bytes([0x02, 0x00, 0x00, 0x40, MAX_ACK_POSITIONS + 1]) + b"\x00" * 65,  # too many
    ],
)
def test_malformed_payloads_raise_the_format_error(payload):
    with pytest.raises(EloquentFormatError):
        decode_message(payload)


# --------------------------------------------------------------------------------------------
# Chatterbox's metrics (workloads.summary)


def test_stall_ratio_counts_whole_gaps_above_the_threshold():
    # gaps: 0.125, 0.5 (stall), 0.125, 0.25 (stall), 0.0; session 0..2
    times = [0.0, 0.125, 0.625, 0.75, 1.0, 1.0]
    assert stall_ratio(times, session_end=2.0, session_start=0.0) == pytest.approx(0.75 / 2.0)
    # The default session starts at the first render.
    assert stall_ratio([1.0, 1.5, 2.0], session_end=3.0) == pytest.approx(1.0 / 2.0)
    # A gap of exactly the threshold is not a stall, nor one that float arithmetic made a hair
    # longer (1.6 - 1.4 > 0.2 in binary).
    assert stall_ratio([0.0, 0.25, 0.5], session_end=1.0, threshold=0.25) == 0.0
    assert stall_ratio([1.4, 1.6], session_end=1.6) == 0.0
    assert stall_ratio([], session_end=1.0) == 0.0
    with pytest.raises(ValueError):
        stall_ratio([0.5, 0.25], session_end=1.0)
    with pytest.raises(ValueError):
        stall_ratio([0.0, 2.0], session_end=1.0)


def test_late_share_counts_tokens_rendered_over_threshold_after_generation():
    generated = [0.0, 1.0, 2.0, 3.0]
    rendered = [0.25, 1.5, 2.5, None]  # 0.25 on time, 0.5 late, 0.5 late, never rendered late
    assert late_share(generated, rendered) == 0.75
    assert late_share(generated, rendered, threshold=0.5) == 0.25  # exactly 0.5 is not late
    assert late_share([], []) == 0.0
    with pytest.raises(ValueError):
        late_share([0.0], [])
