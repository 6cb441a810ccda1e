"""sglang-router's cache_aware, copied into the simulator (`router.prefix.SglangCacheAware`,
`router.text_tree`): its rules on hand-built cases, with the defaults of its 0.3.2 launcher
(cache threshold 0.3, balance thresholds 64 and 1.5)."""

from __future__ import annotations

import numpy as np

from router.prefix import SglangCacheAware, routing_text
from router.text_tree import TextTree, shared_prefix
from router.view import ClusterView, ReplicaState
from workloads import Message, Request, TokenIds

OBS = np.zeros(1, dtype=np.float32)


def view(loads: list[int], available: list[bool] | None = None) -> ClusterView:
    up = available or [True] * len(loads)
    return ClusterView(
        tuple(
            ReplicaState(f"r{i}", "m", n, a) for i, (n, a) in enumerate(zip(loads, up, strict=True))
        )
    )


def said(text: str, at: float = 0.0) -> Request:
    return Request("q", at, (Message("user", text),), 8, "free-tier")


def test_the_text_is_the_messages_contents_joined_by_spaces() -> None:
    chat = (Message("system", "be brief"), Message("user", "hi"), Message("assistant", ""),
            Message("user", "more"))  # fmt: skip
    assert routing_text(Request("q", 0.0, chat, 8, "free-tier")) == "be brief hi more"
    assert routing_text(Request("q", 0.0, TokenIds((5, 17)), 8, "free-tier")) == "5 17"


def test_shared_prefix_counts_characters() -> None:
    for a, b in [("abcdef", "abcxyz"), ("abc", "abcdef"), ("", "x"), ("same", "same"), ("x", "y")]:
        expected = next(
            (i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q), min(len(a), len(b))
        )
        assert shared_prefix(a, b) == expected


def test_the_tree_matches_by_character_and_answers_with_the_creator() -> None:
    tree = TextTree()
    tree.insert("hello world", 0)
    tree.insert("hello there", 1)  # splits "hello " off: both hold it, replica 0 created it
    assert tree.match("hello") == (5, 0)
    assert tree.match("hello th") == (8, 1)
    assert tree.match("goodbye")[0] == 0
    assert tree.chars == {0: len("hello world"), 1: len("hello there")}


def test_a_match_above_the_threshold_goes_to_its_holder_however_loaded() -> None:
    policy = SglangCacheAware()
    conversation = "Tell me about the history of the Roman empire, in detail."
    assert policy.choose(OBS, said(conversation), view([0, 0, 0])) == 0
    follow_up = conversation + " And Byzantium?"  # 58 of 73 characters held by replica 0
    assert policy.choose(OBS, said(follow_up), view([60, 0, 0])) == 0  # 60 - 0 is not > 64


def test_a_match_at_or_below_the_threshold_goes_to_the_least_loaded_first_on_ties() -> None:
    policy = SglangCacheAware()
    policy.choose(OBS, said("x" * 40), view([0, 0, 0]))  # replica 0 holds 40 x
    # 30 of 100 characters held: a rate of exactly 0.3, not above it.
    assert policy.choose(OBS, said("x" * 30 + "y" * 70), view([5, 3, 3])) == 1
    # 31 of 100: above; replica 0 created those 31, though 1 holds the first 30 too.
    assert policy.choose(OBS, said("x" * 31 + "z" * 69), view([5, 3, 3])) == 0


def test_an_imbalance_overrides_the_match() -> None:
    policy = SglangCacheAware()
    text = "a long shared system prompt, then the question"
    policy.choose(OBS, said(text), view([0, 0]))
    # 70 - 5 > 64 and 70 > 5 x 1.5: the least loaded, whatever it holds.
    assert policy.choose(OBS, said(text), view([70, 5])) == 1
    # 70 - 6 is not > 64: balanced, the match wins.
    assert policy.choose(OBS, said(text), view([70, 6])) == 0
    # 200 - 140 is not > 64 either; 300 - 210 > 64 but 300 is not > 210 x 1.5.
    assert policy.choose(OBS, said(text), view([300, 210])) == 0


def test_the_chosen_replica_holds_the_text_after_even_when_the_balance_chose_it() -> None:
    policy = SglangCacheAware()
    text = "what the balance rule sent away"
    policy.choose(OBS, said(text), view([100, 0]))
    assert policy.trees["m"].match(text) == (len(text), 1)


def test_a_match_on_a_replica_that_is_down_is_forgotten_and_the_first_taken() -> None:
    policy = SglangCacheAware()
    text = "held by replica two alone"
    policy.choose(OBS, said(text), view([5, 5, 0]))
    assert policy.choose(OBS, said(text), view([5, 0, 0], [True, True, False])) == 0
    assert policy.trees["m"].match(text) == (0, None)


def test_eviction_trims_each_replica_to_its_bound_oldest_first() -> None:
    policy = SglangCacheAware(max_tree_chars=25, eviction_interval_s=60.0)
    for n, text in enumerate(["first of three...", "second of three..", "third of three..."]):
        policy.choose(OBS, said(text, at=n), view([0, 1]))  # all to replica 0
    tree = policy.trees["m"]
    assert tree.chars[0] > 25
    policy.choose(OBS, said("later", at=61.0), view([0, 1]))  # the interval has passed
    assert tree.chars[0] <= 25 + len("later")
    assert tree.match("first of three...")[0] < len("first of three...")  # the oldest went
    assert tree.match("third of three...") == (len("third of three..."), 0)
