"""What the gateway does with a request before an engine sees it, in the gateway's order, for
the simulations: the arrival-rate estimate, admission control, the expected output and the
features (`Observer`, what the training environment shows its agent), then the policy
(`Router`, for the simulations that drive the simulator themselves: a closed loop, a
co-simulation)."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import numpy as np

from config import Deployment
from router.admission import Admission, Shed, admission_for
from router.features import ArrivalRateEstimator, Encoder, OutputPredictor
from router.policies import Policy, encoder_for
from router.sim import OK, Finished
from router.view import ClusterView
from workloads import Request


class Observer:
    """A request as the policy sees it, in the gateway's order: counted in the arrival rate,
    checked by admission control, then encoded with the output the predictor expects."""

    def __init__(
        self, deployment: Deployment, encoder: Encoder, admission: Admission | None = None
    ) -> None:
        """`admission`: default, the deployment's rule."""
        self.encoder = encoder
        self.admission = admission or admission_for(deployment)
        self.rate = ArrivalRateEstimator()
        self.predictor = OutputPredictor(deployment.max_model_len)

    def fork(self) -> Observer:
        """A copy that learns apart: its own rate estimate and output predictor (admission
        control is shared: in the simulator it learns nothing)."""
        observer = copy.copy(self)
        observer.rate = copy.copy(self.rate)
        observer.predictor = self.predictor.fork()
        return observer

    def observe(
        self, request: Request, view: ClusterView, now: float | None = None
    ) -> tuple[np.ndarray, ClusterView] | Shed:
        """`request`'s observation and the view it may be routed on; or why it is shed. `now`:
        when it reached the server (default: its `arrival`, the client's clock the server's)."""
        now = request.arrival if now is None else now
        # Shed requests count in the rate too: the gateway observes before it sheds.
        rate = self.rate.observe(now)
        admitted = self.admission.check(request, view, now)
        if isinstance(admitted, Shed):
            return admitted
        return self.encode(admitted, request, rate), admitted

    def encode(self, view: ClusterView, request: Request, rate: float) -> np.ndarray:
        expected = self.predictor.predict(request) if self.encoder.reads_lengths else None
        return self.encoder.encode(view, request, rate, expected=expected)

    def served(self, done: Iterable[Finished]) -> None:
        """Requests ended: those served whole teach the output predictor, as the gateway's."""
        for f in done:
            if f.outcome == OK:
                self.predictor.observe(f.request, f.output_tokens)


class Router(Observer):
    """An observer and the policy: a `router.closed_loop.Route`."""

    def __init__(
        self, deployment: Deployment, policy: Policy, admission: Admission | None = None
    ) -> None:
        super().__init__(deployment, encoder_for(policy, deployment), admission)
        self.policy = policy

    def __call__(self, request: Request, view: ClusterView, now: float | None = None) -> int | None:
        """The replica for `request`, or None: shed at the door."""
        seen = self.observe(request, view, now)
        if isinstance(seen, Shed):
            return None
        obs, admitted = seen
        return admitted.replica_for(self.policy.choose(obs, request, admitted))
