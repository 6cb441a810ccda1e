"""What choosing each model would mean for a request: a row of features per action, and the
actions a router may take.

The flat layout (`router.features.FeatureEncoder`) gives a network every replica's load, the
task and the request's lengths, and leaves it to learn, from them, which replica is loaded, how
slow it is, and what that means for this request's SLO. This layout computes that per action
(each model, sent to its least-loaded replica the view allows), from the deployment's latency
profile, as admission control estimates it (`router.admission`): one network, applied to each
row alike (`router.dqn`, `router.policies.DqnPolicy`), learns once what a row is worth,
whatever model it stands for.

A row, for model m, its least-loaded allowed replica i with b requests running, k of the other
replicas on i's device busy (each slows an iteration by the profile's interference), and n the
request's expected output tokens (`router.features.OutputPredictor`):
- the reward it would earn if it met its SLO: m's quality on its task (the table's mean for
  an unknown task) times its class's weight; and that less the best of the models worth less
  (of those with a replica the view allows): what m's capacity adds for this request, which the
  router weighs against the next request's (on the workload of Chuppala (2024) at 8-32 req/s, the
  router before it learned to keep OPT-6.7B for HellaSwag, where it adds the most);
- b / 32, the mean load of m's allowed replicas / 32, and k over the device's other replicas;
- the first token's expected wait over the class's first-token deadline: the step in progress
  at batch b, one at b + 1 and the prompt's prefill, slowed by the busy neighbours (admission
  control's estimate, without the queue it leaves out below a full batch), plus what the
  client's network is expected to take (`router.paths.spent`) where paths are known;
- the step it would join over the SLO's time per token;
- the whole answer's expected time over the SLO's n x tpot (network included);
- 1 if the router may take the action (`allowed`), else 0;
- m, one-hot;
and, the same in every row: the arrival rate / 48, the prompt, max_tokens (the deployment's
default where it sets none) and n in units of 512 tokens (each capped at 4), the class one-hot,
and, where the client's path is known, its RTT and loss (as the flat layout scales them).
Ratios are capped at 4. A model with no replica the view allows has zeros where its replica
would be; it is masked.

The actions a router may take (`allowed`, read from the rows): the models with a replica the
view allows whose first token and whole answer are expected in time (both ratios at most 1).
Where none is, the one whose least-loaded allowed replica is the least loaded of all: under
overload every model is expected late, and a request that is let in is sent where the queue is
shortest, as the threshold policy's fallback does (without it, a router trained to choose among
the models in time sent overloads after the best quality, and collapsed: 0.30 where the fallback
holds 0.57).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from config import Deployment
from router.admission import assumed_output_tokens
from router.features import LOSS_SCALE, PATH_CAP, RTT_SCALE_S, TOKEN_CAP, TOKEN_SCALE
from router.paths import Budget, budget, spent
from router.sim import DEFAULT_PROMPT_TOKENS, max_output_tokens, step_time
from router.view import ClusterView
from workloads import Request

BATCH_SCALE = 32.0
RATE_SCALE = 48.0
RATIO_CAP = 4.0
IN_TIME = 1.0
"""A model is in time where both its expected ratios are at most this."""
ALLOWED = 8
"""Where a row says whether the router may take its action."""
NO_DEADLINE_S = 7.0
"""Where a class has no first-token deadline, its first token is weighed against this (the
longest class's of models.yaml)."""


class ActionFeatures:
    """The per-action layout of one deployment (see the module)."""

    def __init__(
        self,
        deployment: Deployment,
        paths: bool | None = None,
        classes: Sequence[str] | None = None,
        in_time: float = IN_TIME,
        loads: bool = False,
    ) -> None:
        """`paths`: add the client's path (default: where the deployment's clients come over a
        path mix); `classes`: the QoS classes the one-hot names (default: the deployment's; a
        policy gives those it was trained on, and a class added later reads as none of
        them); `in_time`: the ratio at most which a model counts as in time."""
        profile = deployment.profile
        self.in_time = in_time
        self.loads = loads
        """Whether every row also reads every replica's load and the task (the flat layout's)."""
        if profile is None:
            raise ValueError(f"deployment {deployment.name!r} names no latency profile")
        self.models = list(deployment.models)
        self.replicas = [r.name for r in deployment.replicas]
        self.classes = list(deployment.qos_classes if classes is None else classes)
        self.tasks = list(deployment.tasks)
        weights = {n: c.reward_weight for n, c in deployment.qos_classes.items()}
        self._value = {
            (task, cls): [row[m] * w for m in self.models]
            for task, row in deployment.quality.items()
            for cls, w in weights.items()
        }
        rows = deployment.quality.values()
        mean = [float(np.mean([row[m] for row in rows])) for m in self.models]
        self._default_value = {cls: [q * w for q in mean] for cls, w in weights.items()}
        self._first_token_deadline = {n: c.deadline_s for n, c in deployment.qos_classes.items()}
        self._deadline = {
            n: c.deadline_s if math.isfinite(c.deadline_s) else NO_DEADLINE_S
            for n, c in deployment.qos_classes.items()
        }
        batch = deployment.max_batch or 256
        self._cap = batch
        models = [r.model for r in deployment.replicas]
        devices = [r.device or r.name for r in deployment.replicas]
        tables = {m: [step_time(profile.models[m], b) for b in range(batch + 1)] for m in models}
        self._steps = [tables[m] for m in models]
        self._prefill = [profile.models[m].prefill_s_per_token for m in models]
        self._neighbours = [
            [j for j, other in enumerate(devices) if other == d and j != i]
            for i, d in enumerate(devices)
        ]
        self._interference = profile.interference
        self.tpot_s = deployment.slo.tpot_s
        self.context = deployment.max_model_len
        self.paths = deployment.paths is not None if paths is None else paths
        self._action_of = [self.models.index(m) for m in models]
        self._one_hot = [[1.0 if b == a else 0.0 for b in range(len(self.models))]
                         for a in range(len(self.models))]  # fmt: skip
        self._absent = [0.0] * (ALLOWED + 1)
        self.shared_at = ALLOWED + 1 + len(self.models)
        extra = len(deployment.replicas) + len(self.tasks) if loads else 0
        self.row = self.shared_at + 4 + len(self.classes) + extra + (2 if self.paths else 0)
        """Features in each row."""
        self.size = self.row * len(self.models)

    reads_lengths = True
    """It reads the request's expected output (the gateway runs its predictor)."""

    def encode(
        self,
        view: ClusterView,
        request: Request,
        rate: float,
        elapsed_s: float = 0.0,
        expected: float | None = None,
    ) -> np.ndarray:
        """One row per model, flattened. `elapsed_s`: since the request arrived at the server;
        `expected`: its output tokens as the predictor has them (None: its max_tokens, or
        their default)."""
        # The hot path of every decision: written for the interpreter, one pass over the
        # replicas and plain lists, one array at the end.
        replicas = view.replicas
        least: list[int | None] = [None] * len(self.models)
        load = [0] * len(self.models)
        count = [0] * len(self.models)
        shortest: int | None = None
        action_of = self._action_of
        for i, r in enumerate(replicas):
            if not r.available:
                continue
            a = action_of[i]
            load[a] += r.running
            count[a] += 1
            j = least[a]
            if j is None or r.running < replicas[j].running:
                least[a] = i
            if shortest is None or r.running < replicas[shortest].running:
                shortest = i
        prompt = request.prompt_tokens or DEFAULT_PROMPT_TOKENS
        most = max_output_tokens(request, self.context)
        n = float(most if expected is None else max(1.0, expected))
        cls = request.qos_class
        deadline = self._deadline.get(cls, NO_DEADLINE_S)
        values = self._value.get((request.task or "", cls))
        if values is None:
            values = self._default_value.get(cls, self._default_value[self.classes[0]])
        first_net = answer_net = elapsed_s
        if self.paths and request.path is not None:
            first_net, answer_net = spent(request.path, prompt, int(n), self.tpot_s, elapsed_s)
        shared = [rate / RATE_SCALE, min(TOKEN_CAP, prompt / TOKEN_SCALE),
                  min(TOKEN_CAP, most / TOKEN_SCALE), min(TOKEN_CAP, n / TOKEN_SCALE)]  # fmt: skip
        shared += [1.0 if c == cls else 0.0 for c in self.classes]
        if self.loads:
            shared += [r.running / BATCH_SCALE for r in replicas]
            shared += [1.0 if task == request.task else 0.0 for task in self.tasks]
        if self.paths:
            path = request.path
            rtt, loss = (path.rtt_s / RTT_SCALE_S, path.loss / LOSS_SCALE) if path else (0.0, 0.0)
            shared += [min(PATH_CAP, rtt), min(PATH_CAP, loss)]
        cap, tpot, interference, in_time = self._cap, self.tpot_s, self._interference, self.in_time
        offered = [values[a] for a, at in enumerate(least) if at is not None]
        out: list[float] = []
        rows_in_time = False
        for a, at in enumerate(least):
            if at is None:
                out += self._absent
            else:
                value = values[a]
                cheaper = -math.inf
                for v in offered:
                    if cheaper < v < value:
                        cheaper = v
                gain = value - cheaper if cheaper > -math.inf else 0.0
                b = replicas[at].running
                neighbours = self._neighbours[at]
                busy = 0
                for j in neighbours:
                    if replicas[j].running:
                        busy += 1
                slow = 1.0 + interference * busy
                steps = self._steps[at]
                step = steps[b + 1 if b < cap else cap] * slow
                first = (steps[b if b < cap else cap] if b else 0.0) * slow + step
                first += prompt * self._prefill[at] * slow
                first_ratio = (first + first_net) / deadline
                answer = (first + (n - 1) * step + answer_net) / (n * tpot)
                ok = first_ratio <= in_time and answer <= in_time
                rows_in_time = rows_in_time or ok
                step_ratio = step / tpot
                out += (value, gain, b / BATCH_SCALE, load[a] / count[a] / BATCH_SCALE,
                        busy / len(neighbours) if neighbours else 0.0,
                        first_ratio if first_ratio < RATIO_CAP else RATIO_CAP,
                        step_ratio if step_ratio < RATIO_CAP else RATIO_CAP,
                        answer if answer < RATIO_CAP else RATIO_CAP,
                        1.0 if ok else 0.0)  # fmt: skip
            out += self._one_hot[a]
            out += shared
        if not rows_in_time and shortest is not None:
            out[action_of[shortest] * self.row + ALLOWED] = 1.0
        return np.array(out, dtype=np.float32)

    def budget(self, request: Request, elapsed_s: float = 0.0) -> Budget | None:
        """The request's remaining budget over its path (None: the layout reads no paths)."""
        if not self.paths:
            return None
        deadline = self._first_token_deadline.get(request.qos_class, math.inf)
        tokens = max(1, assumed_output_tokens(request))
        prompt = request.prompt_tokens or DEFAULT_PROMPT_TOKENS
        return budget(request.path, deadline, self.tpot_s, tokens, prompt, elapsed_s)

    def allowed(self, obs: np.ndarray) -> np.ndarray:
        """The actions a router may take for the request `obs` encodes (see the module)."""
        return obs[ALLOWED :: self.row] > 0

    def describe(self) -> dict[str, object]:
        """What a policy file records of the layout, to rebuild it on a deployment."""
        return {"layout": "per-action", "row": self.row, "paths": self.paths,
                "in_time": self.in_time, "loads": self.loads}  # fmt: skip
