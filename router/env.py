"""The routing problem as a gymnasium environment, on the simulator.

One step is one request: the observation describes the cluster as the request arrives, the action
routes it, and the environment runs the simulator up to the next arrival.

Actions: by default the model tier (index into `deployment.models`), sent to that model's
least-loaded replica as in Chuppala (2024); with `action="replica"`, the replica itself.

Rewards arrive late: a request's reward (quality x class weight if it met the SLO, else 0) is
known only when its last token is out, many steps after it was routed. Two ways to credit it:

- `credit="finish"` (plain gymnasium semantics): each step returns the rewards of every request
  that finished since the previous step. The return is still the total reward the router is
  judged on, but an action's own outcome is mixed with those of the ~100 requests in flight.
- `credit="request"` (what `router.train` uses): each request's reward belongs to the step that
  routed it. The step returns it if the request already finished; otherwise `info["late_credit"]`
  carries (step index, reward) pairs when it does, and the trainer adds them to the stored
  transitions (`router.train.LateCredit`), which sit in a replay buffer of 200,000 for far longer
  than any request lives. At the end of an episode the requests in flight are run out and
  credited, so nothing is lost. The load an action puts on later requests still reaches it through
  the discounted value of the next state.

Admission control runs before the policy, as in the gateway: a request that the deployment's rule
(`router.admission`) sheds is never a step. It ends at once with outcome "shed" and reward 0, in
`finished` like every other request, and the policy sees the next request that is let in.

Where the deployment names a path mix, each request's client is on a path drawn from it, with a
generator of its own (`router.paths.ClientPaths`), so that the workload's arrivals and contents
are the same with paths as without. The request carries the path's estimate, as a live one
carries what the transport measured, and its answer is delivered over the path
(`router.paths.PathModel`): the SLO is met or missed at the client.

An episode is a fixed number of requests from one workload drawn at reset; it ends truncated,
never terminated, because the cluster runs on past it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from config import DEFAULT_MAX_MODEL_LEN, Deployment
from router.admission import Admission, Shed, admission_for
from router.features import Encoder, FeatureEncoder
from router.paths import ClientPaths, PathDraw
from router.route import Observer
from router.sim import DEFAULT_PROMPT_TOKENS, OK, SHED, Finished, Simulator
from router.view import ClusterView
from workloads import Request
from workloads.arrivals import ArrivalProcess, Poisson, SwitchingRate
from workloads.generate import WorkloadSpec, requests
from workloads.lengths import Lengths

WorkloadSampler = Callable[[np.random.Generator], WorkloadSpec]


@dataclass(frozen=True)
class RandomRates:
    """Training workloads, as in the thesis: each episode a Poisson rate drawn log-uniformly from
    `rates`, or (with probability `switching`) a rate that switches between levels in that range,
    so that the policy also sees load change under it. Tasks uniform; classes uniform over
    `classes`, so that every class the gateway may see has been seen in training. With
    `lengths`, each episode's request lengths are one of those distributions, drawn uniformly
    (`workloads.lengths`), fitted to a `context`-token model; without, the thesis's."""

    rates: tuple[float, float] = (0.25, 48.0)
    switching: float = 0.5
    classes: tuple[str, ...] = ("free-tier",)
    mean_level_s: float = 10.0
    lengths: tuple[Lengths, ...] = ()
    context: int = DEFAULT_MAX_MODEL_LEN

    def __call__(self, rng: np.random.Generator) -> WorkloadSpec:
        lo, hi = np.log(self.rates[0]), np.log(self.rates[1])
        arrivals: ArrivalProcess
        if rng.random() < self.switching:
            levels = tuple(sorted(float(np.exp(v)) for v in rng.uniform(lo, hi, size=4)))
            arrivals = SwitchingRate(levels=levels, mean_duration_s=self.mean_level_s)
        else:
            arrivals = Poisson(float(np.exp(rng.uniform(lo, hi))))
        classes = dict.fromkeys(self.classes, 1.0)
        if not self.lengths:
            return WorkloadSpec(arrivals=arrivals, classes=classes)
        lengths = self.lengths[int(rng.integers(len(self.lengths)))]
        return WorkloadSpec(
            arrivals=arrivals, classes=classes, lengths=lengths, context=self.context, text=False
        )


class RoutingEnv(gym.Env[np.ndarray, np.int64]):
    metadata = {"render_modes": []}

    def __init__(
        self,
        deployment: Deployment,
        workloads: WorkloadSampler | None = None,
        episode_requests: int = 1000,
        action: Literal["model", "replica"] = "model",
        simulator: Callable[[], Simulator] | None = None,
        credit: Literal["finish", "request"] = "finish",
        admission: Admission | None = None,
        encoder: Encoder | None = None,
        admission_rules: Sequence[Literal["deadline", "none"]] = (),
    ) -> None:
        """`workloads` draws each episode's workload (default: RandomRates over the deployment's
        classes); `simulator` builds a fresh simulator per episode (default: the deployment's);
        `admission` decides what is shed (default: the deployment's rule); `encoder` builds the
        observations (default: the deployment's layout); `admission_rules`, where given, one
        drawn per episode instead (a fresh rule each), so that a policy learns to route both
        with admission control and without."""
        self.deployment = deployment
        self.workloads = workloads or RandomRates(classes=tuple(deployment.qos_classes))
        self.episode_requests = episode_requests
        self.action_kind = action
        self.credit = credit
        self.steps = 0
        """Steps taken since the environment was made, across episodes."""
        self._routed_at: dict[str, int] = {}
        self._new_simulator = simulator or (lambda: Simulator.from_deployment(deployment))
        self.admission = admission or admission_for(deployment)
        self.admission_rules = tuple(admission_rules)
        self.encoder: Encoder = encoder or FeatureEncoder.for_deployment(deployment)
        self.models = deployment.models
        n_actions = len(self.models) if action == "model" else len(deployment.replicas)
        self.action_space = gym.spaces.Discrete(n_actions)
        self.observation_space = gym.spaces.Box(0.0, np.inf, (self.encoder.size,), np.float32)
        self.sim: Simulator | None = None
        self.request: Request | None = None
        self.obs: np.ndarray | None = None
        """The current request's observation."""
        self._admitted: ClusterView | None = None
        """The current request's view, as admission control let it in."""
        self.finished: list[Finished] = []
        """Every request finished this episode, for evaluation."""
        self.paths: ClientPaths | None = None
        """This episode's clients' paths, where the deployment names a mix."""
        self._draws: dict[str, PathDraw] = {}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """`options` may fix the episode: "workload" (a WorkloadSpec, instead of drawing one),
        "seed" (its draws), and "requests" or "duration" (its length; default episode_requests)."""
        super().reset(seed=seed, options=options)
        options = options or {}
        spec = options.get("workload") or self.workloads(self.np_random)
        workload_seed = int(options.get("seed", self.np_random.integers(2**31)))
        duration = options.get("duration")
        limit = options.get("requests", None if duration else self.episode_requests)
        self.sim = self._new_simulator()
        if self.admission_rules:
            rule = self.admission_rules[int(self.np_random.integers(len(self.admission_rules)))]
            self.admission = admission_for(self.deployment.with_admission(rule))
        self.observer = Observer(self.deployment, self.encoder, self.admission)
        self.finished = []
        self._routed_at = {}
        mix = self.deployment.paths
        self.paths = ClientPaths(mix, workload_seed) if mix is not None else None
        self._draws = {}
        # All of them up front, so that a fork (`fork`) goes on with the same ones.
        self.requests = list(requests(spec, workload_seed, duration, limit))
        self.next_request = 0
        obs = self._arrive()
        if obs is None:
            raise ValueError("the workload has no request that is let in")
        return obs, {}

    def step(self, action: np.int64 | int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        assert self.sim is not None and self.request is not None, "call reset() first"
        self.sim.submit(self.request, self.replica_for(int(action), self.view()))
        step = self.steps
        self._routed_at[self.request.request_id] = step
        self.steps += 1
        last, before = self.request, len(self.finished)
        obs = self._arrive()
        if obs is None:  # the episode's last observation: the cluster as the last request left it
            rate = self.observer.rate.value(self.sim.now)
            obs = self.observer.encode(self.sim.view(), last, rate)
            done = self.finished[before:] + (self.drain() if self.credit == "request" else [])
            return obs, *self._credit(done, step, truncated=True)
        return obs, *self._credit(self.finished[before:], step, truncated=False)

    def drain(self) -> list[Finished]:
        """After the last step: run the requests still in flight to the end (for evaluation)."""
        assert self.sim is not None
        done = self._delivered(self.sim.drain())
        self.finished += done
        return done

    def action_mask(self) -> np.ndarray:
        """The actions the current request may take: those its layout allows (the per-action
        layout's, `router.action_features`), else those admission control allows (a model
        with a replica that may take it, or a replica that may)."""
        view = self.view()
        allowed = getattr(self.encoder, "allowed", None)
        if allowed is not None and self.obs is not None:
            return allowed(self.obs)
        if self.action_kind == "replica":
            return np.array([r.available for r in view.replicas])
        return np.array([view.least_loaded(m) is not None for m in self.models])

    def replica_for(self, action: int, view: ClusterView) -> int:
        return view.replica_for(action, None if self.action_kind == "replica" else self.models)

    def view(self) -> ClusterView:
        """The cluster as the current request may use it: admission control's view."""
        assert self.sim is not None
        return self._admitted if self._admitted is not None else self.sim.view()

    def fork(self) -> RoutingEnv:
        """This episode as it stands, to go on apart (`router.hindsight` tries what each
        action would lead to): its own simulator, rate estimate, output predictor and client
        paths; the requests to come are the same. Its `finished` starts empty, and steps it
        takes credit rewards as `credit` says; nothing of it reaches this one."""
        assert self.sim is not None
        env = copy.copy(self)
        env.sim = self.sim.fork()
        env.observer = self.observer.fork()
        env.paths = self.paths.fork() if self.paths is not None else None
        env._draws = dict(self._draws)
        env._routed_at = dict(self._routed_at)
        env.finished = []
        return env

    def _arrive(self) -> np.ndarray | None:
        """Move to the next request that is let in; its observation, or None at the end."""
        assert self.sim is not None
        while self.next_request < len(self.requests):
            request = self.requests[self.next_request]
            self.next_request += 1
            self.finished += self._delivered(self.sim.advance(request.arrival))
            if self.paths is not None:
                draw = self._draws[request.request_id] = self.paths.draw()
                request = replace(request, path=self.paths.estimates[draw.name])
            seen = self.observer.observe(request, self.sim.view())
            if not isinstance(seen, Shed):
                self.obs, self._admitted = seen
                self.request = request
                return self.obs
            self._draws.pop(request.request_id, None)
            self.finished.append(Finished.shed(request))
        return None

    def _delivered(self, done: list[Finished]) -> list[Finished]:
        """`done`, each answer delivered over its client's path where paths are modelled, and
        taught to the output predictor, as the gateway teaches it what it served."""
        self.observer.served(done)
        if self.paths is None:
            return done
        for f in done:
            draw = self._draws.pop(f.request.request_id)
            if f.outcome != OK or f.first_token is None:
                continue
            network = self.paths.sample(
                draw,
                f.request.prompt_tokens or DEFAULT_PROMPT_TOKENS,
                f.first_token - f.arrival,
                f.last_token - f.arrival,
                f.output_tokens,
            )
            f.delivered(network, self.deployment.slo)
        return done

    def _credit(
        self, done: list[Finished], step: int, truncated: bool
    ) -> tuple[float, bool, bool, dict[str, Any]]:
        """(reward, terminated, truncated, info) for step `step`, whose requests in `done` just
        finished."""
        reward = self.deployment.reward
        if self.credit == "finish":
            total = sum(
                reward(f.request.task, f.model, f.request.qos_class, f.slo_met) for f in done
            )
            return float(total), False, truncated, {}
        now, late = 0.0, []
        for f in done:
            if f.outcome == SHED:  # never routed: no step to credit
                continue
            value = reward(f.request.task, f.model, f.request.qos_class, f.slo_met)
            at = self._routed_at.pop(f.request.request_id)
            if at == step:
                now += value
            else:
                late.append((at, value))
        return now, False, truncated, {"late_credit": late}
