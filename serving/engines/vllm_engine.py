"""An in-process vLLM engine (AsyncLLM) on one device: a GPU, or the CPU via vLLM's CPU build."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar

from config import ReplicaConfig
from serving.embedded import ensure_built
from serving.engines.base import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
    TokenLogprob,
)
from serving.engines.prompts import PromptTokenizer, output_budget
from serving.engines.warmup import WarmedPath, describe, paths, warm_up
from workloads import Request

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class _MemoryArgs(TypedDict, total=False):
    """The engine's share of its device, in vLLM's terms: one of the two, or neither."""

    kv_cache_memory_bytes: int
    gpu_memory_utilization: float


class _DtypeArgs(TypedDict, total=False):
    dtype: Literal["float32"]


class VllmEngine:
    def __init__(self, config: ReplicaConfig) -> None:
        if config.device is None:
            raise ValueError(f"{config.name}: a vLLM engine needs a device")
        self.config = config
        self._llm: AsyncLLM | None = None
        self._prompts: PromptTokenizer
        self.max_model_len = 0
        self._by_priority = config.engine_args.get("scheduling_policy") == "priority"

    async def start(self) -> None:
        started = time.monotonic()
        if self.config.build is not None:
            await asyncio.to_thread(ensure_built, self.config.source, self.config.build)
        if self.config.device == "cpu":
            # Picks vLLM's CPU platform even where the CUDA wheel is installed under the CPU build.
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        # Imported here: importing vLLM takes seconds, and remote-only deployments never need it.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # Whatever models.yaml gives, unchecked here: vLLM checks its own arguments.
        engine_args: Mapping[str, Any] = self.config.engine_args
        args = AsyncEngineArgs(
            model=self.config.source,
            served_model_name=[self.config.model],
            disable_log_stats=True,
            **self._memory_args(),
            **self._dtype_args(),
            **engine_args,
        )
        cores = self._cpu_cores()
        async with _SPAWN_ENV.use(self._spawn_env(cores)):
            # Construction blocks while the engine processes start; a thread keeps the loop free,
            # so several engines start at once.
            llm = await _finish_even_if_cancelled(
                asyncio.to_thread(_start_on, cores, AsyncLLM.from_engine_args, args),
                lambda llm: llm.shutdown(),
            )
        try:
            self._prompts = PromptTokenizer(llm.get_tokenizer(), self.config)
            self.max_model_len = llm.model_config.max_model_len
            warmed = await self._warm_up(llm)
        except BaseException:
            await asyncio.to_thread(llm.shutdown)
            raise
        # Only now is it healthy, and in the router's view: a request never pays for a path's
        # first run, a restarted engine's included.
        self._llm = llm
        log.info(
            "%s: ready in %.1f s (warm-up %s), context %d tokens, EngineCore pid %s",
            self.config.name,
            time.monotonic() - started,
            describe(warmed),
            self.max_model_len,
            ",".join(map(str, _engine_core_pids(llm))) or "?",
        )

    async def _warm_up(self, llm: AsyncLLM) -> list[WarmedPath]:
        """Serve every path once (`serving.engines.warmup`) on `llm`, not yet published."""
        filler = self._prompts.tokenizer.encode(" the", add_special_tokens=False)[-1]
        max_batch = llm.vllm_config.scheduler_config.max_num_seqs
        to_warm = paths(self.max_model_len, max_batch, filler, seeded=self.config.device != "cpu")
        return await warm_up(lambda r, s: self._generate(llm, r, s), to_warm)

    def _memory_args(self) -> _MemoryArgs:
        if self.config.kv_cache_gib is not None:
            return {"kv_cache_memory_bytes": int(self.config.kv_cache_gib * 2**30)}
        if self.config.memory_fraction is not None:
            return {"gpu_memory_utilization": self.config.memory_fraction}
        return {}

    def _dtype_args(self) -> _DtypeArgs:
        """float32 on a CPU, unless the placement says otherwise.

        vLLM's CPU default turns float32 and fp16 weights into bf16. On this project's first
        AVX-512 CPU, without AVX512-BF16 or AMX, bf16 was emulated: float32 took tiny-l from
        63.6 to 30.7 ms per token at batch 16 and a 1,350-token prefill from 3.2 to 1.0 s (only
        batch-1 decode was faster in bf16, 14.9 against 19.4 ms), and the embedded profile was
        measured in float32. On a later machine with AMX and AVX512-BF16, a bf16 tiny-s worker
        died of SIGILL (exit -4) on its first request in two of three test sessions, though
        torch's bf16 matmul ran there; float32 did not. So float32 everywhere on a CPU, which
        also keeps the measured profile true.
        """
        if self.config.device != "cpu" or "dtype" in self.config.engine_args:
            return {}
        return {"dtype": "float32"}

    def _cpu_cores(self) -> set[int] | None:
        """The cores a CPU engine's processes run on: the placement's, else all but the last.

        vLLM's own default binds the worker's threads to all cores but one, which it leaves to
        the front-end, but its EngineCore process floats. That process busy-polls the worker
        (sched_yield in a loop) for a second after every step, and on the 2-core embedded
        deployment it left other processes of the machine waiting for the CPU for seconds: a
        probe sleeping 5 ms woke up to 4.8 s late during `vllm bench serve` at 20 req/s, and a
        test client, starved for the 11 s of a 2,000-token generation, could not hang up before
        it ended. With the EngineCore on the worker's core the probe's worst was 24 ms; output
        throughput at saturation (80 req/s) did not change (5,600 tok/s), while the median TPOT
        at 20 req/s rose from 4 to 7 ms, as the EngineCore now shares the worker's core.
        On one core there is nothing to leave free: None, no pinning.
        """
        if self.config.device != "cpu":
            return None
        if self.config.cpu_cores is not None:
            # vLLM's own parser, so the processes land where vLLM binds the worker's threads.
            from vllm.utils.cpu_resource_utils import parse_id_list

            return set(parse_id_list(self.config.cpu_cores))
        allowed = sorted(os.sched_getaffinity(0))
        return set(allowed[:-1]) or None

    def _spawn_env(self, cores: set[int] | None) -> dict[str, str]:
        """What the engine's processes must see when they start to land on the replica's device."""
        device = self.config.device or "cpu"
        if device == "cpu":
            # Binding the worker's threads beat letting the OS float them ("nobind") on the
            # 2-core embedded deployment: 329 against 106 tokens/s with 16 streams spread over
            # the models by the router.
            bind = ",".join(map(str, sorted(cores))) if cores else "auto"
            env = {"VLLM_CPU_OMP_THREADS_BIND": bind}
            if self.config.engine_args.get("enforce_eager"):
                # Eager, vLLM compiles no model, yet it still compiles (torch.compile, inductor,
                # a C++ build) the function that ranks log-probabilities, on first use. On the
                # embedded deployment that made the warm-up's log-probabilities take 3-10 s per
                # engine (about 30 s on a fresh machine, with inductor's disk cache empty);
                # without dynamo they took 0.1 s, and the whole warm-up 1.7-4.4 s against 11-19.
                # Eager, the ranking makes a (tokens x vocabulary) mask, which a CPU's memory holds.
                env["TORCHDYNAMO_DISABLE"] = "1"
            return env
        index = device.removeprefix("cuda:")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:  # cuda:N counts within what the server itself was given
            index = visible.split(",")[int(index)]
        return {"CUDA_VISIBLE_DEVICES": index}

    def _sampling_params(
        self, request: Request, sampling: Sampling, prompt_len: int
    ) -> SamplingParams:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        max_tokens = output_budget(request, prompt_len, self.max_model_len)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=list(sampling.stop),
            seed=sampling.seed,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            ignore_eos=sampling.ignore_eos,
            min_tokens=min(sampling.min_tokens, max_tokens),
            logprobs=sampling.logprobs,
            prompt_logprobs=sampling.logprobs if sampling.echo else None,
            output_kind=RequestOutputKind.DELTA,
        )

    def generate(self, request: Request, sampling: Sampling) -> AsyncIterator[TokenDelta]:
        return self._generate(None, request, sampling)

    async def _generate(
        self, llm: AsyncLLM | None, request: Request, sampling: Sampling
    ) -> AsyncIterator[TokenDelta]:
        """`llm`: the engine warming up, not yet published; None: the running one."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        if llm is None:
            # Raises EngineUnavailable before anything starts: safe to retry elsewhere.
            llm = self._running()
        if sampling.seed is not None and sampling.temperature > 0 and self.config.device == "cpu":
            # vLLM 0.32's CPU backend kills its worker when a seeded request's prompt is split
            # over steps (chunked prefill): it rewinds the request's generator with an offset,
            # which only CUDA generators have. 64 such requests at once, 120 words each, took
            # down the embedded tiny-s and every request it held. Greedy decoding uses no
            # generator, so a seed with temperature 0 (lm-eval's) is safe.
            raise InvalidRequest(
                f"{self.config.name} runs on a CPU, where a seed is only served with temperature "
                "0 (greedy): vLLM's CPU backend fails seeded sampling. Leave out the seed, or "
                "set temperature to 0.",
                param="seed",
            )
        prompts = self._prompts
        ids = await prompts.ids(request, self.max_model_len)
        params = self._sampling_params(request, sampling, len(ids))
        echo, first = sampling.echo, True
        try:
            # Closing this generator early (client gone, deadline) makes vLLM abort the request.
            async for out in llm.generate(
                TokensPrompt(prompt_token_ids=ids),
                params,
                request.request_id,
                # vLLM refuses a priority unless it schedules by priority.
                priority=sampling.priority if self._by_priority else 0,
            ):
                completion = out.outputs[0]
                # 'abort' and 'error' go on as they are: the gateway fails the request on them.
                finish = completion.finish_reason if out.finished else None
                k = sampling.logprobs
                yield TokenDelta(
                    text=completion.text,
                    tokens=len(completion.token_ids),
                    prompt_tokens=len(ids),
                    finish_reason=finish,
                    cached_tokens=out.num_cached_tokens if first else None,
                    logprobs=(
                        _logprobs(completion.token_ids, completion.logprobs or (), k, prompts)
                        if k is not None
                        else ()
                    ),
                    prompt_text=prompts.text(request, ids) if echo else None,
                    prompt_logprobs=(
                        _logprobs(ids, out.prompt_logprobs or (), k, prompts)
                        if echo and k is not None
                        else None
                    ),
                )
                echo = first = False  # the prompt goes with the first delta only
        except EngineDeadError as exc:
            # Not EngineUnavailable: the request was accepted, and may be what killed the engine.
            raise EngineError(f"{self.config.name}: the engine died") from exc
        except VLLMClientError as exc:
            raise InvalidRequest(str(exc)) from exc
        except Exception as exc:
            raise EngineError(f"{self.config.name}: {type(exc).__name__}: {exc}") from exc

    def _running(self) -> AsyncLLM:
        if self._llm is None:
            raise EngineUnavailable(f"{self.config.name}: not running")
        if self._llm.errored:
            raise EngineUnavailable(f"{self.config.name}: the engine died")
        return self._llm

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and not self._llm.errored:
            await self._llm.abort(request_id)

    def healthy(self) -> bool:
        return self._llm is not None and not self._llm.errored

    def unfinished(self) -> int:
        return self._llm.get_num_unfinished_requests() if self._llm is not None else 0

    def load(self) -> None:
        return None  # in this process: the gateway counts every request it holds

    async def recover(self) -> None:
        """Replace a dead engine with a new one on the same cores.

        vLLM's monitor has already stopped the dead engine's processes by the time `errored`
        is set; shutting the AsyncLLM down still closes its sockets and its output task, which
        would otherwise linger until the garbage collector found them."""
        await self.close()
        await self.start()

    async def close(self) -> None:
        llm, self._llm = self._llm, None  # not healthy from here on, even while shutting down
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)


def _logprobs(
    ids: Iterable[int],
    positions: Iterable[Mapping[int, Any] | None],
    k: int,
    prompts: PromptTokenizer,
) -> tuple[TokenLogprob, ...]:
    """vLLM's log-probabilities (one {token id: Logprob} per position, holding the position's
    own token and its top `k`; None for a prompt's first token) as plain data."""

    def text(token_id: int, logprob: Any) -> str:
        return (
            logprob.decoded_token if logprob.decoded_token is not None else prompts.token(token_id)
        )

    out = []
    for token_id, position in zip(ids, positions, strict=True):
        if position is None:
            out.append(TokenLogprob(prompts.token(token_id), None))
            continue
        top = sorted(
            ((lp.rank, text(i, lp), lp.logprob) for i, lp in position.items() if lp.rank <= k),
            key=lambda ranked: ranked[0],
        )
        own = position[token_id]
        out.append(
            TokenLogprob(text(token_id, own), own.logprob, tuple((t, lp) for _, t, lp in top))
        )
    return tuple(out)


async def _finish_even_if_cancelled(work: Awaitable[R], undo: Callable[[R], object]) -> R:
    """Await `work`; if the caller is cancelled meanwhile (the server stops while an engine
    restarts), let it finish and `undo` its result in a thread before the cancellation goes on.
    A thread that is starting engine processes cannot be stopped half-way, and what it starts
    after nobody waits for it would outlive the server."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # a start that failed has nothing to undo
            await asyncio.to_thread(undo, await task)
        raise


def _engine_core_pids(llm: AsyncLLM) -> list[int]:
    """The engine's EngineCore processes, for the log (whoever must find one: an operator, the
    chaos benchmark). vLLM keeps them on internals it does not promise, hence the care."""
    manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", ()) if p.pid is not None]


def _start_on(cores: set[int] | None, start: Callable[[T], R], arg: T) -> R:
    """`start(arg)` with the calling thread on `cores`, so that the processes it spawns inherit
    them (affinity is per thread on Linux); threads it starts in this process (ZMQ's) inherit
    them too, so those get the process's cores back afterwards."""
    if cores is None:
        return start(arg)
    free = os.sched_getaffinity(0)
    before = _thread_ids()
    os.sched_setaffinity(0, cores)
    try:
        return start(arg)
    finally:
        os.sched_setaffinity(0, free)
        for tid in _thread_ids() - before:
            with contextlib.suppress(ProcessLookupError):  # a thread that has ended since
                os.sched_setaffinity(tid, free)


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


class _SpawnEnvironment:
    """Engine processes inherit the environment of the moment they start, so engines that need
    different variables (another GPU, other cores) must not start at the same time. Engines that
    need the same ones may: each group of equal settings starts together, one group at a time."""

    def __init__(self) -> None:
        self._current: frozenset[tuple[str, str]] | None = None
        self._users = 0
        self._saved: dict[str, str | None] = {}
        self._changed: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def use(self, env: dict[str, str]) -> AsyncIterator[None]:
        if self._changed is None:
            self._changed = asyncio.Condition()
        key = frozenset(env.items())
        async with self._changed:
            await self._changed.wait_for(lambda: self._users == 0 or self._current == key)
            if self._users == 0:
                self._current = key
                self._saved = {name: os.environ.get(name) for name in env}
                os.environ.update(env)
            self._users += 1
        try:
            yield
        finally:
            async with self._changed:
                self._users -= 1
                if self._users == 0:
                    _restore(self._saved)
                    self._current = None
                self._changed.notify_all()


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


_SPAWN_ENV = _SpawnEnvironment()
