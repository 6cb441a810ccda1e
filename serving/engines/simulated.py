"""Simulated engines: replicas that keep a latency profile's time with no model behind them.

What llm-d's inference simulator is to llm-d: the deployment the router was trained for (seed
004's twelve OPT replicas on four GPUs) served live, through the real transport, gateway, router
and clock, on a machine without a GPU. Each replica runs continuous batching in real time with
the simulator's own rules (`router.sim.Batcher`, `router.sim.Devices`): the same step and
prefill times, batch cap and same-device interference, so the live twin and the simulator differ
only by what the live path adds. The gateway's deadline (504), its abort and admission control
are the real ones.

Iterations keep the virtual timeline: one that starts right after another starts at the end the
other was due, not when the event loop got round to it, so a late wake-up does not slow the
replica down; tokens go out when the loop runs.

The output is deterministic text, one word per token, drawn from the request's seed (or its id).
Prompts are counted by a real tokenizer, and a prompt too long for the context gets vLLM's 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from config import DEFAULT_MAX_MODEL_LEN, Deployment, ReplicaConfig
from config.deployment import Simulation
from config.schema import Faults
from router.admission import DEFAULT_MAX_BATCH
from router.kv_cache import KvCache, block_hashes
from router.sim import Batcher, Devices, Job
from serving.embedded import ensure_built
from serving.engines.base import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
)
from serving.engines.prompts import (
    PromptTokenizer,
    load_tokenizer,
    output_budget,
)
from workloads import Request

log = logging.getLogger(__name__)


_VOCABULARY = (
    "the a model of token time queue batch step answer light river stone cloud road small large "
    "quick slow early late north south green blue"
)
WORDS = tuple(f" {w}" for w in _VOCABULARY.split(" "))

MEAN_NATURAL_TOKENS = 128
"""Without ignore_eos a request ends at its end-of-sequence token after an exponentially
distributed number of tokens with this mean (a real model decides; this one draws); with
min_tokens, at that many (a real model would go on until its own end of sequence; a replay of
recorded answers sends their lengths as min_tokens, and gets them)."""


@dataclass
class _Stream:
    """One request's output, as the engine hands it to `generate`."""

    job: Job
    rng: random.Random
    stop_at: float
    """Tokens after which it ends at its end-of-sequence token (inf with ignore_eos)."""
    fail_at: float
    """Tokens after which it fails (inf unless faults inject errors)."""
    stops: tuple[str, ...]
    text: str = ""
    """Everything generated so far, for the stop strings."""
    sent: int = 0
    """Characters of `text` already handed out."""
    tokens: int = 0
    """Tokens not yet handed out."""
    finish: str | None = None
    error: EngineError | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class SimulatedCluster:
    """What a simulated deployment's engines share: the devices whose busy replicas slow each
    other, and the tokenizers."""

    def __init__(self, deployment: Deployment) -> None:
        if deployment.simulation is None or deployment.profile is None:
            raise ValueError(f"deployment {deployment.name!r} is not simulated")
        self.deployment = deployment
        self.simulation: Simulation = deployment.simulation
        self.devices = Devices(deployment.profile.interference)
        self.hash_block = deployment.hash_block
        self.started = time.monotonic()
        self._tokenizers: dict[str, Any] = {}
        self._loading = threading.Lock()

    def engine(self, config: ReplicaConfig) -> SimulatedEngine:
        return SimulatedEngine(config, self)

    def tokenizer(self, config: ReplicaConfig) -> Any:
        """The tokenizer that counts `config`'s prompts; loaded once per source (blocking)."""
        source, build = self.simulation.tokenizer_source, self.simulation.tokenizer_build
        if source is None:
            source, build = config.source, config.build
        with self._loading:
            if source not in self._tokenizers:
                if build is not None:
                    ensure_built(source, build)
                self._tokenizers[source] = load_tokenizer(source)
            return self._tokenizers[source]


class SimulatedEngine:
    """One replica of a simulated deployment; the `Engine` interface."""

    def __init__(self, config: ReplicaConfig, cluster: SimulatedCluster) -> None:
        profile = cluster.deployment.profile
        assert profile is not None  # SimulatedCluster checked
        self.config = config
        self.cluster = cluster
        self.max_model_len = config.engine_int("max_model_len", DEFAULT_MAX_MODEL_LEN)
        max_batch = config.engine_int("max_num_seqs", DEFAULT_MAX_BATCH)
        kv = None
        if config.kv_tokens:
            kv = KvCache(config.kv_tokens // config.block_size, config.block_size)
        self._batch = Batcher(
            profile.models[config.model],
            max_batch,
            kv=kv,
            max_batched_tokens=config.engine_args_int("max_num_batched_tokens"),
            hash_stride=config.block_size // cluster.hash_block,
        )
        self._device = config.device or config.name
        faults = cluster.simulation.faults
        mine = faults is not None and (faults.replicas is None or config.name in faults.replicas)
        self._faults: Faults | None = faults if mine else None
        self._fault_rng = random.Random(f"{faults.seed if faults else 0}:{config.name}")
        self._streams: dict[str, _Stream] = {}
        self._work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._death: asyncio.TimerHandle | None = None
        self._died = False
        self._prompts: PromptTokenizer | None = None

    async def start(self) -> None:
        if self._prompts is None:
            self._prompts = await asyncio.to_thread(
                lambda: PromptTokenizer(self.cluster.tokenizer(self.config), self.config)
            )
        self._loop_task = asyncio.create_task(self._run(), name=f"simulate {self.config.name}")
        if self._faults and self._faults.fail_after_s is not None and not self._died:
            due = self._faults.fail_after_s - (time.monotonic() - self.cluster.started)
            self._death = asyncio.get_running_loop().call_later(max(0.0, due), self._die)
        log.info("%s: simulated, %d slots", self.config.name, self._batch.max_batch)

    def publish_kv_events(self, hear: Callable[[str, list[int]], None]) -> None:
        """Tell `hear` every block its cache stores and removes, as vLLM publishes them
        (BlockStored, BlockRemoved) to a KV-aware router; nothing where it keeps no cache."""
        if self._batch.kv is not None:
            self._batch.kv.on_event = hear

    def healthy(self) -> bool:
        task = self._loop_task
        # A task cancelled by `_die` is down at once, not only when the cancellation lands.
        return task is not None and not task.done() and not task.cancelling()

    def unfinished(self) -> int:
        return self._batch.in_flight

    def load(self) -> None:
        return None  # in this process: the gateway counts every request it holds

    async def generate(self, request: Request, sampling: Sampling) -> AsyncIterator[TokenDelta]:
        if not self.healthy() or self._prompts is None:
            raise EngineUnavailable(f"{self.config.name}: not running")
        if sampling.logprobs is not None:
            raise InvalidRequest(
                f"{self.config.name} is a simulated replica: it has no model to give "
                "log-probabilities; pin a model served by vLLM.",
                param="logprobs",
            )
        echo = None
        blocks: tuple[int, ...] | None
        if request.blocks is not None and request.prompt_tokens is not None and not sampling.echo:
            # Counted by the gateway, with this deployment's tokenizer: not again here.
            prompt_tokens, blocks = request.prompt_tokens, request.blocks
        else:
            ids = await self._prompts.ids(request, self.max_model_len)
            prompt_tokens, blocks = len(ids), request.blocks
            if blocks is None and self._batch.kv is not None:
                blocks = block_hashes(ids, self.cluster.hash_block)
            echo = self._prompts.text(request, ids) if sampling.echo else None
        tokens = output_budget(request, prompt_tokens, self.max_model_len)
        stream = self._admit(
            replace(request, prompt_tokens=prompt_tokens, blocks=blocks), tokens, sampling
        )
        first = self._batch.kv is not None  # then the first delta says what was cached
        try:
            while True:
                await stream.ready.wait()
                stream.ready.clear()
                if stream.error is not None:
                    raise stream.error
                text, stream.sent = stream.text[stream.sent :], len(stream.text)
                delta = TokenDelta(
                    text, stream.tokens, prompt_tokens, stream.finish, prompt_text=echo,
                    cached_tokens=stream.job.cached_tokens if first else None,
                )  # fmt: skip
                stream.tokens, echo, first = 0, None, False
                yield delta
                if stream.finish is not None:
                    return
        finally:
            # Closed early (the client left, the deadline passed): the slot is freed, as vLLM's
            # abort does.
            self._drop(stream)

    def _admit(self, request: Request, tokens: int, sampling: Sampling) -> _Stream:
        if not self.healthy():  # it died while the prompt was tokenised
            raise EngineUnavailable(f"{self.config.name}: not running")
        if request.request_id in self._streams:
            raise EngineError(f"{self.config.name}: request id {request.request_id} is in use")
        rng = random.Random(sampling.seed if sampling.seed is not None else request.request_id)
        natural: float
        if sampling.ignore_eos:
            natural = math.inf
        elif sampling.min_tokens:  # the answer's recorded length: no model here to go on
            natural = sampling.min_tokens
        else:
            natural = 1 + int(rng.expovariate(1 / MEAN_NATURAL_TOKENS))
        fail = math.inf
        if self._faults and self._fault_rng.random() < self._faults.error_rate:
            fail = self._fault_rng.randint(0, tokens - 1)
        now = asyncio.get_running_loop().time()
        job = Job(request, now, math.inf, tokens, tokens)
        stream = _Stream(job, rng, natural, fail, sampling.stop)
        self._streams[request.request_id] = stream
        self._batch.add(job)
        self._work.set()
        return stream

    def _drop(self, stream: _Stream) -> None:
        """`stream` leaves the engine, however it ended; once (a finished stream is dropped as
        its last token comes, and again as its reader closes)."""
        if self._streams.get(stream.job.request.request_id) is not stream:
            return
        del self._streams[stream.job.request.request_id]
        job = stream.job
        if job in self._batch.running or job in self._batch.waiting:
            self._batch.remove(job)

    async def _run(self) -> None:
        """Iterations back to back while there is work, on the virtual timeline."""
        loop = asyncio.get_running_loop()
        due: float | None = None  # when the last iteration was due to end
        while True:
            cost = self._batch.begin()
            if cost is None:
                self._work.clear()
                await self._work.wait()
                due = None
                continue
            start = loop.time() if due is None else due
            # Who gets a token: a request whose prompt is still computed in chunks gets none.
            running = [(job, job.remaining) for job in self._batch.running]
            due = start + cost * self.cluster.devices.start(self._device)
            try:
                await asyncio.sleep(due - loop.time())
            finally:
                self.cluster.devices.stop(self._device)
            self._batch.end(due)
            for job, remaining in running:
                if job.remaining == remaining:
                    continue
                stream = self._streams.get(job.request.request_id)
                # The job's own stream: one aborted during the iteration frees its id, which
                # a new request (a client may choose its id) can take before the iteration ends.
                if stream is not None and stream.job is job:
                    self._token(stream)

    def _token(self, stream: _Stream) -> None:
        """`stream` got one token at the end of an iteration."""
        stream.ready.set()
        done = stream.job.tokens - stream.job.remaining
        if done > stream.fail_at:
            stream.error = EngineError(f"{self.config.name}: simulated failure")
            self._drop(stream)
            return
        stream.tokens += 1
        if done >= stream.stop_at:  # its end-of-sequence token, which has no text
            stream.finish = "stop"
        else:
            stream.text += stream.rng.choice(WORDS)
            if stream.stops and (cut := _stop(stream.text, stream.stops, stream.sent)) is not None:
                # What was sent cannot be taken back: a stop string that began in it ends the
                # text where it stands.
                stream.text, stream.finish = stream.text[: max(cut, stream.sent)], "stop"
            elif stream.job.remaining == 0:
                stream.finish = "length"
        if stream.finish is not None:
            self._drop(stream)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.error = EngineError(f"{self.config.name}: aborted")
            stream.ready.set()
            self._drop(stream)

    def _die(self) -> None:
        """Failure injection: the engine dies with what it holds."""
        log.warning("%s: simulated engine death", self.config.name)
        self._died = True
        self._fail_all(EngineError, "the engine died")
        if self._batch.kv is not None:  # its memory goes with it: a restart finds nothing cached
            self._batch.kv.clear()
        if self._loop_task is not None:
            self._loop_task.cancel()

    def _fail_all(self, kind: type[EngineError], why: str) -> None:
        for stream in list(self._streams.values()):
            # One exception each: raised by each stream's own task, a shared one would gather
            # every task's frames in its traceback.
            stream.error = kind(f"{self.config.name}: {why}")
            stream.ready.set()
            self._drop(stream)

    async def recover(self) -> None:
        await asyncio.sleep(self._faults.restart_s if self._faults else 0.0)
        await self.close()
        await self.start()

    async def close(self) -> None:
        if self._death is not None:
            self._death.cancel()
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(EngineUnavailable, "stopped")


def _stop(text: str, stops: tuple[str, ...], since: int) -> int | None:
    """Where `text` must end for the first stop string in it, as vLLM cuts it: before the stop
    string. Only what came after `since` (less a stop string's length) is searched."""
    start = max(0, since - max(len(s) for s in stops))
    found = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None
