"""The learned router: its environment, its training, the baselines, and live routing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from config import load_deployment
from router.action_features import ActionFeatures
from router.dqn import DoubleDqn, Hyperparameters
from router.env import RoutingEnv
from router.evaluate import mean_reward, simulate, tune_threshold
from router.policies import DqnPolicy, PrefixHash, RandomModel, Static
from router.sim import SHED, Finished
from router.train import Trainer, build_parser, make_env, train
from router.view import ClusterView, ReplicaState
from tests.support.servers import ROOT, Server, wait_until
from workloads import Message, Request
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec

PAPER = load_deployment(name="paper-4gpu")


@pytest.mark.parametrize(
    ("deployment", "action"), [("paper-4gpu", "model"), ("embedded", "replica")]
)
def test_env_passes_the_gymnasium_checker(deployment: str, action: str) -> None:
    env = RoutingEnv(load_deployment(name=deployment), episode_requests=50, action=action)  # type: ignore[arg-type]
    check_env(env, skip_render_check=True)
    n = 3 if action == "model" else len(env.deployment.replicas)
    assert env.action_space.n == n


def test_rewards_credit_every_finished_request_exactly_once() -> None:
    env = RoutingEnv(PAPER, action="model")
    spec = WorkloadSpec(arrivals=Poisson(8.0))
    env.reset(seed=3, options={"workload": spec, "seed": 3, "requests": 300})
    total, truncated, steps = 0.0, False, 0
    while not truncated:
        _, reward, terminated, truncated, _ = env.step(1)
        total += reward
        steps += 1
        assert not terminated
    assert steps == 300
    in_flight = len(env.finished)
    tail = sum(
        PAPER.reward(f.request.task, f.model, f.request.qos_class, f.slo_met) for f in env.drain()
    )
    assert len(env.finished) == 300 > in_flight
    every = sum(
        PAPER.reward(f.request.task, f.model, f.request.qos_class, f.slo_met) for f in env.finished
    )
    assert total + tail == pytest.approx(every)
    assert {f.model for f in env.finished} == {"opt-1.3b"}


def test_a_short_training_run_beats_random_routing(tmp_path: Path) -> None:
    flags = "--steps 12000 --learning-starts 2000 --seed 0 --no-progress --checkpoint-every 0 "
    flags += "--eval-every 0 --lengths seed"  # the lengths it is scored on: 12,000 steps learn one
    out = ["--out", str(tmp_path / "p.npz"), "--logdir", str(tmp_path / "log")]
    args = build_parser().parse_args(flags.split() + out)
    policy = train(args, PAPER)
    assert (tmp_path / "log" / "learning-curve.png").stat().st_size > 0
    loaded = DqnPolicy.load(tmp_path / "p.npz")
    loaded.check_fits(PAPER)
    loaded.bind(PAPER)
    assert loaded.meta["steps"] == 12000 and loaded.meta["hyperparameters"]["double_q"]
    obs = np.random.default_rng(0).random(loaded.encoder.size).astype(np.float32)
    np.testing.assert_allclose(loaded.q_values(obs), policy.q_values(obs), rtol=1e-6)

    def score(make: type | object) -> float:
        rewards = []
        for rate in (2.0, 8.0, 16.0):
            spec = WorkloadSpec(arrivals=Poisson(rate))
            done = simulate(PAPER, make(), spec, seed=11, duration=40)  # type: ignore[operator]
            rewards.append(mean_reward(PAPER, done))
        return float(np.mean(rewards))

    learned = score(lambda: loaded)
    random = score(lambda: RandomModel(PAPER.models, seed=0))
    assert learned > random + 0.02, (learned, random)


def test_a_policy_refuses_a_deployment_it_was_not_trained_for(tmp_path: Path) -> None:
    meta = {"action": "model", "models": ["a", "b"], "replicas": ["x"], "tasks": [],
            "qos_classes": []}  # fmt: skip
    DqnPolicy([(np.zeros((2, 1)), np.zeros(2))], meta).save(tmp_path / "p.npz")
    with pytest.raises(ValueError, match="trained with replicas"):
        DqnPolicy.load(tmp_path / "p.npz").check_fits(PAPER)
    (tmp_path / "bad.npz").write_text("not numpy")
    with pytest.raises(ValueError, match="not a trained router policy"):
        DqnPolicy.load(tmp_path / "bad.npz")


def test_threshold_tuning_picks_the_best_candidate_on_shared_episodes() -> None:
    result = tune_threshold(PAPER, episodes=2, episode_requests=200, grid=(1, 64))
    assert len(result.table) == 4  # two thresholds (6.7B, 1.3B), two values each
    assert result.reward == max(r for _, r in result.table)
    assert set(result.thresholds) == {"opt-6.7b", "opt-1.3b"}


def _view(*running: int) -> ClusterView:
    return ClusterView(tuple(ReplicaState(f"r{i}", "m", n, True) for i, n in enumerate(running)))


def _turn(first: str, n: int) -> Request:
    messages = [Message("user", first)] + [Message("user", f"turn {i}") for i in range(n)]
    return Request(f"q{n}", 0.0, tuple(messages), 8, "free-tier")


def test_prefix_hash_keeps_a_conversation_on_one_replica_within_the_load_bound() -> None:
    policy = PrefixHash([f"r{i}" for i in range(4)])
    obs = np.zeros(1, dtype=np.float32)
    conversation = "Summarise this document: " + "x" * 200
    home = policy.choose(obs, _turn(conversation, 0), _view(0, 0, 0, 0))
    # Later turns share the first message, so they go home while home is not overloaded...
    loads = [1, 1, 1, 1]
    assert policy.choose(obs, _turn(conversation, 3), _view(*loads)) == home
    # ...and move on once home would exceed 1.25 x the average load.
    loads[home] = 6
    moved = policy.choose(obs, _turn(conversation, 4), _view(*loads))
    assert moved != home
    homes = {policy.choose(obs, _turn(f"conversation {k} " * 10, 0), _view(0, 0, 0, 0))
             for k in range(40)}  # fmt: skip
    assert homes == {0, 1, 2, 3}


def test_static_and_random_baselines_route_by_model() -> None:
    spec = WorkloadSpec(arrivals=Poisson(32.0))
    done = simulate(PAPER, Static("opt-125m"), spec, seed=0, requests=100)
    assert len(done) == 100 and {f.model for f in done} == {"opt-125m"}
    # Least-loaded replica of the model: four GPUs' replicas all get work.
    assert len({f.replica for f in done}) == 4
    mixed = simulate(PAPER, RandomModel(PAPER.models, seed=1), spec, seed=0, requests=100)
    assert {f.model for f in mixed} == set(PAPER.models)


def test_late_credit_lands_on_the_transition_that_routed_each_request() -> None:
    args = build_parser().parse_args(["--lengths", "seed", "--episode-requests", "100"])
    env = make_env(PAPER, args)
    episodes: list[list[Finished]] = []
    reset = env.reset

    def keep(**kwargs):  # type: ignore[no-untyped-def]
        # The trainer resets the environment as an episode ends: keep what it finished.
        if env.sim is not None:
            episodes.append(list(env.finished))
        return reset(**kwargs)

    env.reset = keep  # type: ignore[method-assign]
    trainer = Trainer(env, replace(Hyperparameters(), buffer_size=250, learning_starts=10_000),
                      seed=0, total=600)  # fmt: skip
    trainer.run(600)
    # Episode e's request "r{i}" was routed at step 100 e + i; step k sits at k mod 250.
    expected = {}
    for e, finished in enumerate(episodes):
        for f in finished:
            k = 100 * e + int(f.request.request_id.removeprefix("r"))
            expected[k] = PAPER.reward(f.request.task, f.model, f.request.qos_class, f.slo_met)
    assert len(expected) == 600  # six whole episodes, every request credited
    for k in range(350, 600):  # the buffer's 250 newest, after it wrapped around
        assert trainer.buffer.reward[k % 250] == pytest.approx(expected[k], abs=1e-6), k
    assert sum(expected.values()) > 0
    assert [step for step, _ in trainer.curve] == [100, 200, 300, 400, 500, 600]


def test_a_masked_action_is_never_chosen_and_a_request_none_may_take_is_shed() -> None:
    """Admission control rules out every replica of OPT-6.7B: however much the network prefers
    it, the policy sends the request elsewhere, in training and routing alike; where it rules out
    every replica, the request is shed at the door and never reaches the policy."""
    deployment = PAPER.with_admission("deadline")
    policy = DqnPolicy.load(ROOT / "router/trained/paper-4gpu.npz")
    layers = [(w.copy(), b.copy()) for w, b in policy.layers]
    layers[-1][1][2] += 1e6  # OPT-6.7B's action, whatever the rest says
    masked = DqnPolicy(layers, policy.meta | {"masked": True})
    busy = ClusterView(tuple(
        ReplicaState(r.name, r.model, 0, r.model != "opt-6.7b") for r in deployment.replicas
    ))  # fmt: skip
    request = Request("r", 0.0, (Message("user", "?"),), 64, "free-tier", task="copa")
    obs = masked.encoder.encode(busy, request, 4.0)
    assert deployment.replicas[masked.choose(obs, request, busy)].model != "opt-6.7b"
    agent = DoubleDqn(obs.size, 3, Hyperparameters(), seed=0)
    mask = np.array([True, True, False])
    assert all(agent.act(obs, mask, epsilon=1.0) != 2 for _ in range(200))
    # The per-action layout's own masks: the models expected in time, else the least loaded.
    features = ActionFeatures(deployment)
    loaded = ClusterView(tuple(
        ReplicaState(r.name, r.model, 40 if r.model != "opt-125m" else 3, True)
        for r in deployment.replicas
    ))  # fmt: skip
    allowed = features.allowed(features.encode(loaded, request, 40.0))
    assert allowed.tolist() == [True, False, False]
    nowhere = ClusterView(tuple(r._replace(available=False) for r in busy.replicas))
    with pytest.raises(ValueError, match="no replica is available"):
        masked.choose(obs, request, nowhere)
    env = RoutingEnv(deployment, action="model")
    env.reset(seed=1, options={"workload": WorkloadSpec(arrivals=Poisson(500.0)), "seed": 1,
                               "requests": 400})  # fmt: skip
    while True:
        _, _, _, truncated, _ = env.step(int(np.flatnonzero(env.action_mask())[0]))
        if truncated:
            break
    env.drain()
    shed = [f for f in env.finished if f.outcome == SHED]
    assert shed and all(f.replica == -1 and f.model is None for f in shed)


def test_the_shipped_policy_routes_live_requests(twin_server: Server) -> None:
    """The embedded deployment names its trained policy; a request with model "auto" goes to the
    model that policy picks for the gateway's own observation: idle replicas, the request's task
    and class, and the rate estimate the gateway exposes. The test server's models.yaml has a
    class more than the policy was trained with, which must not stop it from loading. Served by
    the deployment's twin (embedded-sim): the same replicas, policy and gateway."""
    server = twin_server
    embedded = load_deployment(ROOT / "models.yaml", "embedded-sim")
    assert embedded.policy.name == "dqn"
    policy = DqnPolicy.load(embedded.policy.path or "")
    policy.check_fits(embedded)
    policy.bind(embedded)
    encoder = policy.encoder  # the gateway encodes with the layout the policy was trained on
    idle = ClusterView(tuple(ReplicaState(r.name, r.model, 0, True) for r in embedded.replicas))
    for task in embedded.tasks:
        wait_until(lambda: all(
            server.metric("serving_replica_in_flight", replica=r.name, model=r.model) == 0
            for r in embedded.replicas
        ), what="idle replicas")  # fmt: skip
        body = {"model": "auto", "task": task, "max_tokens": 2, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Which is heavier?"}]}  # fmt: skip
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        rate = server.metric("serving_router_arrival_rate")
        request = Request("x", 0.0, (Message("user", "?"),), 2, "free-tier", task=task)
        chosen = policy.choose(encoder.encode(idle, request, rate), request, idle)
        assert response.json()["model"] == embedded.replicas[chosen].model
