"""The request lifecycle: route, dispatch, stream, account.

The gateway encodes the live cluster with the router's feature code, asks the policy for a
replica, and hands back a `Generation` once the first token exists, so that anything that goes
wrong before then is still an ordinary HTTP error. It does not know which policy it runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import NamedTuple, NoReturn

from config import Deployment, Limits
from router.admission import Admission, Expected, Shed, admission_for, assumed_output_tokens
from router.features import ArrivalRateEstimator, OutputPredictor
from router.policies import Policy, encoder_for
from router.view import ClusterView
from serving import outcomes
from serving.engines.base import (
    UNFINISHED,
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
    UpstreamLost,
)
from serving.engines.prompts import PromptCounter
from serving.key_limits import KeyLimiter, OverLimit, SharedAccounts
from serving.metrics import Metrics
from serving.outcomes import RequestRecord
from serving.recent import Decision
from serving.replicas import Replica, ReplicaSet
from workloads import Request

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class GatewayError(Exception):
    """A request the gateway could not serve. Carries what the client and the metrics need."""

    status = 500
    code = "internal_error"
    outcome = outcomes.ENGINE_ERROR
    headers: dict[str, str] = {}

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class BadRequest(GatewayError):
    status, code, outcome = 400, "invalid_request_error", outcomes.INVALID


class ModelNotFound(GatewayError):
    status, code, outcome = 404, "model_not_found", outcomes.INVALID


class NoReplicaAvailable(GatewayError):
    status, code, outcome = 503, "service_unavailable", outcomes.UNAVAILABLE


class DeadlineExceeded(GatewayError):
    status, code, outcome = 504, "deadline_exceeded", outcomes.DEADLINE


class EngineFailed(GatewayError):
    status, code, outcome = 500, "engine_error", outcomes.ENGINE_ERROR


class InternalError(GatewayError):
    """A fault of the server's own (its traceback is logged), in place of an uncounted 500."""

    status, code, outcome = 500, "internal_error", outcomes.INTERNAL


class RateLimited(GatewayError):
    status, code, outcome = 429, "rate_limit_exceeded", outcomes.LIMITED

    def __init__(self, over: OverLimit) -> None:
        super().__init__(over.message)
        self.headers = {"Retry-After": str(over.retry_after_s)}


class Overloaded(GatewayError):
    status, code, outcome = 429, "overloaded", outcomes.SHED

    def __init__(self, shed: Shed, qos_class: str) -> None:
        if shed.answer:
            why = (
                f"a {qos_class} answer of this length would take about {shed.estimate_s:.2g} s, "
                f"past the {shed.budget_s:g} s its SLO allows"
            )
        else:
            why = (
                f"the first token of a {qos_class} request would come in about "
                f"{shed.estimate_s:.2g} s, past the {shed.budget_s:g} s this class may wait"
            )
        super().__init__(f"The server is overloaded: {why}. Retry in {shed.retry_after_s} s.")
        self.headers = {"Retry-After": str(shed.retry_after_s)}


MAX_RETRIES = 2
"""How many other replicas a request is sent to after its own failed it before its first token:
enough to ride out two replicas dying at once, without sending a request whose prompt itself
breaks engines to every replica."""


class RouteAgain(Exception):
    """A replica failed the request before its first token: nothing reached the client, so the
    gateway may route it again (`serving_retries_total{reason}`), or else answer with `error`."""

    def __init__(self, reason: str, error: GatewayError) -> None:
        super().__init__(str(error))
        self.reason = reason
        self.error = error


def retry_reason(exc: BaseException) -> str:
    """The `serving_retries_total` reason for an engine's failure before the first token."""
    if isinstance(exc, EngineUnavailable):
        return "engine_unavailable"
    if isinstance(exc, UpstreamLost):
        return "upstream_lost"
    return "engine_error"


def deadline_exceeded(request: Request, deployment: Deployment) -> DeadlineExceeded:
    deadline = deployment.qos_classes[request.qos_class].deadline_s
    return DeadlineExceeded(
        f"No token within the {request.qos_class} class's deadline of {deadline:g} s; "
        "the request was aborted."
    )


AUTO = "auto"
"""The model name that lets the router choose."""


class Gateway:
    def __init__(
        self,
        deployment: Deployment,
        replicas: ReplicaSet,
        policy: Policy,
        metrics: Metrics,
        clock: Clock = time.monotonic,
        admission: Admission | None = None,
        rate: ArrivalRateEstimator | None = None,
        key_accounts: SharedAccounts | None = None,
    ) -> None:
        """`admission` decides what is shed before routing (default: the deployment's rule);
        `rate` estimates the arrival rate (default: from this gateway's arrivals alone);
        `key_accounts` keeps the keys' counts (default: this gateway's alone)."""
        self.deployment = deployment
        self.replicas = replicas
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.encoder = encoder_for(policy, deployment)
        self.rate = rate or ArrivalRateEstimator()
        self.limiter = KeyLimiter(self._limits_of, key_accounts)
        self.admission = admission or admission_for(deployment)
        self.counter: PromptCounter | None = None
        """Counts each prompt's tokens and hashes its blocks before admission control and the
        router see it (`serving.app` loads it as the engines start); None: not counted."""
        self.max_model_len = deployment.max_model_len
        self.predictor = OutputPredictor(self.max_model_len)
        """What the router expects of each request's output, taught by every request served
        whole here, as the simulator's episodes teach theirs."""

    async def start(
        self,
        request: Request,
        sampling: Sampling,
        model: str = AUTO,
        record: RequestRecord | None = None,
        api_key: str | None = None,
        deadline: Callable[[float], None] | None = None,
        sheddable: bool = True,
    ) -> Generation:
        """Dispatch `request` and wait for its first token. `record` is its account so far (the
        API's: how it arrived); the gateway and the generation fill in the rest. `api_key` (None:
        anonymous) is held to its limits until the request ends. `deadline`, where the transport
        schedules the response stream, takes the time by which its last token must be written:
        the budget the router computed over the client's path, where it computed one (one
        budget for both halves; the transport never lets it move earlier than the class's own).

        `sheddable=False`: a prompt of a batch, which the door admitted with its batch
        (`serving.middleware.ShedAtTheDoor`, once per HTTP request). It is routed where
        admission control would send it, but not refused for the time its own siblings, sent
        together with it, take: an lm-eval batch of 16 one-token prompts was shed on an idle server,
        each prompt judged against the 40 ms one token's SLO allows with the other 15 ahead of it.

        Raises a GatewayError, already counted in the metrics, if it cannot be served. A replica
        that fails the request before its first token (down, an engine error, its connection
        lost) is left out and the router asked again, up to MAX_RETRIES times while the class's
        deadline is still ahead; else the request fails with that replica's error.
        """
        if record is None:
            record = RequestRecord(request.request_id, request.qos_class, request.arrival)
        record.received = self.clock()
        self.metrics.opened(record)
        # The rate at the request's arrival, which is what the simulator's arrivals see too.
        rate = self.rate.observe(request.arrival)
        self.metrics.arrival_rate.set(rate)
        skipped: set[str] = set()
        try:
            self.limiter.acquire(api_key, self.clock())
        except OverLimit as over:
            self.metrics.limited.labels(record.tier or "none", over.limit).inc()
            self._refuse(record, model, RateLimited(over))
        if self.counter is not None:
            request = await self._count(request, record, model, api_key)
        while True:
            try:
                self._check(request, model)
                now = self.clock()
                if self.deadline(request) <= now:
                    raise deadline_exceeded(request, self.deployment)
                view = self._view(model, skipped)
                admitted = self.admission.check(request, view, now)
                if isinstance(admitted, Shed):
                    # A request sent on from a replica that failed it was let in already: it is
                    # routed where admission control would send it, not refused after its wait.
                    if sheddable and not record.retries:
                        raise Overloaded(admitted, request.qos_class)
                    admitted = view
                index = self._route(request, model, rate, admitted)
                expected = self.admission.expect(request, admitted, index)
            except GatewayError as exc:
                self.limiter.release(api_key)
                self._refuse(record, model, exc)
            except Exception as exc:  # a bug in a policy or admission control: counted, a 500
                log.exception("routing %s failed", request.request_id)
                self.limiter.release(api_key)
                self._refuse(record, model, InternalError(f"Routing failed: {type(exc).__name__}."))
            record.routed = self.clock()
            self._decided(record, request, model, index, rate)
            if deadline is not None and (left := self.encoder.budget(request)) is not None:
                deadline(request.arrival + left.answer_s)
            generation = Generation(
                self,
                request,
                self.replicas[index],
                replace(sampling, priority=self.deployment.qos_classes[request.qos_class].urgency),
                record,
                lambda: self.limiter.release(api_key),
                self._learn(index, expected),
            )
            try:
                await generation.first_token()
                return generation
            except RouteAgain as again:
                # Nothing reached the client, so nothing is lost by trying the next choice.
                skipped.add(generation.replica.name)
                if not self._may_retry(request, model, record, skipped):
                    self.limiter.release(api_key)
                    self.metrics.finish(record, again.error.outcome, slo_met=False)
                    raise again.error from again
                record.retries.append({"replica": generation.replica.name, "reason": again.reason})
                self.metrics.retries.labels(again.reason).inc()
                log.warning("%s; trying another replica (%s)", again, again.reason)

    def _may_retry(
        self, request: Request, model: str, record: RequestRecord, skipped: set[str]
    ) -> bool:
        """Whether a request whose replica failed it goes on at another: a retry is left, its
        deadline is ahead, and a replica it has not tried is up. Else it fails with the last
        replica's error, which says more than "no replica" would."""
        if len(record.retries) == MAX_RETRIES or self.deadline(request) <= self.clock():
            return False
        view = self.replicas.view(None if model == AUTO else model, exclude=skipped)
        return any(r.available for r in view.replicas)

    async def _count(
        self, request: Request, record: RequestRecord, model: str, api_key: str | None
    ) -> Request:
        """`request` with its prompt's tokens counted and its blocks hashed, once, here: what
        admission control, the router and a prefix index go on (a simulated engine takes the
        count as it is). A prompt no model's context could hold is refused (400)."""
        assert self.counter is not None
        started = time.perf_counter()
        try:
            counted = await self.counter.count(request, self.max_model_len)
        except InvalidRequest as exc:
            self.limiter.release(api_key)
            self._refuse(record, model, BadRequest(exc.message, exc.param, exc.code))
        self.metrics.prompt_count.observe(time.perf_counter() - started)
        return counted

    def turn_away(
        self, record: RequestRecord, model: str, max_tokens: int | None
    ) -> Overloaded | None:
        """Admission control at the door, before the API's handler parses and validates the
        request (`serving.middleware.ShedAtTheDoor`), with what `start` would decide from its
        class, arrival, model and length. Under overload most requests end here, and a refusal
        that never reaches the handler (pydantic, the exception handlers, the tasks that watch
        the client) costs the server about half the CPU (docs/results/overload.md). That is what
        keeps shed answers quick, and leaves the front-end's core to the requests it lets in.

        Returns the error to answer with, counted; None lets the request in, to be checked
        again by `start`. A request past its deadline, for a model that is not here, or that
        no replica could take, is let in for `start` to answer (504, 404, 503)."""
        if record.qos_class not in self.deployment.qos_classes:
            return None
        if model != AUTO and model not in self.deployment.models:
            return None
        now = self.clock()
        # Its prompt is not counted yet: taken as one token, the door sheds only what no prompt
        # could make in time, and `start` checks again with the count.
        request = Request(
            record.request_id or "", record.arrival, "", max_tokens, record.qos_class,
            prompt_tokens=1,
        )  # fmt: skip
        if self.deadline(request) <= now:
            return None
        view = self.replicas.view(None if model == AUTO else model)
        if not any(r.available for r in view.replicas):
            return None
        shed = self.admission.check(request, view, now)
        if not isinstance(shed, Shed):
            return None
        # Every arrival counts in the rate once: here if it is shed, else in `start`.
        self.metrics.arrival_rate.set(self.rate.observe(record.arrival))
        record.model = model if model in self.deployment.models else None
        self.metrics.finish(record, outcomes.SHED, slo_met=False)
        return Overloaded(shed, record.qos_class)

    def _limits_of(self, api_key: str | None) -> Limits:
        if api_key is not None:
            return self.deployment.key_limits[api_key]
        anonymous = self.deployment.anonymous_tier
        return self.deployment.tiers[anonymous].limits if anonymous is not None else Limits()

    def _refuse(self, record: RequestRecord, model: str, error: GatewayError) -> NoReturn:
        """Count a request that was never dispatched, and raise `error` for the client."""
        # Never a client-chosen label value: an unknown name would grow the metric forever.
        record.model = model if model in self.deployment.models else None
        self.metrics.finish(record, error.outcome, slo_met=False)
        raise error

    def deadline(self, request: Request) -> float:
        """When the request's first token is due, on the gateway's clock."""
        return request.arrival + self.deployment.qos_classes[request.qos_class].deadline_s

    def _check(self, request: Request, model: str) -> None:
        if model != AUTO and model not in self.deployment.models:
            known = ", ".join([AUTO, *self.deployment.models])
            raise ModelNotFound(
                f"The model {model!r} does not exist here (known: {known}).", "model"
            )
        if request.task is not None and request.task not in self.deployment.quality:
            known = ", ".join(self.deployment.tasks)
            raise BadRequest(f"Unknown task {request.task!r} (known: {known}).", "task")

    def _view(self, model: str, skipped: set[str]) -> ClusterView:
        view = self.replicas.view(None if model == AUTO else model, exclude=skipped)
        if not any(r.available for r in view.replicas):
            which = "the router's models" if model == AUTO else f"model {model!r}"
            raise NoReplicaAvailable(f"No healthy replica can serve {which} right now.")
        return view

    def _decided(
        self, record: RequestRecord, request: Request, asked: str, index: int, rate: float
    ) -> None:
        """Tell the dashboard's recorder where the request went and the load it found."""
        chosen = self.replicas[index]
        totals = [self.replicas.totals(i)[0] for i in range(len(self.replicas))]
        self.metrics.recent.routed(
            Decision(
                at=record.routed or self.clock(),
                request_id=record.request_id or request.request_id,
                qos_class=request.qos_class,
                task=request.task,
                asked=asked,
                model=chosen.model,
                replica=chosen.name,
                in_flight=sum(totals),
                at_replica=totals[index],
                rate=rate,
            )
        )

    def _learn(self, index: int, expected: Expected | None) -> Feedback:
        """What a generation at replica `index` tells admission control of how it went."""
        if expected is None:
            return NO_FEEDBACK
        return Feedback(
            lambda after_s, missed: self.admission.observe_first_token(
                index, expected, after_s, missed
            ),
            lambda tpot_s: self.admission.observe_pace(index, expected, tpot_s),
        )

    def _route(self, request: Request, model: str, rate: float, view: ClusterView) -> int:
        # The expected output is the predictor's, outside the decision's time (reported apart).
        asks = model == AUTO and self.encoder.reads_lengths
        expected = self.predictor.predict(request) if asks else None
        started = time.perf_counter()
        if model != AUTO:
            index = view.least_loaded(model)
        else:
            elapsed = self.clock() - request.arrival
            obs = self.encoder.encode(view, request, rate, elapsed, expected)
            index = view.replica_for(self.policy.choose(obs, request, view))
            self.metrics.route.observe(time.perf_counter() - started)
        assert index is not None
        return index


class Feedback(NamedTuple):
    """Where a generation reports how it went (`Admission.observe_*`)."""

    first_token: Callable[[float, bool], None]
    """Seconds from dispatch to the first token; or, missed (True) when none came by the
    deadline, the seconds it waited."""
    pace: Callable[[float], None]
    """Seconds per output token after the first, of a request that finished."""


NO_FEEDBACK = Feedback(lambda after_s, missed: None, lambda tpot_s: None)

_END = object()
"""Queued after an engine's last delta."""

_RETRIED = "retried"
"""Not an outcome: the replica failed the request before its first token (RouteAgain)."""

EARLY_PACE_TOKENS = 8
"""After this many tokens a request tells admission control the pace it has had so far, as well
as its whole pace when it ends: a replica that keeps a slower pace than the SLO allows is then
known within a fraction of a second, not after a whole answer (seconds), while every request
sent there meanwhile misses the SLO."""

_DRAIN_S = 0.5
"""How long a finished generation waits for its engine stream to end by itself."""


class Generation:
    """One request dispatched to one replica: its token stream, and its accounting when it ends.

    Iterate it for the deltas (the first one included); close it, however the iteration ended,
    to free the replica. Closing early aborts the request in the engine.

    The engine's stream is pumped by a task of its own. vLLM aborts a request from inside its
    generator when that is cancelled, with awaits in the handler; cancelled from a server's
    cancel scope (AnyIO cancels level-triggered), those awaits could be cancelled too and leave
    the request running in the engine. A plain task, cancelled once, lets the abort finish.
    """

    def __init__(
        self,
        gateway: Gateway,
        request: Request,
        replica: Replica,
        sampling: Sampling,
        record: RequestRecord,
        on_end: Callable[[], None] = lambda: None,
        feedback: Feedback = NO_FEEDBACK,
    ):
        """`on_end` runs once when the request ends here, unless it goes on at another replica;
        `feedback` hears how its first token and its pace went."""
        self.gateway = gateway
        self._on_end = on_end
        self._feedback = feedback
        self.request = request
        self.replica = replica
        self.record = record
        record.model, record.replica = replica.model, replica.name
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._queue: asyncio.Queue[TokenDelta | BaseException | object] = asyncio.Queue()
        self._first: TokenDelta | None = None
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._outcome: str | None = None
        self._owed = assumed_output_tokens(request)
        """Output tokens this request may still get: its share of the replica's `owed`."""
        replica.count(running=1, waiting=1, owed=self._owed)
        self._waiting = True
        """Counted in the replica's waiting: no first token yet."""
        self._holds_replica = True
        """Counted in the replica's running and owed: until the engine is done with it."""
        self._released = False
        self._complete = False
        """The engine finished the answer; it counts as ok once `delivered`."""
        self._relay: Callable[[TokenDelta], Awaitable[None]] | None = None
        self._relayed: asyncio.Future[None] | None = None
        self._pump = asyncio.create_task(self._run(replica.engine.generate(request, sampling)))

    @property
    def model(self) -> str:
        return self.replica.model

    async def _run(self, deltas: AsyncIterator[TokenDelta]) -> None:
        try:
            async for delta in deltas:
                # vLLM may send deltas that carry nothing (a role-only chunk); they are not tokens.
                if delta.tokens or delta.text or delta.finish_reason or delta.prompt_text:
                    if self._relay is not None and delta.finish_reason is None:
                        await self._relay_one(self._relay, delta)
                    else:
                        self._put(delta)
            self._put(_END)
        except Exception as exc:
            self._put(exc)
        finally:
            # The engine holds the request no more, so neither does its replica, whatever the
            # client has yet to read: a client that died mid-stream holds its response until
            # the connection's idle timeout (a minute over QUIC), and the router and admission
            # control would count it as running all that while.
            self._free_replica()

    def _put(self, item: TokenDelta | BaseException | object) -> None:
        """Queue `item` for iterating, and end a relay: it is for iterating to yield next."""
        self._queue.put_nowait(item)
        self._end_relay()

    async def first_token(self) -> None:
        """Wait for the first token under the class's deadline.

        However the wait ends other than with a token, the generation is closed and counted,
        and a GatewayError raised; except an engine's failure (RouteAgain: not counted, for the
        gateway to try another replica), and cancellation, which counts as the client leaving.
        """
        gateway = self.gateway
        try:
            async with asyncio.timeout(max(gateway.deadline(self.request) - gateway.clock(), 0)):
                self._first = await self._next()
        except TimeoutError:
            # Admission control must hear of a miss above all: a replica far slower than its
            # estimates would otherwise give no first token to learn from, and go on being sent
            # requests that all wait out their deadlines.
            if self.record.routed is not None:
                self._feedback.first_token(gateway.clock() - self.record.routed, True)
            await self._fail(deadline_exceeded(self.request, gateway.deployment))
        except InvalidRequest as exc:
            await self._fail(BadRequest(exc.message, exc.param, exc.code))
        except EngineUnavailable as exc:
            await self._route_again(exc, NoReplicaAvailable(str(exc)))
        except (EngineError, StopAsyncIteration) as exc:
            # An engine's own errors already name its replica.
            await self._route_again(
                exc, EngineFailed(str(exc) or f"{self.replica.name}: no output")
            )
        except Exception as exc:
            log.exception("%s: unexpected error before the first token", self.replica.name)
            await self._fail(EngineFailed(f"{self.replica.name}: {type(exc).__name__}"))
        except BaseException:
            await self.aclose()
            raise

    async def _route_again(self, exc: BaseException, error: GatewayError) -> NoReturn:
        """Close without counting the request, which goes on elsewhere or fails with `error`."""
        self._outcome = _RETRIED
        await self.aclose()
        raise RouteAgain(retry_reason(exc), error) from exc

    async def _next(self) -> TokenDelta:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, TokenDelta)
        return self._took(item)

    def _took(self, item: TokenDelta) -> TokenDelta:
        """`item` counted as the client's next delta."""
        if item.finish_reason in UNFINISHED:
            raise EngineError(
                f"{self.replica.name}: the engine ended the request unfinished "
                f"(finish_reason {item.finish_reason!r})"
            )
        now = self.gateway.clock()
        if self._first_at is None:
            self._first_at = now
            self._stop_waiting()
            if self.record.routed is not None:
                self._feedback.first_token(now - self.record.routed, False)
        self._last_at = now
        self.prompt_tokens = item.prompt_tokens or self.prompt_tokens
        if item.cached_tokens is not None:
            self.cached_tokens = item.cached_tokens
        before = self.completion_tokens
        self.completion_tokens += item.tokens
        if 0 < before < EARLY_PACE_TOKENS <= self.completion_tokens:
            self._feedback.pace((now - self._first_at) / (self.completion_tokens - 1))
        paid = min(item.tokens, self._owed)
        if paid:
            self._owed -= paid
            self.replica.count(owed=-paid)
        self.finish_reason = item.finish_reason or self.finish_reason
        return item

    async def __aiter__(self) -> AsyncIterator[TokenDelta]:
        first, self._first = self._first, None
        if first is None:
            return
        yield first
        try:
            while self.finish_reason is None:
                yield await self._next()
        except StopAsyncIteration:
            # An engine that ends without a finish reason did not finish the request.
            await self._fail(EngineFailed(f"{self.replica.name}: the stream ended early"))
        except EngineError as exc:
            await self._fail(EngineFailed(str(exc)))
        except InvalidRequest as exc:
            await self._fail(EngineFailed(f"{self.replica.name}: {exc.message}"))
        except Exception as exc:
            log.exception("%s: unexpected error mid-stream", self.replica.name)
            await self._fail(EngineFailed(f"{self.replica.name}: {type(exc).__name__}"))
        self._complete = True

    async def relay(self, write: Callable[[TokenDelta], Awaitable[None]]) -> None:
        """Hand the answer's next deltas to `write` from the engine's own task, up to one that
        ends it (its finish reason, an error or the engine's end), which iterating yields next.

        Iterating costs a task switch per token, and the resumption of every async generator
        between the engine and the transport (7% of an HTTP/1.1 token's CPU on the twin,
        docs/results/http3-vs-http1.md). A delta already waiting, or an engine already done,
        returns at once. Should `write` raise, it raises here. A `write` that waits (for room
        in the transport) holds the pump, and with it the replica's count of the request.
        """
        if not self._queue.empty() or self._pump.done() or self.finish_reason is not None:
            return
        self._relayed = asyncio.get_running_loop().create_future()
        self._relay = write
        try:
            await self._relayed
        finally:
            self._relay = self._relayed = None

    async def _relay_one(
        self, write: Callable[[TokenDelta], Awaitable[None]], delta: TokenDelta
    ) -> None:
        try:
            await write(self._took(delta))
        except Exception as exc:  # the client's, not the engine's: the engine goes on
            self._end_relay(exc)

    def _end_relay(self, error: Exception | None = None) -> None:
        relayed, self._relay = self._relayed, None
        if relayed is not None and not relayed.done():
            if error is None:
                relayed.set_result(None)
            else:
                relayed.set_exception(error)

    def delivered(self) -> None:
        """The client has the whole answer: a finished generation counts as ok. Not before:
        an answer whose stream is reset after its last token was written never reached its
        client, and `aclose` counts it as cancelled."""
        if self._complete:
            self._finish(outcomes.OK)

    async def _fail(self, error: GatewayError) -> None:
        self._finish(error.outcome)
        await self.aclose()
        raise error

    def _finish(self, outcome: str) -> None:
        """Record how the request ended, once."""
        if self._outcome is not None:
            return
        self._outcome = outcome
        record = self.record
        record.first_token, record.last_token = self._first_at, self._last_at
        record.prompt_tokens, record.tokens = self.prompt_tokens, self.completion_tokens
        record.cached_tokens = self.cached_tokens
        if outcome == outcomes.OK:
            self.gateway.predictor.observe(self.request, self.completion_tokens)
            if (tpot := record.tpot_s) is not None:
                self._feedback.pace(tpot)
        slo_met = (
            outcome == outcomes.OK
            and self._last_at is not None
            and self.gateway.deployment.slo.met(
                self._last_at - self.request.arrival, self.completion_tokens
            )
        )
        self.gateway.metrics.finish(record, outcome, slo_met)

    def _stop_waiting(self) -> None:
        if self._waiting:
            self._waiting = False
            self.replica.count(waiting=-1)

    def _free_replica(self) -> None:
        self._stop_waiting()
        if self._holds_replica:
            self._holds_replica = False
            self.replica.count(running=-1, owed=-self._owed)
            self._owed = 0

    async def aclose(self) -> None:
        """Free the replica and, if the engine still works on the request, abort it there.
        A request closed before it finished counts as cancelled by the client."""
        self._finish(outcomes.CANCELLED)
        if self._released:
            return
        self._released = True
        self._free_replica()
        if self._outcome != _RETRIED:
            self._on_end()
        if self._outcome == outcomes.OK and not self._pump.done():
            # Finished: let the engine end its stream by itself (a remote one sends its usage and
            # [DONE] next), so its connection can be reused rather than cut.
            await asyncio.wait([self._pump], timeout=_DRAIN_S)
        if not self._pump.done():
            self._pump.cancel()
            # The abort completes in the pump task even if this wait is itself cancelled.
            await asyncio.wait([self._pump])
