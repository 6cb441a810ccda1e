"""What a policy sees of the cluster: plain data, the same whether it comes from the live gateway
or from the simulator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class ReplicaState(NamedTuple):
    """A tuple, not a frozen dataclass: the gateway builds one per replica for every request it
    routes, and frozen dataclasses took 28 us for twelve replicas against 12 us for these, a
    large part of a routing decision's 50 us budget."""

    name: str
    model: str
    running: int
    """Requests dispatched here and not yet finished."""
    available: bool
    """Healthy, and allowed for this request (one that names a model allows only its replicas)."""
    owed: int = 0
    """Output tokens still owed to the requests in flight here: their max_tokens (or a guess,
    where a request sets none) less what they have had. Admission control's queue estimate."""
    batch_cap: int = 0
    """The most requests its engine runs at once, where its server showed it (a remote vLLM's
    requests waiting beside its running ones); 0: unknown."""


@dataclass(frozen=True)
class ClusterView:
    replicas: tuple[ReplicaState, ...]

    def least_loaded(self, model: str | None = None) -> int | None:
        """Index of the available replica (of `model`, if given) with the fewest running requests;
        ties go to the first listed. None if there is none."""
        best: int | None = None
        for i, r in enumerate(self.replicas):
            wanted = r.available and (model is None or r.model == model)
            if wanted and (best is None or r.running < self.replicas[best].running):
                best = i
        return best

    def replica_for(self, action: int, models: Sequence[str] | None = None) -> int:
        """The replica an action sends the request to, as the gateway picks it: the action is a
        replica, or with `models` an index into them. A replica that admission control ruled out
        is swapped for the least-loaded of its model that it did not, else for the least-loaded
        of any; a model goes to its least-loaded replica."""
        if models is None:
            if self.replicas[action].available:
                return action
            model = self.replicas[action].model
        else:
            model = models[action]
        index = self.least_loaded(model)
        if index is None:
            index = self.least_loaded()
        assert index is not None, "admission control lets in only what some replica can take"
        return index

    def only(self, allowed: Sequence[bool]) -> ClusterView:
        """This view with the replicas not `allowed` marked unavailable."""
        if all(allowed):
            return self
        return ClusterView(
            tuple(
                r._replace(available=r.available and ok)
                for r, ok in zip(self.replicas, allowed, strict=True)
            )
        )
