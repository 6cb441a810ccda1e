"""Admission control: a request that no replica can start in time is refused at once.

The rule is logic on plain views, tested here on hand-made ones; the simulator and the gateway
both run it, tested on the simulator in virtual time and on a live server whose single simulated
replica runs one request at a time (the `saturable` deployment of tests/support/servers.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from config import QosClass, Slo, load_deployment
from config.schema import ProfileModel
from router.admission import AdmitAll, DeadlineAdmission, Expected, Shed, class_budgets
from router.env import RoutingEnv
from router.policies import make_policy
from router.sim import DEADLINE, OK, SHED, Simulator
from router.view import ClusterView, ReplicaState
from serving.engines.base import Sampling, TokenDelta
from serving.gateway import DeadlineExceeded, Gateway, GatewayError, Overloaded
from serving.metrics import Metrics
from serving.replicas import Replica, ReplicaSet
from tests.support.servers import PREMIUM_KEY, Server, wait_until
from workloads import Request
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec

CLASSES = {
    "real-time": QosClass(urgency=0, deadline_s=1.0, level="high"),
    "free-tier": QosClass(urgency=3, deadline_s=2.0, level="low"),
    "long": QosClass(urgency=5, deadline_s=7.0, level="low"),
}
FLAT = ProfileModel(prefill_s_per_token=0.001, step_s={1: 0.01, 4: 0.04})
"""10 ms a step per request in the batch; 1 ms per prompt token."""


def request(qos_class: str = "free-tier", arrival: float = 0.0, prompt: int = 100) -> Request:
    return Request("r", arrival, "hi", 32, qos_class, prompt_tokens=prompt)


def view(*running: tuple[int, int], available: bool = True) -> ClusterView:
    """One replica per (requests in flight, output tokens they are owed)."""
    return ClusterView(
        tuple(ReplicaState(f"r{i}", "m", n, available, owed) for i, (n, owed) in enumerate(running))
    )


def rule(replicas: int = 1, max_batch: int = 4, device: str = "d") -> DeadlineAdmission:
    return DeadlineAdmission([("m", device)] * replicas, {"m": FLAT}, CLASSES, 0.5, max_batch)


def test_budgets_leave_the_most_urgent_class_its_whole_deadline() -> None:
    budgets = class_budgets(CLASSES, lower_class_share=0.5)
    assert budgets == {"real-time": 1.0, "free-tier": 0.5, "long": 0.5}


def test_a_free_slot_costs_one_step_and_the_prefill() -> None:
    # Two in flight of a batch of 4: the request waits for the step in progress (batch 2, 20 ms),
    # then joins the next, at batch 3 (30 ms), after its 100-token prefill (100 ms).
    assert rule().first_token_s(view((2, 64)), 0, 100) == pytest.approx(0.15)


def test_a_full_batch_makes_the_request_wait_for_slots_to_free() -> None:
    # 6 in flight, batch 4: 3 must finish first. They are owed 600 tokens, 100 each; a full batch
    # finishes 4 / 100 requests a step, so 3 take 75 steps, after the one in progress and before
    # its own: 77 x 40 ms + 100 ms.
    assert rule().first_token_s(view((6, 600)), 0, 100) == pytest.approx(77 * 0.04 + 0.1)


def test_busy_neighbours_on_the_device_slow_the_estimate() -> None:
    shared = rule(replicas=2)
    apart = DeadlineAdmission([("m", "a"), ("m", "b")], {"m": FLAT}, CLASSES, 0.5, 4)
    busy = view((0, 0), (1, 10))
    alone = apart.first_token_s(busy, 0, 100)
    assert shared.first_token_s(busy, 0, 100) == pytest.approx(1.5 * alone)


def test_lower_classes_are_shed_first() -> None:
    # About 0.7 s to a first token: past the free tier's 0.25 s budget, within real time's 1 s.
    loaded = view((10, 80))  # 7 must finish, owed 8 tokens each: 14 steps, between two more
    estimate = rule().first_token_s(loaded, 0, 100)
    assert estimate == pytest.approx(16 * 0.04 + 0.1)
    shed = rule().check(request("free-tier"), loaded, now=0.0)
    assert isinstance(shed, Shed) and shed.budget_s == 0.25 and shed.retry_after_s == 1
    assert isinstance(rule().check(request("long"), loaded, now=0.0), Shed)
    assert rule().check(request("real-time"), loaded, now=0.0) == loaded


def test_a_request_let_in_may_go_only_where_it_is_in_time() -> None:
    two = DeadlineAdmission([("m", "a"), ("m", "b")], {"m": FLAT}, CLASSES, 0.5, 4)
    admitted = two.check(request(), view((400, 40_000), (0, 0)), now=0.0)
    assert isinstance(admitted, ClusterView)
    assert [r.available for r in admitted.replicas] == [False, True]
    pinned_elsewhere = ClusterView(
        (ReplicaState("r0", "m", 400, True, 40_000), ReplicaState("r1", "m", 0, False, 0))
    )
    assert isinstance(two.check(request(), pinned_elsewhere, now=0.0), Shed)


def test_of_the_replicas_in_time_those_expected_to_meet_the_slo_are_preferred() -> None:
    paced = DeadlineAdmission([("m", "a"), ("m", "b")], {"m": FLAT}, CLASSES, 0.5, 4, tpot_s=0.025)
    # a: idle, steps of 10 ms; b: 3 in flight, so the request would join steps of 40 ms.
    admitted = paced.check(request("real-time"), view((0, 0), (3, 30)), now=0.0)
    assert isinstance(admitted, ClusterView)
    assert [r.available for r in admitted.replicas] == [True, False]
    # Where none is expected to meet it, real time still goes where it is in time, but a less
    # urgent class is shed: an answer that misses the SLO anyway would only take engine time.
    admitted = paced.check(request("real-time"), view((3, 30), (3, 30)), now=0.0)
    assert isinstance(admitted, ClusterView)
    assert [r.available for r in admitted.replicas] == [True, True]
    # Its first token in 0.17 s is within its 0.5 s budget; its answer in 0.17 + 31 x 40 ms is
    # not within 32 x 25 ms.
    shed = paced.check(request("free-tier"), view((3, 30), (3, 30)), now=0.0)
    assert isinstance(shed, Shed) and shed.answer
    assert (shed.estimate_s, shed.budget_s) == pytest.approx((1.41, 0.8))


def test_the_wait_so_far_counts_against_the_slo() -> None:
    paced = DeadlineAdmission([("m", "a"), ("m", "b")], {"m": FLAT}, CLASSES, 0.5, 4, tpot_s=0.025)
    # 32 tokens at 25 ms: 0.8 s from arrival to the last. a (idle) needs 0.11 + 31 x 10 ms =
    # 0.42 s, b (one in flight) 0.13 + 31 x 20 ms = 0.75 s: both fit, until 0.3 s have passed.
    loaded = view((0, 0), (1, 10))
    fresh = paced.check(request("real-time"), loaded, now=0.0)
    assert isinstance(fresh, ClusterView)
    assert [r.available for r in fresh.replicas] == [True, True]
    waited = paced.check(request("real-time"), loaded, now=0.3)
    assert isinstance(waited, ClusterView)
    assert [r.available for r in waited.replicas] == [True, False]


def test_late_first_tokens_teach_the_estimate_to_be_later() -> None:
    live = rule()
    idle = view((0, 0))
    expected = live.expect(request(), idle, 0)
    assert expected is not None and expected.first_token_s == pytest.approx(0.11)
    for _ in range(200):  # the engine is twice as slow as its profile says
        estimate = live.expect(request(), idle, 0)
        assert estimate is not None
        live.observe_first_token(0, estimate, 2 * estimate.first_token_s)
    assert live.scale[0] == pytest.approx(2.0, rel=0.01)
    assert live.first_token_s(idle, 0, 100) == pytest.approx(0.22, rel=0.01)
    stalled = Expected(first_token_s=0.001, step_s=0.01)
    for _ in range(1000):  # a stalled engine cannot push the scale past its bound
        live.observe_first_token(0, stalled, 1000.0)
    assert live.scale[0] == pytest.approx(10.0)


@pytest.mark.parametrize("qos_class", ["free-tier", "real-time"])
def test_requests_that_wait_out_their_deadline_teach_the_rule_to_shed(qos_class: str) -> None:
    # A replica far slower than its profile: nothing let in gets a first token by the deadline,
    # and each miss reports only how long it waited. That alone must make the rule shed, for
    # real time too, whose budget is its whole deadline.
    live = rule()
    idle = view((0, 0))
    deadline = CLASSES[qos_class].deadline_s
    misses = 0
    while not isinstance(live.check(request(qos_class), idle, now=0.0), Shed):
        expected = live.expect(request(qos_class), idle, 0)
        assert expected is not None
        live.observe_first_token(0, expected, deadline, missed=True)
        misses += 1
        assert misses < 100, "the rule still lets requests in after 100 misses"


class _Stalled:
    """An engine that takes every request and never answers: a replica far slower than its
    profile (a unit-test stand-in; the live path is the overload benchmark's)."""

    async def start(self) -> None:
        pass

    async def generate(self, request: Request, sampling: Sampling) -> AsyncIterator[TokenDelta]:
        await asyncio.Future()  # never done: cancelled when the gateway gives up
        yield TokenDelta("", 0, 0)

    async def abort(self, request_id: str) -> None:
        pass

    def healthy(self) -> bool:
        return True

    async def recover(self) -> None:
        pass

    def unfinished(self) -> int:
        return 0

    def load(self) -> None:
        return None

    async def close(self) -> None:
        pass


async def test_a_gateway_whose_replicas_never_answer_learns_to_shed() -> None:
    # The embedded deployment, with a real-time deadline of 20 ms (its profile expects about
    # 10 ms to a first token on an idle replica) and engines that never give one.
    embedded = load_deployment(name="embedded")
    classes = dict(embedded.qos_classes)
    classes["real-time"] = classes["real-time"].model_copy(update={"deadline_s": 0.02})
    deployment = replace(embedded, qos_classes=classes)
    replicas = ReplicaSet([Replica(c, _Stalled()) for c in deployment.replicas])
    gateway = Gateway(deployment, replicas, make_policy(deployment, "least-load"),
                      Metrics(replicas))  # fmt: skip
    misses = 0
    while True:
        rt = Request(f"r{misses}", time.monotonic(), "hi", 8, "real-time")
        with pytest.raises(GatewayError) as refused:
            await gateway.start(rt, Sampling())
        if isinstance(refused.value, Overloaded):
            break
        assert isinstance(refused.value, DeadlineExceeded)
        misses += 1
        assert misses < 300, "still dispatching after 300 misses"
    assert all(r.running == 0 for r in replicas)
    count = gateway.metrics.requests.labels
    assert count("real-time", "none", "shed")._value.get() == 1
    assert sum(count("real-time", r.model, "deadline")._value.get() for r in replicas) == misses


def test_a_replica_that_was_slow_is_tried_again_after_a_while() -> None:
    # Learned to be 10 times slower than its profile: every free-tier request is shed. With
    # nothing more to learn from (none is sent there), that is kept for 30 s, then fades, and a
    # minute and a half later one is let in again.
    live = rule()
    idle = view((0, 0))
    expected = live.expect(request(), idle, 0)
    assert expected is not None
    for _ in range(200):
        live.observe_first_token(0, expected, 10 * expected.first_token_s)
    assert isinstance(live.check(request(arrival=0.0), idle, now=0.0), Shed)
    assert isinstance(live.check(request(arrival=10.0), idle, now=10.0), Shed)
    assert isinstance(live.check(request(arrival=30.0), idle, now=30.0), Shed)
    assert live.check(request(arrival=90.0), idle, now=90.0) == idle


def test_a_slow_pace_moves_requests_to_replicas_that_keep_the_slo() -> None:
    paced = DeadlineAdmission([("m", "a"), ("m", "b")], {"m": FLAT}, CLASSES, 0.5, 4, tpot_s=0.025)
    idle = view((0, 0), (0, 0))
    admitted = paced.check(request("real-time"), idle, now=0.0)
    assert isinstance(admitted, ClusterView)
    assert [r.available for r in admitted.replicas] == [True, True]
    for _ in range(100):  # a's requests come at 30 ms a token, three times its 10 ms steps
        expected = paced.expect(request("real-time"), idle, 0)
        assert expected is not None
        paced.observe_pace(0, expected, 0.03)
    assert paced.pace[0] == pytest.approx(3.0, rel=0.01)
    admitted = paced.check(request("real-time"), idle, now=0.0)
    assert isinstance(admitted, ClusterView)
    assert [r.available for r in admitted.replicas] == [False, True]
    assert paced.scale == [1.0, 1.0]  # the first-token estimate is a separate lesson


def test_time_already_waited_counts_against_the_budget() -> None:
    idle = view((0, 0))  # 110 ms to a first token; the free tier may wait 250 ms
    assert rule().check(request(arrival=0.0), idle, now=0.1) == idle
    assert isinstance(rule().check(request(arrival=0.0), idle, now=0.2), Shed)


def test_retry_after_is_how_far_past_the_budget_the_queue_is() -> None:
    shed = rule().check(request("free-tier"), view((40, 40 * 100)), now=0.0)
    assert isinstance(shed, Shed)
    assert shed.retry_after_s == int(shed.estimate_s - 0.25) + 1


def test_the_simulator_ends_a_request_at_its_deadline_and_frees_its_slot() -> None:
    profile = ProfileModel(prefill_s_per_token=0.0, step_s={1: 0.1})
    sim = Simulator([("r0", "m", "d")], {"m": profile}, Slo(tpot_s=1.0), max_batch=1,
                    deadlines={"free-tier": 2.0})  # fmt: skip
    first = Request("first", 0.0, "", 30, "free-tier")  # holds the only slot for 3 s
    late = Request("late", 0.0, "", 5, "free-tier")
    sim.submit(first, 0)
    sim.submit(late, 0)
    assert sim.view().replicas[0].owed == 35
    done = {f.request.request_id: f for f in sim.drain()}
    assert done["late"].outcome == DEADLINE and done["late"].first_token is None
    assert done["late"].last_token == pytest.approx(2.0)  # the first step boundary past 2 s
    assert done["first"].outcome == OK and done["first"].output_tokens == 30
    assert sim.view().replicas[0] == ReplicaState("r0", "m", 0, True, 0)


def test_the_environment_never_asks_the_policy_about_a_shed_request() -> None:
    deployment = load_deployment(name="paper-4gpu")
    overload = WorkloadSpec(arrivals=Poisson(1000.0), classes={"free-tier": 1.0})
    counts = {}
    for name, admission in (("shed", None), ("all", AdmitAll())):
        env = RoutingEnv(deployment, action="replica", admission=admission)
        env.reset(seed=0, options={"workload": overload, "seed": 0, "requests": 3000})
        steps, truncated = 0, False
        while not truncated:
            _, _, _, truncated, _ = env.step(env.view().least_loaded() or 0)
            steps += 1
        env.drain()
        outcomes = [f.outcome for f in env.finished]
        assert len(outcomes) == 3000 and steps == 3000 - outcomes.count(SHED)
        counts[name] = {o: outcomes.count(o) for o in (OK, DEADLINE, SHED)}
    assert counts["all"][SHED] == 0 and counts["all"][DEADLINE] > 0
    # What is let in is sent where it makes its deadline (least-loaded, unchecked, sends a
    # quarter of the requests where they wait it out).
    assert counts["shed"][SHED] > 0 and counts["shed"][DEADLINE] == 0


def _hold_one_stream(server: Server, started: threading.Event, done: threading.Event) -> None:
    """Keeps one long stream running on the replica until `done`: 1,800 tokens, short of the
    context (2,048), take 36 s at the replica's 20 ms a token; should one end all the same, the
    next follows at once."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1800,
            "ignore_eos": True, "stream": True}  # fmt: skip
    while not done.is_set():
        url = server.url + "/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                if done.is_set():
                    return


def test_a_saturated_replica_sheds_free_tier_and_serves_real_time(saturable_server: Server) -> None:
    server = saturable_server
    replica = {"replica": next(iter(_replicas(server))), "model": "tiny-s"}
    started, done = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_one_stream, args=(server, started, done))
    holder.start()
    try:
        assert started.wait(60), "the long stream did not start"
        assert server.metric("serving_engine_unfinished", **replica) == 1
        shed = {"qos_class": "free-tier", "model": "none", "outcome": "shed"}
        shed_before = server.metric("serving_requests_total", **shed)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
        # Never dispatched: the engine holds the long stream only.
        assert server.metric("serving_engine_unfinished", **replica) == 1
        assert server.metric("serving_requests_total", **shed) == shed_before + 1
        # Shed at the door: never taken up by the API's handler (no queue time, which ends
        # there), and logged once, as counted.
        line = server.logged(r.headers["x-request-id"])
        assert (line["outcome"], line["queue_s"], line["model"]) == ("shed", None, None)
        pinned = httpx.post(
            server.url + "/v1/chat/completions", json={**body, "model": "tiny-s"}, timeout=30
        )
        assert pinned.status_code == 429, pinned.text
        assert server.logged(pinned.headers["x-request-id"])["model"] == "tiny-s"
        # Real time is let in behind the stream: it waits at the engine for its one slot,
        # which the stream's end frees.
        with ThreadPoolExecutor(1) as pool:
            real_time = pool.submit(
                httpx.post,
                server.url + "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {PREMIUM_KEY}"},
                timeout=60,
            )
            try:
                wait_until(
                    lambda: server.metric("serving_engine_unfinished", **replica) == 2,
                    10,
                    "the real-time request to reach the engine",
                )
            finally:
                done.set()  # else a failure waits out the stream before it is reported
            served = real_time.result()
        assert served.status_code == 200, served.text
        assert served.headers["x-qos-class"] == "real-time"
    finally:
        done.set()
        holder.join(120)
    wait_until(
        lambda: server.metric("serving_engine_unfinished", **replica) == 0,
        30,
        "the long stream to end",
    )


def _replicas(server: Server) -> list[str]:
    models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    return [r for m in models for r in m.get("replicas", [])]


def test_a_batch_of_prompts_is_admitted_whole_not_shed_against_itself(
    saturable_server: Server,
) -> None:
    """lm-eval sends 16 one-token prompts in one request. One at a time, 20 ms a token, the
    later ones cannot make the 40 ms a one-token answer's SLO allows behind the earlier ones;
    judged alone, each would be shed, and the batch fail, on an idle server. The door admits
    the batch as one request, and its prompts are not judged against each other."""
    server = saturable_server
    replica = {"replica": next(iter(_replicas(server))), "model": "tiny-s"}
    wait_until(lambda: server.metric("serving_engine_unfinished", **replica) == 0, 60, "idle")
    body = {"prompt": [f"Question {i}: yes or no?" for i in range(16)], "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(16))
    # Each prompt was a request of its own to the gateway, and each ended ok.
    rid = r.headers["x-request-id"]
    assert {server.logged(f"{rid}-{i}")["outcome"] for i in range(16)} == {"ok"}


def test_an_idle_replica_admits_its_first_request() -> None:
    # Right after start, three 4-token requests at once, one to each embedded model: the two
    # sent first are in flight on their neighbours of the device when the third comes. Its own
    # replica has nothing in flight, so it is let in; the profile's interference (0.68 per busy
    # neighbour) once made its answer look slower than the SLO, and it was shed (429).
    embedded = load_deployment(name="embedded")
    assert embedded.profile is not None
    live = DeadlineAdmission.from_deployment(embedded)
    busy = {"tiny-s": 1, "tiny-m": 1, "tiny-l": 0}
    first_two = ClusterView(
        tuple(
            ReplicaState(r.name, r.model, busy[r.model], not busy[r.model], 4 * busy[r.model])
            for r in embedded.replicas
        )
    )
    four_tokens = Request("r", 0.0, "hi", 4, "free-tier")
    assert live.check(four_tokens, first_two, now=0.0) == first_two
