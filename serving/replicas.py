"""The deployment's replicas: one engine each, with the gateway's live count of running requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from config import Deployment, ReplicaConfig
from router.view import ClusterView, ReplicaState
from serving.engines.base import Engine

log = logging.getLogger(__name__)


@dataclass
class Replica:
    config: ReplicaConfig
    engine: Engine
    running: int = 0
    """Requests the gateway dispatched here that have not finished, as the gateway sees them."""

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def model(self) -> str:
        return self.config.model


def make_engine(config: ReplicaConfig) -> Engine:
    # Imported per kind, so a remote-only deployment never imports vLLM.
    if config.url is not None:
        from serving.engines.remote import RemoteEngine

        return RemoteEngine(config)
    from serving.engines.vllm_engine import VllmEngine

    return VllmEngine(config)


class ReplicaSet:
    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas

    @classmethod
    def from_deployment(cls, deployment: Deployment) -> ReplicaSet:
        return cls([Replica(c, make_engine(c)) for c in deployment.replicas])

    async def start(self) -> None:
        """Start every engine at once; any that fails to start stops the others and raises."""
        try:
            await asyncio.gather(*(r.engine.start() for r in self.replicas))
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        results = await asyncio.gather(
            *(r.engine.close() for r in self.replicas), return_exceptions=True
        )
        for replica, result in zip(self.replicas, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("%s: close failed: %r", replica.name, result)

    def view(self, model: str | None = None, exclude: Collection[str] = ()) -> ClusterView:
        """The live state. With `model`, only that model's replicas count as available; replicas
        named in `exclude` never do."""
        return ClusterView(
            tuple(
                ReplicaState(
                    name=r.name,
                    model=r.model,
                    running=r.running,
                    available=r.engine.healthy()
                    and model in (None, r.model)
                    and r.name not in exclude,
                )
                for r in self.replicas
            )
        )

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)
