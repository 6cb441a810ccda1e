"""The observation a policy sees, and the arrival-rate estimate inside it.

One encoder serves both the simulator and the live gateway, so a policy trained in simulation
sees exactly the same features when it routes live requests.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from config import DEFAULT_MAX_MODEL_LEN, Deployment
from router.admission import OUTPUT_TOKENS_WITHOUT_MAX, assumed_output_tokens
from router.paths import Budget, budget, spent
from router.sim import DEFAULT_PROMPT_TOKENS, max_output_tokens
from router.view import ClusterView
from workloads import Request

RTT_SCALE_S = 0.1
"""A path's RTT enters the observation in tenths of a second..."""
LOSS_SCALE = 0.1
"""...and its loss in tenths; both capped at `PATH_CAP`, so that no measurement, however wild,
takes the network far outside what it was trained on."""
PATH_CAP = 10.0

TOKEN_SCALE = 512.0
"""A request's lengths enter the observation in units of 512 tokens..."""
TOKEN_CAP = 4.0
"""...capped at 4 (2,048 tokens, OPT's whole context, which every shipped policy was trained
on): on a deployment of a longer context, every request longer than that reads alike."""


class Encoder(Protocol):
    """An observation layout: what the gateway and the simulator encode a request as."""

    @property
    def size(self) -> int: ...

    @property
    def reads_lengths(self) -> bool:
        """Whether `encode` wants the request's expected output (else it is not computed)."""
        ...

    def encode(
        self,
        view: ClusterView,
        request: Request,
        rate: float,
        elapsed_s: float = 0.0,
        expected: float | None = None,
    ) -> np.ndarray: ...

    def budget(self, request: Request, elapsed_s: float = 0.0) -> Budget | None:
        """The request's remaining budget over its path, where the layout reads paths."""
        ...


class ArrivalRateEstimator:
    """Requests per second, exponentially smoothed over `horizon_s`.

    Each arrival adds 1/horizon to a level that decays as exp(-dt/horizon), so a steady Poisson
    stream of rate r settles around r. It takes `now` and keeps no clock of its own.

    `observe` returns the estimate as the arrival found it, before counting it: read just after
    the jump, every arrival would see r + 1/horizon, a bias that is large at low rates.
    """

    def __init__(self, horizon_s: float = 10.0) -> None:
        self.horizon_s = horizon_s
        self._level = 0.0
        self._last: float | None = None

    def observe(self, now: float) -> float:
        """Count an arrival at `now`; return the rate it found."""
        before = self.level(now)
        self._level = before + 1.0 / self.horizon_s
        self._last = now
        return before

    def value(self, now: float) -> float:
        return self.level(now)

    def level(self, now: float) -> float:
        """The rate from the arrivals counted here, decayed to `now`."""
        if self._last is None:
            return 0.0
        return self._level * math.exp(-max(0.0, now - self._last) / self.horizon_s)


class OutputPredictor:
    """How long a request's answer will run, from what it asks (its task, class and max_tokens),
    learned from what the replicas served: per task, class and max_tokens (by its power of two,
    or none), a moving average of the output tokens served, never above what the request may
    get. Before a request of its kind has been served: its max_tokens, or, without one,
    OUTPUT_TOKENS_WITHOUT_MAX.

    The simulator's episodes and the gateway each keep one and teach it every request served
    whole (`observe`); the DQN sees its `predict` (`FeatureEncoder.encode`'s `expected`)."""

    def __init__(self, context: int = DEFAULT_MAX_MODEL_LEN, weight: float = 0.1) -> None:
        """`context`: the model's, all of which a request without max_tokens may take;
        `weight`: of one served request in its kind's average (about the last 10 count)."""
        self.context = context
        self.weight = weight
        self._mean: dict[tuple[str | None, str, int], float] = {}

    def fork(self) -> OutputPredictor:
        predictor = OutputPredictor(self.context, self.weight)
        predictor._mean = dict(self._mean)
        return predictor

    @staticmethod
    def _kind(request: Request) -> tuple[str | None, str, int]:
        asked = request.max_tokens
        return request.task, request.qos_class, 0 if asked is None else max(1, asked).bit_length()

    def predict(self, request: Request) -> float:
        most = max_output_tokens(request, self.context)
        mean = self._mean.get(self._kind(request))
        if mean is None:
            mean = OUTPUT_TOKENS_WITHOUT_MAX if request.max_tokens is None else most
        return min(mean, most)

    def observe(self, request: Request, tokens: int) -> None:
        """`request` was served whole: `tokens` output tokens."""
        kind = self._kind(request)
        mean = self._mean.get(kind)
        self._mean[kind] = tokens if mean is None else mean + self.weight * (tokens - mean)


class FeatureEncoder:
    """obs = [running requests per replica / batch_scale] + one-hot(task) + [rate / rate_scale]
    + one-hot(QoS class); for a layout that reads the request (`token_scale`), its lengths in
    units of `token_scale` tokens, each capped at TOKEN_CAP: [prompt tokens, max_tokens (the
    deployment's default where it sets none, `max_output_tokens`), expected output tokens
    (`OutputPredictor`)]; and, for a network-aware layout (`paths`), the request's path and
    what it takes of the request's budget: [RTT, loss, first-token budget taken, SLO budget
    taken]. An unknown or missing task encodes as all zeros.

    The budget taken (`router.paths.budget`) is a share: of the class's first-token deadline
    that the first token's expected delivery (and the time already spent) takes, and of the
    SLO's time for the whole answer that the request's way up and the last token's way down
    take; capped to [0, 2]. A perfect path encodes as zeros, and so does a request with no path
    known: knowing nothing costs nothing, and a network-aware network that starts from a blind
    one (`router.train --init-from`) sees, on such a path, what the blind one saw."""

    def __init__(
        self,
        replicas: list[str],
        tasks: list[str],
        qos_classes: list[str],
        batch_scale: float = 32.0,
        rate_scale: float = 48.0,
        paths: dict[str, float] | None = None,
        tpot_s: float = 0.04,
        token_scale: float | None = None,
        context: int = DEFAULT_MAX_MODEL_LEN,
    ) -> None:
        """`paths`: QoS class -> first-token deadline, for a network-aware layout (None: the
        network-blind one); `tpot_s`: the SLO's time per output token; `token_scale`: read the
        request's lengths, in these units (None: not, the layout of the policies before);
        `context`: the model's, for max_tokens' default."""
        self.replicas = list(replicas)
        self.tasks = {t: i for i, t in enumerate(tasks)}
        self.qos_classes = {c: i for i, c in enumerate(qos_classes)}
        self.batch_scale = batch_scale
        self.rate_scale = rate_scale
        self.deadlines = paths
        self.tpot_s = tpot_s
        self.token_scale = token_scale
        self.context = context
        self.size = len(self.replicas) + len(self.tasks) + 1 + len(self.qos_classes)
        self.lengths_at = self.size
        if token_scale is not None:
            self.size += 3
        self.path_at = self.size
        if paths is not None:
            self.size += 4

    @classmethod
    def for_deployment(cls, deployment: Deployment) -> FeatureEncoder:
        """The one layout for a deployment, built the same by the simulator and the gateway: it
        reads the request's lengths, and is network-aware where its clients come over a path
        mix."""
        deadlines = None
        if deployment.paths is not None:
            deadlines = {n: c.deadline_s for n, c in deployment.qos_classes.items()}
        return cls(
            [r.name for r in deployment.replicas],
            deployment.tasks,
            list(deployment.qos_classes),
            paths=deadlines,
            tpot_s=deployment.slo.tpot_s,
            token_scale=TOKEN_SCALE,
            context=deployment.max_model_len,
        )

    @property
    def reads_lengths(self) -> bool:
        """Whether `encode` wants the request's expected output (else it is not computed)."""
        return self.token_scale is not None

    def encode(
        self,
        view: ClusterView,
        request: Request,
        rate: float,
        elapsed_s: float = 0.0,
        expected: float | None = None,
    ) -> np.ndarray:
        """`elapsed_s`: since the request arrived at the server; `expected`: its output tokens,
        as `OutputPredictor.predict` has them (None: its max_tokens, or their default)."""
        obs = np.zeros(self.size, dtype=np.float32)
        n = len(self.replicas)
        for i, replica in enumerate(view.replicas):
            obs[i] = replica.running / self.batch_scale
        if request.task in self.tasks:
            obs[n + self.tasks[request.task]] = 1.0
        at = n + len(self.tasks)
        obs[at] = rate / self.rate_scale
        if request.qos_class in self.qos_classes:
            obs[at + 1 + self.qos_classes[request.qos_class]] = 1.0
        if self.token_scale is not None:
            prompt = request.prompt_tokens or DEFAULT_PROMPT_TOKENS
            most = max_output_tokens(request, self.context)
            scale, at = self.token_scale, self.lengths_at
            obs[at] = min(TOKEN_CAP, prompt / scale)
            obs[at + 1] = min(TOKEN_CAP, most / scale)
            obs[at + 2] = min(TOKEN_CAP, (most if expected is None else expected) / scale)
        if self.deadlines is not None:
            self._encode_path(obs, request, elapsed_s)
        return obs

    def budget(self, request: Request, elapsed_s: float = 0.0) -> Budget | None:
        """The request's remaining budget, `elapsed_s` after its arrival at the server, as the
        network-aware layout sees it (None: a network-blind layout computes none)."""
        if self.deadlines is None:
            return None
        deadline = self.deadlines.get(request.qos_class, math.inf)
        tokens = max(1, assumed_output_tokens(request))
        prompt = request.prompt_tokens or DEFAULT_PROMPT_TOKENS
        return budget(request.path, deadline, self.tpot_s, tokens, prompt, elapsed_s)

    def _encode_path(self, obs: np.ndarray, request: Request, elapsed_s: float) -> None:
        # The hot path of every network-aware decision (which may cost at most 10 us more than a
        # network-blind one at p99): the shares come straight from `router.paths.spent`, not
        # through a `Budget`, and what `_taken` and `assumed_output_tokens` do is written out.
        deadline = self.deadlines.get(request.qos_class, math.inf)  # type: ignore[union-attr]
        tokens = request.max_tokens
        tokens = OUTPUT_TOKENS_WITHOUT_MAX if tokens is None else max(1, tokens)
        path = request.path
        first, answer = spent(
            path, request.prompt_tokens or DEFAULT_PROMPT_TOKENS, tokens, self.tpot_s, elapsed_s
        )
        first, answer = first / deadline, answer / (self.tpot_s * tokens)
        rtt, loss = (path.rtt_s / RTT_SCALE_S, path.loss / LOSS_SCALE) if path else (0.0, 0.0)
        obs[self.path_at : self.path_at + 4] = (
            rtt if rtt < PATH_CAP else PATH_CAP,
            loss if loss < PATH_CAP else PATH_CAP,
            0.0 if first < 0 else 2.0 if first > 2 else first,
            0.0 if answer < 0 else 2.0 if answer > 2 else answer,
        )
