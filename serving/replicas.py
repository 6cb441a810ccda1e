"""The deployment's replicas: one engine each, with the gateway's live count of running requests,
and a supervisor per replica that brings its engine back when it goes down."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

from config import Deployment, ReplicaConfig
from router.admission import OUTPUT_TOKENS_WITHOUT_MAX
from router.view import ClusterView, ReplicaState
from serving.engines.base import Engine
from serving.engines.engine_link import EngineLink, HostSlot, LinkedEngine

if TYPE_CHECKING:
    from serving.discovery import Discovery, Resolve
    from serving.shared_view import WorkerRows

log = logging.getLogger(__name__)


@dataclass
class Replica:
    config: ReplicaConfig
    engine: Engine
    running: int = 0
    """Requests the gateway dispatched here that have not finished, as the gateway sees them."""
    waiting: int = 0
    """Of those, the ones with no first token yet: in the engine's queue, or in prefill."""
    owed: int = 0
    """Output tokens still owed to those requests (`router.view.ReplicaState.owed`)."""
    restarts: int = 0
    """Times its engine came back after going down."""
    publish: Callable[[int, int, int], None] | None = None
    """Where its running, waiting and owed go for the other workers to read (`--workers`)."""

    def count(self, running: int = 0, waiting: int = 0, owed: int = 0) -> None:
        """Change the gateway's counts of its requests here."""
        self.running += running
        self.waiting += waiting
        self.owed += owed
        if self.publish is not None:
            self.publish(self.running, self.waiting, self.owed)

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


@dataclass(frozen=True)
class Backoff:
    """When to try to bring a down engine back: `first_s` after it went down, then twice as long
    after each failed try, at most `max_s`. The waits start again from `first_s` only once the
    engine has stayed up for `stable_s`, so one that dies as soon as it is back is retried ever
    less often instead of in a tight loop of engine starts."""

    first_s: float = 1.0
    max_s: float = 60.0
    stable_s: float = 120.0

    def delay(self, tries: int) -> float:
        """The wait before try number `tries` (from 0) since the engine was last stable."""
        return min(self.max_s, self.first_s * 2**tries)


PROBE_BACKOFF = Backoff(first_s=1.0, max_s=5.0)
"""How often a remote replica's server is asked whether it answers again."""


class Supervisor:
    """Keeps one replica's engine up, whatever its kind: it notices that the engine went down
    (`healthy()` turned false) and calls its `recover()` with backoff until that succeeds. A
    vLLM engine recovers by replacing its dead processes, a remote one when its server answers.

    While down, the replica is out of the router's view (`ReplicaSet.view` asks `healthy()`), and
    it rejoins as soon as `recover()` returns. Requests it held when it died are not retried here:
    they end as engine errors in the gateway.
    """

    def __init__(
        self,
        replica: Replica,
        backoff: Backoff = Backoff(),
        poll_s: float = 0.5,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica = replica
        self.backoff = backoff
        # vLLM marks a dead engine at once (its monitor thread waits on the process), but offers
        # no callback; polling a flag twice a second costs nothing and serves every engine kind.
        self.poll_s = poll_s
        self.sleep = sleep
        self.clock = clock

    async def run(self) -> None:
        """Supervise until cancelled."""
        name, engine = self.replica.name, self.replica.engine
        tries = 0
        up_since = self.clock()
        while True:
            while engine.healthy():
                if tries and self.clock() - up_since >= self.backoff.stable_s:
                    tries = 0
                await self.sleep(self.poll_s)
            down_at = self.clock()
            log.warning(
                "%s: engine down; trying to bring it back in %g s", name, self.backoff.delay(tries)
            )
            tries = await self._recover(tries)
            self.replica.restarts += 1
            up_since = self.clock()
            log.info("%s: engine back after %.1f s down", name, up_since - down_at)

    async def _recover(self, tries: int) -> int:
        """Try until the engine is back; returns the tries made since it was last stable."""
        said = ""
        while True:
            await self.sleep(self.backoff.delay(tries))
            tries += 1
            try:
                await self.replica.engine.recover()
                return tries
            except Exception as exc:  # noqa: BLE001 - any failure to start is tried again later
                problem = f"{type(exc).__name__}: {exc}"
                # Once per reason: a server away for a day would otherwise log every minute.
                if problem != said:
                    log.warning(
                        "%s: still down (%s); next try in %g s",
                        self.replica.name,
                        problem,
                        self.backoff.delay(tries),
                    )
                    said = problem


class ReplicaSet:
    def __init__(
        self,
        replicas: list[Replica],
        backoff: Backoff = Backoff(),
        discoveries: Sequence[Discovery] = (),
    ) -> None:
        self.replicas = replicas
        self.backoff = backoff
        self.discoveries = list(discoveries)
        """What finds the engine hosts behind DNS names, where the placement names any."""
        self._supervisors: list[asyncio.Task[None]] = []
        self._others: Callable[[int], tuple[int, int, int]] | None = None

    def share(self, rows: WorkerRows, worker: int) -> None:
        """Publish this worker's counts in its row of `rows`, and count the other workers'
        requests from theirs."""
        for index, replica in enumerate(self.replicas):
            replica.publish = partial(rows.publish, worker, index)
        self._others = partial(rows.others, worker)

    def totals(self, index: int) -> tuple[int, int]:
        """Replica `index`'s running and waiting requests over every worker."""
        replica = self.replicas[index]
        if self._others is None:
            return replica.running, replica.waiting
        running, waiting, _ = self._others(index)
        return replica.running + running, replica.waiting + waiting

    @classmethod
    def from_deployment(
        cls,
        deployment: Deployment,
        engine_host: str | None = None,
        link_token: str | None = None,
        resolve: Resolve | None = None,
    ) -> ReplicaSet:
        """The deployment's replicas, with engines of their kind. Those its placement puts on
        an engine host (`engine_host: HOST:PORT`) are reached over the engine link there, with
        `link_token`; those on the hosts behind a DNS name (`hosts: N`), on the links its
        discovery keeps (`serving.discovery`), resolving with `resolve` (None: the system's
        DNS). With `engine_host`, this server's own are reached over the link too, at
        that Unix socket (the engine host `python -m serving --workers N` starts)."""
        places: dict[tuple[str, int | None], HostSlot] = {}

        def linked(config: ReplicaConfig, address: str, token: str | None) -> Engine:
            key = (address, config.slot)
            if key not in places:
                link = EngineLink(address, token) if config.slot is None else None
                places[key] = HostSlot(link)
            return LinkedEngine(config, places[key])

        engines = {c.name: linked(c, c.engine_host, link_token)
                   for c in deployment.replicas if c.engine_host is not None}  # fmt: skip
        own = deployment.run_by(None).replicas
        if engine_host is not None:
            engines |= {c.name: linked(c, engine_host, None) for c in own}
        elif deployment.simulation is not None and own:
            from serving.engines.simulated import SimulatedCluster

            make = SimulatedCluster(replace(deployment, replicas=own)).engine
            engines |= {c.name: make(c) for c in own}
        else:
            engines |= {c.name: make_engine(c) for c in own}
        discoveries = []
        if deployment.discovered:
            from serving.discovery import Discovery, dns_resolver

            resolve = resolve or dns_resolver()
            discoveries = [
                Discovery(name, [places[(name, i)] for i in range(n)], link_token, resolve)
                for name, n in deployment.discovered.items()
            ]
        return cls([Replica(c, engines[c.name] if c.name in engines else make_engine(c))
                    for c in deployment.replicas], discoveries=discoveries)  # fmt: skip

    async def start(self) -> None:
        """Start every engine at once, then supervise each; any engine that fails to start
        stops the others and raises, since a deployment that never ran is a configuration
        error to report, not an outage to ride out. The engine hosts behind DNS names are
        looked up first, and then again on a period."""
        try:
            await asyncio.gather(*(d.refresh() for d in self.discoveries))
            await asyncio.gather(*(r.engine.start() for r in self.replicas))
        except BaseException:
            await self.close()
            raise
        self._supervisors = [
            asyncio.create_task(Supervisor(r, self._backoff(r)).run(), name=f"supervise {r.name}")
            for r in self.replicas
        ]
        self._supervisors += [
            asyncio.create_task(d.run(), name=f"discover {d.address}") for d in self.discoveries
        ]

    def _backoff(self, replica: Replica) -> Backoff:
        # Bringing a remote server or an engine host back is one connection, not an engine
        # start (the host restarts its own engines): try it often, so that one that answers
        # again rejoins within seconds.
        if replica.config.url is not None or isinstance(replica.engine, LinkedEngine):
            return PROBE_BACKOFF
        return self.backoff

    async def close(self) -> None:
        # Supervisors first, so that none brings back an engine being closed. One cancelled in
        # the middle of a restart stops the engine it was starting before it ends.
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        self._supervisors = []
        for discovery in self.discoveries:
            discovery.close()
        results = await asyncio.gather(
            *(r.engine.close() for r in self.replicas), return_exceptions=True
        )
        for replica, result in zip(self.replicas, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("%s: close failed: %r", replica.name, result)

    def links(self) -> set[EngineLink]:
        """The engine links its replicas' engine hosts are reached over, as of now."""
        engines = [r.engine for r in self.replicas if isinstance(r.engine, LinkedEngine)]
        return {link for engine in engines if (link := engine.link) is not None}

    def view(self, model: str | None = None, exclude: Collection[str] = ()) -> ClusterView:
        """The live state. With `model`, only that model's replicas count as available; replicas
        named in `exclude` never do."""
        return ClusterView(
            tuple(self._state(i, r, model, exclude) for i, r in enumerate(self.replicas))
        )

    def _state(
        self, index: int, r: Replica, model: str | None, exclude: Collection[str]
    ) -> ReplicaState:
        """One replica's state: the gateway's exact count of its own requests, plus the other
        workers' from their rows (exact as of their last change), plus those its server reports
        from other clients, where it reports and the report is fresh. The server's report counts
        the other workers' requests too, as of the report: of the two, the larger is taken."""
        available = r.engine.healthy() and model in (None, r.model) and r.name not in exclude
        running, owed = r.running, r.owed
        shared_running = shared_owed = 0
        # Not for a slot of hosts found through DNS: each worker fills its slots in the order it
        # saw the hosts, so another worker's row for this index may be another host's. Their
        # requests are in the engine host's report instead, one report old.
        if self._others is not None and r.config.slot is None:
            shared_running, _, shared_owed = self._others(index)
        load = r.engine.load()
        if load is None or load.stale:
            return ReplicaState(
                r.name, r.model, running + shared_running, available, owed + shared_owed
            )
        # Other clients' requests are taken to owe what this gateway's own do on average.
        each = r.owed // r.running if r.running else OUTPUT_TOKENS_WITHOUT_MAX
        unshared = max(0, load.others - shared_running)
        return ReplicaState(
            r.name,
            r.model,
            running + shared_running + unshared,
            available,
            owed + shared_owed + unshared * each,
            load.batch_cap,
        )

    def __getitem__(self, index: int) -> Replica:
        return self.replicas[index]

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    def __len__(self) -> int:
        return len(self.replicas)
