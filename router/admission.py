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
some of those are also expected to meet the SLO (the wait so far, the first token's and the
request's `max_tokens` at the step of the batch it would join, within the SLO's time per token),
only those are offered: under overload the first token in time is worth little if the answer as
a whole misses the SLO. Where none is, a request of the most urgent class still goes to one in
time, but one of a less urgent class is shed (`Shed.answer`): it would take engine time (and,
on a shared device, slow its neighbours) for an answer that misses the SLO anyway. Only if the
load is why, though: where no replica could meet the SLO even alone and idle, or where one in
time has nothing in flight, the request is let in as if the SLO were not checked.

Live, the profile may be optimistic (it was measured on a quieter machine, and leaves out the
front-end and the prefills of other requests). Two things are learned per replica, each as a
moving average of how far what happened was from what was expected at dispatch:
- every first token teaches the rule how late it came (`observe_first_token`), and so does every
  request that got none by its deadline (a miss: later than the time it waited, by at least a
  factor): a replica far slower than its profile gives no first tokens to learn from, only
  misses;
- every finished request teaches it the time per token it got against the step it joined
  (`observe_pace`), which scales the step times that the SLO is checked against.
Both fade back towards the profile while nothing is observed (`_forget`). The simulator is the
profile, so there both scales stay 1.

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
from router.view import ClusterView, ReplicaState
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
class Expected:
    """What admission control expected of a request when it was dispatched."""

    first_token_s: float
    """Seconds from dispatch to its first token, as the profile has it (before what was learned
    of the replica)."""
    step_s: float
    """Seconds per output token after that, as the profile has it: the step of the batch it
    joined."""


@dataclass(frozen=True)
class Shed:
    """Why a request was refused at the door."""

    estimate_s: float
    """The soonest first token any allowed replica was expected to give, from arrival; or, for
    `answer`, the soonest last token."""
    budget_s: float
    """How long the request's class may wait for it; for `answer`, what the SLO allows."""
    answer: bool = False
    """Its first token would have come in time, but no replica was expected to give the whole
    answer within the SLO (the less urgent classes only)."""

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

    def expect(self, request: Request, view: ClusterView, index: int) -> Expected | None:
        """What to expect of `request`, sent to replica `index` now (None: no estimate); what
        the `observe_*` methods later compare with what happened."""
        ...

    def observe_first_token(
        self, index: int, expected: Expected, after_s: float, missed: bool = False
    ) -> None:
        """A request sent to replica `index` got its first token `after_s` after dispatch; or,
        `missed`, had waited `after_s` without one when its deadline passed."""
        ...

    def observe_pace(self, index: int, expected: Expected, tpot_s: float) -> None:
        """A request sent to replica `index` finished at `tpot_s` seconds per output token."""
        ...


class AdmitAll:
    """No admission control: every request is dispatched, and waits out its deadline if need be."""

    def check(self, request: Request, view: ClusterView, now: float) -> ClusterView | Shed:
        return view

    def expect(self, request: Request, view: ClusterView, index: int) -> Expected | None:
        return None

    def observe_first_token(
        self, index: int, expected: Expected, after_s: float, missed: bool = False
    ) -> None:
        pass

    def observe_pace(self, index: int, expected: Expected, tpot_s: float) -> None:
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
        top = min(c.urgency for c in qos_classes.values())
        self.most_urgent = {name for name, c in qos_classes.items() if c.urgency == top}
        self.tpot_s = tpot_s
        self.scale = [1.0] * len(replicas)
        """Per replica: how late first tokens have come against the profile's estimate."""
        self.pace = [1.0] * len(replicas)
        """Per replica: how slow its time per token has been against the profile's steps."""
        self._forgotten_at: float | None = None
        self._seen_at = [-math.inf] * len(replicas)
        """Per replica: when it last taught something (`_seen`)."""

    @classmethod
    def from_deployment(cls, deployment: Deployment) -> DeadlineAdmission:
        profile = deployment.profile
        if profile is None and not deployment.remote:
            raise ValueError(
                f"deployment {deployment.name!r} names no latency profile, which shedding needs"
            )
        return cls(
            [(r.model, r.device or r.name) for r in deployment.replicas],
            profile.models if profile else dict.fromkeys(deployment.models, UNPROFILED),
            deployment.qos_classes,
            profile.interference if profile else 0.0,
            deployment.max_batch or DEFAULT_MAX_BATCH,
            deployment.admission.lower_class_share,
            deployment.slo.tpot_s,
        )

    def first_token_s(self, view: ClusterView, index: int, prompt_tokens: int) -> float:
        """When a request sent to replica `index` now is expected to see its first token."""
        return self._profiled_first_token_s(view, index, prompt_tokens) * self.scale[index]

    def step_s(self, view: ClusterView, index: int) -> float:
        """The step the request would join at replica `index`: its time per token there. Scaled
        by what finished requests taught (`pace`), not by what first tokens did: their lateness
        is mostly queueing, not slow steps."""
        return self._profiled_step_s(view, index) * self.pace[index]

    def _slots(self, replica: ReplicaState) -> int:
        """The replica's batch cap: what its server showed, else the deployment's."""
        return min(replica.batch_cap, self.max_batch) if replica.batch_cap else self.max_batch

    def _profiled_first_token_s(self, view: ClusterView, index: int, prompt_tokens: int) -> float:
        replica = view.replicas[index]
        steps, slots, ahead = self._steps[index], self._slots(replica), replica.running
        in_progress = steps[min(ahead, slots)] if ahead else 0.0
        waves = 0.0
        if ahead >= slots:
            owed = replica.owed / ahead
            waves = (ahead - slots + 1) * owed / slots
        own = (waves + 1) * steps[min(ahead + 1, slots)] + prompt_tokens * self._prefill[index]
        return (in_progress + own) * self._slowdown(view, index)

    def _profiled_step_s(self, view: ClusterView, index: int) -> float:
        replica = view.replicas[index]
        step = self._steps[index][min(replica.running + 1, self._slots(replica))]
        return step * self._slowdown(view, index)

    def _slowdown(self, view: ClusterView, index: int) -> float:
        busy = sum(1 for j in self._neighbours[index] if view.replicas[j].running)
        return 1.0 + self.interference * busy

    def check(self, request: Request, view: ClusterView, now: float) -> ClusterView | Shed:
        self._forget(now)
        budget = self.budget_s.get(request.qos_class)
        if budget is None or not any(r.available for r in view.replicas):
            return view  # unknown classes and unroutable requests are the gateway's to refuse
        prompt = request.prompt_tokens or DEFAULT_PROMPT_TOKENS
        waited = now - request.arrival
        left = budget - waited
        estimates = [
            self.first_token_s(view, i, prompt) if r.available else math.inf
            for i, r in enumerate(view.replicas)
        ]
        in_time = [e <= left for e in estimates]
        if not any(in_time):
            return Shed(min(estimates) + budget - left, budget)
        if self.tpot_s is not None:
            # The SLO's time runs from arrival to the last token: the wait so far and the wait
            # for the first token count against it as much as the pace after.
            n = assumed_output_tokens(request)
            answers = [
                waited + e + (n - 1) * self.step_s(view, i) if ok else math.inf
                for i, (e, ok) in enumerate(zip(estimates, in_time, strict=True))
            ]
            allowed = n * self.tpot_s
            meets = [a <= allowed for a in answers]
            if any(meets):
                return view.only(meets)
            # Shed for the SLO only what the load makes miss it: where no replica could meet it
            # even alone and idle (a model slower than the SLO, a long prompt), the request is
            # served as well as it can be, not refused at every hour of the day. Nor where a
            # replica in time has nothing in flight: what would make it miss is its neighbours'
            # interference, an estimate (0.68 per busy neighbour on the embedded profile) made
            # under load. Right after start, three 4-token requests to the three embedded models
            # at once had the last one shed on an idle server; served, it took 68 ms.
            idle = any(ok and view.replicas[i].running == 0 for i, ok in enumerate(in_time))
            if (
                request.qos_class not in self.most_urgent
                and not idle
                and any(
                    ok and self._alone_s(i, prompt, n) <= allowed for i, ok in enumerate(in_time)
                )
            ):
                return Shed(min(answers), allowed, answer=True)
        return view.only(in_time)

    def _alone_s(self, index: int, prompt_tokens: int, tokens: int) -> float:
        """From dispatch to the last of `tokens` at replica `index`, alone on its device."""
        step = self._steps[index][1] * self.pace[index]
        return prompt_tokens * self._prefill[index] + tokens * step

    def _forget(self, now: float) -> None:
        """Let what was learned of each replica fade towards the profile, with time constant
        FORGET_S, from FORGET_S after its last observation.

        Observations come only from the replicas requests are sent to, and a replica whose
        scales grew in a bad minute may be sent none after it, so that nothing would ever tell
        the rule it is fast again: it would serve no one for the rest of the server's life.
        Fading, it is offered requests again after a while, and what they find sets its scales
        anew. While requests come back from a replica (dozens a second under load), their
        moving average outweighs the fading by far."""
        if self._forgotten_at is not None and now > self._forgotten_at:
            for i, seen in enumerate(self._seen_at):
                since = max(self._forgotten_at, seen + FORGET_S)
                if now > since:
                    keep = math.exp(-(now - since) / FORGET_S)
                    self.scale[i] **= keep
                    self.pace[i] **= keep
        self._forgotten_at = now

    def expect(self, request: Request, view: ClusterView, index: int) -> Expected | None:
        prompt = request.prompt_tokens or DEFAULT_PROMPT_TOKENS
        return Expected(
            self._profiled_first_token_s(view, index, prompt), self._profiled_step_s(view, index)
        )

    def observe_first_token(
        self, index: int, expected: Expected, after_s: float, missed: bool = False
    ) -> None:
        if missed:
            # The first token would have come later still, by how much no one knows. Counted
            # as at least MISSED_RATIO times the estimate, a miss always raises the scale: taken
            # as `after_s`, misses would only bring the estimate up to the deadline and never
            # past it, and the most urgent class, whose budget is its deadline, would go on
            # being sent where it waits out its deadline.
            lower = MISSED_RATIO * expected.first_token_s * self.scale[index]
            after_s = max(after_s, lower)
        self._seen(index)
        self.scale[index] = _learned(
            self.scale[index], expected.first_token_s, after_s, CALIBRATION_WEIGHT
        )

    def observe_pace(self, index: int, expected: Expected, tpot_s: float) -> None:
        self._seen(index)
        self.pace[index] = _learned(self.pace[index], expected.step_s, tpot_s, PACE_WEIGHT)

    def _seen(self, index: int) -> None:
        """Replica `index` taught something now (as of the latest check): its lessons are kept
        for FORGET_S from here before they fade."""
        self._seen_at[index] = self._forgotten_at or 0.0


def _learned(scale: float, profiled: float, actual: float, weight: float) -> float:
    """`scale`, a moving average of log(actual / profiled), with one more observation.

    Against the profile's own estimate, not the scaled one a request was dispatched with: a
    replica holds dozens of requests, dispatched under one scale and finishing together, and
    corrections each made against the scale of its dispatch would all push the same way, far
    past the mark (seen live: scales swinging between 0.1 and 10 within seconds)."""
    if profiled <= 0 or actual <= 0:
        return scale
    ratio = min(max(actual / profiled, 1 / CALIBRATION_LIMIT), CALIBRATION_LIMIT)
    return math.exp((1 - weight) * math.log(scale) + weight * math.log(ratio))


UNPROFILED = ProfileModel(prefill_s_per_token=1e-4, step_s={1: 0.02})
"""Where remote servers' models have no profile, what admission control starts from: 20 ms a
step at any batch, 0.1 ms a prompt token (a 7B model on one GPU, roughly), which each replica's
scales then correct from its first tokens and paces, as they correct a profile. The queue ahead
of a request comes from the server's own report (`ReplicaState.batch_cap`, `running`)."""

CALIBRATION_WEIGHT = 0.05
"""The weight of one observation in a replica's moving average: about the last 20 count."""
PACE_WEIGHT = 0.2
"""The weight of one pace in a replica's moving average (about the last 5 count): a pace is the
mean of many gaps, so one says more than a first token, whose wait is mostly queueing."""
MISSED_RATIO = 2.0
"""A request that missed its deadline counts as having been at least this many times later than
its estimate."""
FORGET_S = 30.0
"""What was learned of a replica is kept for this long after its last observation, then fades
towards its profile with this time constant (in log terms): to a third in another 30 s. Faded
at once, a replica learned to be too slow for the SLO looked fit again within 5 s, and every
request sent there until its pace came back missed the SLO."""
CALIBRATION_LIMIT = 10.0
"""A scale, and any one ratio, stay within [1/10, 10]: a stalled or a cached request must not
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
