"""Admission control: refuse at once a request that no replica it may go to can start in time.

Under overload a request that is let in only to wait out its whole first-token deadline costs
twice: it holds an engine slot until the gateway gives up on it, and it makes every request
behind it later still. So before routing, the gateway (and the simulator, with the same code)
estimates for every replica the request may go to, smaller models included, when its first token
would come, from the replica's queue and the deployment's latency profile. If none is within the
request's budget, the request is shed: a 429 that costs the engines nothing.

The budget orders the classes: the most urgent class may wait its whole deadline, every other
class only `lower_class_share` (default a quarter) of the most urgent class's deadline (and never
past its own). Under overload the queues settle where the lower classes stop being let in, which
leaves the most urgent class the rest of its deadline as headroom. The engines help: a vLLM
engine that schedules by priority (`scheduling_policy: priority`) takes the more urgent class's
requests from its queue first.

A request that is let in goes only to a replica that is expected to make it: the check hands the
router the view with the others marked unavailable, so a policy that would send it to a replica
where it can only wait out its deadline sends it to one of the model's other replicas, or to the
least-loaded replica that can make it (the gateway's fallback for any unavailable choice). Where
some of those are also expected to keep pace with the SLO (a step at the batch the request would
join, within the SLO's time per token), only those are offered: under overload the first token
in time is worth little if every later one misses the SLO.

Live, the profile may be optimistic (it was measured on a quieter machine, and leaves out the
front-end and the prefills of other requests): every first token teaches the rule how late it
came against the estimate at dispatch, and each replica's estimates are scaled by a moving
average of that ratio (`observe`). The simulator is the profile, so there the scale stays 1.

The estimate, for a replica with n requests in flight and a batch cap of B (vLLM's
`max_num_seqs`): the request first waits for the iteration in progress, one step at batch
min(n, B), if there is one. With a free slot (n < B) it is prefilled in the next iteration, so
its first token takes one more step at batch n + 1, plus its prefill. Otherwise it waits for
n - B + 1 requests to finish; a full batch finishes requests at B / T per step, where T is the
mean output still owed to the requests in flight (their `max_tokens`, less what they have had),
so that wait is (n - B + 1) T / B steps at batch B. Every term is scaled by the same-device
interference of the simulator: (1 + interference x busy neighbours). The prefills of other
requests admitted in the same iteration are left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from config import Deployment, QosClass
from config.schema import ProfileModel
from router.sim import DEFAULT_PROMPT_TOKENS, step_time
from router.view import ClusterView
from workloads import Request

DEFAULT_MAX_BATCH = 256
"""vLLM's default `max_num_seqs`, where the deployment sets none."""

OUTPUT_TOKENS_WITHOUT_MAX = 256
"""What a request that sets no max_tokens is assumed to be owed: it may run to the context, but
most end far sooner at their end-of-sequence token."""


def assumed_output_tokens(request: Request) -> int:
    """The output a request is counted as owed when it is dispatched."""
    return request.max_tokens if request.max_tokens is not None else OUTPUT_TOKENS_WITHOUT_MAX


@dataclass(frozen=True)
class Shed:
    """Why a request was refused at the door."""

    estimate_s: float
    """The soonest first token any allowed replica was expected to give, from arrival."""
    budget_s: float
    """How long the request's class may wait for it."""

    @property
    def retry_after_s(self) -> int:
        """Whole seconds until the queue should have drained to the budget; at least 1."""
        return max(1, math.ceil(self.estimate_s - self.budget_s))


class Admission(Protocol):
    def check(self, request: Request, view: ClusterView, now: float) -> ClusterView | Shed:
        """A Shed to refuse `request`; else the view to route it on, which marks as available
        only replicas it may go to. `view` marks those it may go to now; `now` is on the clock
        of `request.arrival`."""
        ...

    def expect(self, request: Request, view: ClusterView, index: int) -> float | None:
        """Seconds until the first token of `request`, sent to replica `index` now (None: no
        estimate); what `observe` later compares with what happened."""
        ...

    def observe(self, index: int, expected_s: float, actual_s: float) -> None:
        """A first token came `actual_s` after dispatch to replica `index`, against `expected_s`."""
        ...


class AdmitAll:
    """No admission control: every request is dispatched, and waits out its deadline if need be."""

    def check(self, request: Request, view: ClusterView, now: float) -> ClusterView | Shed:
        return view

    def expect(self, request: Request, view: ClusterView, index: int) -> float | None:
        return None

    def observe(self, index: int, expected_s: float, actual_s: float) -> None:
        pass


class DeadlineAdmission:
    """Sheds a request when no replica it may go to is expected to give its first token within
    its class's budget (see the module's docstring)."""

    def __init__(
        self,
        replicas: Sequence[tuple[str, str]],
        profiles: dict[str, ProfileModel],
        qos_classes: dict[str, QosClass],
        interference: float = 0.0,
        max_batch: int = DEFAULT_MAX_BATCH,
        lower_class_share: float = 0.25,
        tpot_s: float | None = None,
    ) -> None:
        """`replicas`: (model, device) each, in the order of the views to check; `tpot_s`: the
        SLO's time per output token (None: the pace is not checked)."""
        missing = sorted({m for m, _ in replicas} - set(profiles))
        if missing:
            raise ValueError(f"no latency profile for model(s): {', '.join(missing)}")
        self.max_batch = max_batch
        self.interference = interference
        steps = {m: [step_time(p, b) for b in range(max_batch + 1)] for m, p in profiles.items()}
        self._steps = [steps[m] for m, _ in replicas]
        self._prefill = [profiles[m].prefill_s_per_token for m, _ in replicas]
        self._neighbours = [
            [j for j, (_, other) in enumerate(replicas) if other == device and j != i]
            for i, (_, device) in enumerate(replicas)
        ]
        self.budget_s = class_budgets(qos_classes, lower_class_share)
        self.tpot_s = tpot_s
        self.scale = [1.0] * len(replicas)
        """Per replica: how late first tokens have come against the profile's estimate."""

    @classmethod
    def from_deployment(cls, deployment: Deployment) -> DeadlineAdmission:
        if deployment.profile is None:
            raise ValueError(
                f"deployment {deployment.name!r} names no latency profile, which shedding needs"
            )
        return cls(
            [(r.model, r.device or r.name) for r in deployment.replicas],
            deployment.profile.models,
            deployment.qos_classes,
            deployment.profile.interference,
            deployment.max_batch or DEFAULT_MAX_BATCH,
            deployment.admission.lower_class_share,
            deployment.slo.tpot_s,
        )

    def first_token_s(self, view: ClusterView, index: int, prompt_tokens: int) -> float:
        """When a request sent to replica `index` now is expected to see its first token."""
        replica = view.replicas[index]
        steps, slots, ahead = self._steps[index], self.max_batch, replica.running
        in_progress = steps[min(ahead, slots)] if ahead else 0.0
        waves = 0.0
        if ahead >= slots:
            owed = replica.owed / ahead
            waves = (ahead - slots + 1) * owed / slots
        own = (waves + 1) * steps[min(ahead + 1, slots)] + prompt_tokens * self._prefill[index]
        return (in_progress + own) * self._slowdown(view, index) * self.scale[index]

    def step_s(self, view: ClusterView, index: int) -> float:
        """The step the request would join at replica `index`: its time per token there. Not
        scaled by what first tokens taught: their lateness is mostly queueing, not slow steps."""
        steps, ahead = self._steps[index], view.replicas[index].running
        return steps[min(ahead + 1, self.max_batch)] * self._slowdown(view, index)

    def _slowdown(self, view: ClusterView, index: int) -> float:
        busy = sum(1 for j in self._neighbours[index] if view.replicas[j].running)
        return 1.0 + self.interference * busy

    def check(self, request: Request, view: ClusterView, now: float) -> ClusterView | Shed:
        budget = self.budget_s.get(request.qos_class)
        if budget is None or not any(r.available for r in view.replicas):
            return view  # unknown classes and unroutable requests are the gateway's to refuse
        prompt = request.prompt_tokens or DEFAULT_PROMPT_TOKENS
        left = budget - (now - request.arrival)
        estimates = [
            self.first_token_s(view, i, prompt) if r.available else math.inf
            for i, r in enumerate(view.replicas)
        ]
        in_time = [e <= left for e in estimates]
        if not any(in_time):
            return Shed(min(estimates) + budget - left, budget)
        if self.tpot_s is not None:
            paced = [ok and self.step_s(view, i) <= self.tpot_s for i, ok in enumerate(in_time)]
            if any(paced):
                return view.only(paced)
        return view.only(in_time)

    def expect(self, request: Request, view: ClusterView, index: int) -> float | None:
        return self.first_token_s(view, index, request.prompt_tokens or DEFAULT_PROMPT_TOKENS)

    def observe(self, index: int, expected_s: float, actual_s: float) -> None:
        if expected_s <= 0 or actual_s <= 0:
            return
        # A moving average of log(actual / expected), so that early and late count alike; the
        # scale that produced `expected_s` is in it, so the scale settles where they agree.
        ratio = min(max(actual_s / expected_s, 1 / CALIBRATION_LIMIT), CALIBRATION_LIMIT)
        scale = self.scale[index] * ratio**CALIBRATION_WEIGHT
        self.scale[index] = min(max(scale, 1 / CALIBRATION_LIMIT), CALIBRATION_LIMIT)


CALIBRATION_WEIGHT = 0.05
"""How much one first token moves a replica's scale (in log terms): about the last 20 count."""
CALIBRATION_LIMIT = 10.0
"""The scale, and any one ratio, stay within [1/10, 10]: a stalled or a cached request must not
swing it far."""


def class_budgets(qos_classes: dict[str, QosClass], lower_class_share: float) -> dict[str, float]:
    """How long each class may be expected to wait for its first token and still be let in."""
    top = min(c.urgency for c in qos_classes.values())
    urgent = min(c.deadline_s for c in qos_classes.values() if c.urgency == top)
    return {
        name: c.deadline_s if c.urgency == top else min(c.deadline_s, lower_class_share * urgent)
        for name, c in qos_classes.items()
    }


def admission_for(deployment: Deployment) -> Admission:
    """The deployment's rule: `admission.rule` in models.yaml."""
    if deployment.admission.rule == "none":
        return AdmitAll()
    return DeadlineAdmission.from_deployment(deployment)
