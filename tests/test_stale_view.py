"""Several routers over one simulated fleet (`router.stale`): each sees its own requests
exactly and the others' from its last snapshot; with no staleness the runs are the plain
simulator's, request for request."""

from __future__ import annotations

from config import load_deployment
from router.evaluate import mean_reward, simulate
from router.policies import make_policy
from router.sim import Simulator
from router.stale import StaleSimulator
from router.train import _validation_simulators, build_parser, make_env
from serving.launch import ROOT
from workloads import Message, Request
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec

DEPLOYMENT = load_deployment(ROOT / "models.yaml", "paper-4gpu")


def request(i: int) -> Request:
    return Request(f"r{i}", 0.0, (Message("user", "hi"),), 64, "free-tier")


def test_a_router_sees_its_own_requests_at_once_and_the_others_only_when_it_refreshes() -> None:
    sim = StaleSimulator.from_deployment(DEPLOYMENT, routers=2, interval_s=0.5, seed=3)
    assert isinstance(sim, StaleSimulator)
    mine = [0, 0]
    for i in range(20):  # all at time 0: no snapshot is due yet
        seen = sim.view().replicas[0].running
        router = sim._router
        assert seen == mine[router]  # its own, exactly; none of the other's
        sim.submit(request(i), 0)
        mine[router] += 1
    assert min(mine) > 0 and sim.replicas[0].batch.in_flight == 20
    sim.advance(0.5)  # every router has refreshed since; nothing has finished yet
    seen = sim.view().replicas[0].running
    assert seen == sim.replicas[0].batch.in_flight == 20  # own plus a fresh snapshot


def test_with_no_staleness_the_routers_route_as_one() -> None:
    spec = WorkloadSpec(arrivals=Poisson(48), classes={"free-tier": 0.9, "real-time": 0.1})

    def stale() -> Simulator:
        return StaleSimulator.from_deployment(DEPLOYMENT, routers=3, interval_s=0.0, seed=1)

    one = simulate(DEPLOYMENT, make_policy(DEPLOYMENT), spec, 7, duration=20)
    three = simulate(DEPLOYMENT, make_policy(DEPLOYMENT), spec, 7, duration=20, simulator=stale)
    assert [(f.request.request_id, f.replica) for f in one] == [
        (f.request.request_id, f.replica) for f in three
    ]
    assert mean_reward(DEPLOYMENT, one) == mean_reward(DEPLOYMENT, three)


def test_training_on_stale_views_draws_each_episodes_staleness() -> None:
    args = build_parser().parse_args(["--stale-ms", "10,250", "--routers", "3", "--seed", "1"])
    env = make_env(DEPLOYMENT, args)
    seen = set()
    for _ in range(16):
        env.reset()
        assert isinstance(env.sim, StaleSimulator) and env.sim.routers == 3
        seen.add(env.sim.interval_s)
    assert seen == {0.01, 0.25}
    # Validation sees the same stale simulators every time it runs, so checkpoints compare.
    validations = _validation_simulators(DEPLOYMENT, args)
    assert validations is not None
    first, again = validations(), validations()
    for _ in range(4):
        a, b = first(), again()
        assert isinstance(a, StaleSimulator) and isinstance(b, StaleSimulator)
        assert (a.interval_s, a._due) == (b.interval_s, b._due)
