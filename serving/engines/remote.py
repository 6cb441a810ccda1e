"""An engine behind any OpenAI-compatible `vllm serve` URL: how the system reaches past one machine.

The upstream leg is on the hot path once per token, so it is built for it (measured in
docs/results/upstream-gateways.md): pooled keep-alive connections whose responses are parsed,
and split into events, as the bytes arrive (`serving.engines.upstream_http`), and each event
decoded by msgspec straight into the few fields read here. The official `openai` client did the
same through pydantic models of every chunk, at several times the CPU per token. While the
server cannot be reached the engine reports itself unhealthy; the replica's supervisor
(`serving.replicas.Supervisor`, the same for every engine kind) then calls `recover`, which
probes the server, with backoff until it answers again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from config import ReplicaConfig
from serving.engines.base import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    Sampling,
    TokenDelta,
    UpstreamLoad,
    UpstreamLost,
)
from serving.engines.upstream_http import UpstreamPool, UpstreamResponse
from workloads import Request, TokenIds

log = logging.getLogger(__name__)

KEEPALIVE_S = 4.0
"""Idle pooled connections are closed after this: under the 5 s after which vLLM's server
(uvicorn's `timeout_keep_alive`) closes them, so a request never goes out on a connection the
upstream is closing."""

STALE_SCRAPES = 10
"""A server's load report is stale, and no longer trusted, once this many scrape intervals have
passed without a new one (1 s at the default 0.1 s)."""

QUIET_SCRAPES = 5
"""While a server's reports show nothing the gateway's own count does not (no other client's
requests, none waiting), the interval doubles with each, up to this many scrape intervals: an
idle gateway's scrapes cost it more CPU than anything else it does (0.034 of a core for three
replicas at 0.1 s), and such a report only confirms what the gateway knows. The first report
that shows more puts the interval back."""

CAP_REPORTS = 10
"""The batch cap is the most requests seen running in the last this many reports that had
requests waiting: one report taken while a finished request's slot was being handed on reads
one short, and a server restarted with a smaller cap is believed after this many."""

LOAD_SERIES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "gpu_cache_usage_perc",
)
"""vLLM's series of its load read here (`gpu_cache_usage_perc`: the KV cache's older name)."""

_LOAD_LINE = re.compile(
    rb"^vllm:(" + "|".join(LOAD_SERIES).encode() + rb")(\{[^}\n]*\})? ([^ \n]+)", re.MULTILINE
)
"""A line of one of those series, with its labels and value: one regular expression over the
text, where prometheus_client's parser would build every sample."""


class WrongModel(Exception):
    """The server answers, but does not serve the model under the configured name."""


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None
    """On vLLM's last usage chunk, with `--enable-prompt-tokens-details`."""


class _Chunk(msgspec.Struct):
    """The fields of a chat or completion chunk read here; msgspec skips the others unparsed.
    `error` is how vLLM reports a failure after the stream has begun."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


decode_chunk = msgspec.json.Decoder(_Chunk).decode
"""One event's data as vLLM streams it, decoded to the fields read here (the benchmarks of the
upstream path measure it alone)."""
_encode = msgspec.json.encode


@dataclass(slots=True)
class _Open:
    """A request in flight: its response once the upstream has answered, and how many events it
    has read, which the stall watch compares between its rounds."""

    response: UpstreamResponse | None = None
    reads: int = 0
    seen: int = -1
    stalled: bool = False


class RemoteEngine:
    def __init__(self, config: ReplicaConfig, read_timeout_s: float = 60.0) -> None:
        if config.url is None:
            raise ValueError(f"{config.name}: a remote engine needs a url")
        self.config = config
        self._url = config.url.rstrip("/")
        origin = urlsplit(self._url)
        self._path = origin.path
        self._upstream = UpstreamPool(self._url, KEEPALIVE_S)
        self._read_timeout_s = read_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._watch: asyncio.Task[None] | None = None
        self._healthy = False
        self._open: dict[str, _Open] = {}
        # Only the series read here: vLLM's /metrics is prometheus_client's, which renders just
        # the names asked for, where the whole exposition is tens of kilobytes of histograms,
        # rendered by the upstream and read here ten times a second. A server that ignores
        # the filter sends all of it, which reads the same.
        self._metrics_url = f"{origin.scheme}://{origin.netloc}/metrics?" + "&".join(
            f"name[]=vllm:{name}" for name in LOAD_SERIES
        )
        self._model_label = f'model_name="{config.served_name}"'.encode()
        self._load: UpstreamLoad | None = None
        self._caps: deque[int] = deque(maxlen=CAP_REPORTS)
        self._scrape: asyncio.Task[None] | None = None
        self.scrape_interval = config.scrape_s
        """Seconds to the next /metrics read: `scrape_s`, or up to QUIET_SCRAPES of them."""
        self._heard: dict[str, int] = {}
        """At the last load report, each open request's events read (`_silent`)."""

    @property
    def session(self) -> aiohttp.ClientSession:
        """For the probe and the load scrape; the generations have `_upstream`. Made on first
        use: an aiohttp session belongs to the running loop."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                # No sock_read: aiohttp would re-arm a timer on every chunk received (3% of the
                # front-end's CPU at 80 req/s); `_watch_stalls` does it for all streams at once.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
                # vLLM sends no cookies; a jar would be a dict lookup per response for nothing.
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._watch = asyncio.get_running_loop().create_task(self._watch_stalls())
        return self._session

    async def _watch_stalls(self) -> None:
        """Every `read_timeout_s`, cut the streams that read nothing since the last round: a
        stream is cut after one to two timeouts of silence, by one timer for all of them."""
        while True:
            await asyncio.sleep(self._read_timeout_s)
            for held in list(self._open.values()):
                if held.response is None:
                    continue
                if held.reads == held.seen:
                    held.stalled = True
                    held.response.close()
                held.seen = held.reads

    async def start(self) -> None:
        # A server that is not up yet is an outage for the supervisor to ride out, not a reason
        # to refuse to start; one that serves another model is a configuration error and raises.
        self._healthy = await self._reachable()
        if not self._healthy:
            log.warning("%s: %s does not answer", self.config.name, self.config.url)
        if self.config.scrape_s > 0:
            self._scrape = asyncio.create_task(self._scrape_load(), name=f"scrape {self._url}")

    async def _scrape_load(self) -> None:
        """Read the server's load from its /metrics every `scrape_s` (or less often while it is
        quiet: QUIET_SCRAPES), until cancelled; mark the last report stale once none came for
        STALE_SCRAPES intervals."""
        interval = self.config.scrape_s
        stale_after = STALE_SCRAPES * interval
        timeout = aiohttp.ClientTimeout(total=stale_after)
        while True:
            started = time.monotonic()
            try:
                async with self.session.get(self._metrics_url, timeout=timeout) as response:
                    body = await response.read() if response.status == 200 else b""
            except (TimeoutError, aiohttp.ClientError):
                body = b""
            now = time.monotonic()
            load = self._parse_load(body, now) if body else None
            if load is not None:
                if self._load is not None and self._load.stale:
                    log.info("%s: load reports from %s again", self.config.name, self._metrics_url)
                self._load = load
            elif (
                self._load is not None
                and not self._load.stale
                and now - self._load.at > stale_after
            ):
                log.warning(
                    "%s: no load report from %s for %.1f s; routing on this gateway's own count",
                    self.config.name,
                    self._metrics_url,
                    now - self._load.at,
                )
                self._load = self._load._replace(stale=True)
                if self._open and self._silent():
                    self._hung(now - self._load.at)
            if load is not None:
                self._heard = {rid: held.reads for rid, held in self._open.items()}
            quiet = load is not None and load.others == 0 and load.waiting == 0
            self.scrape_interval = (
                min(2 * self.scrape_interval, QUIET_SCRAPES * interval) if quiet else interval
            )
            await asyncio.sleep(max(0.0, self.scrape_interval - (now - started)))

    def _silent(self) -> bool:
        """Nothing came from the server since its last load report: no request that was open
        then has ended or read an event, and none opened since has read one."""
        heard = self._heard
        return all(rid in self._open for rid in heard) and all(
            held.reads == heard.get(rid, 0) for rid, held in self._open.items()
        )

    def _hung(self, silent_s: float) -> None:
        """The server answers neither its /metrics nor any stream: it is down until its probe
        finds it again, and every request on it ends now. Those with no token yet are routed
        again by the gateway, rather than waiting out their deadlines (or the read timeout)
        on a server that may never answer."""
        log.warning(
            "%s: %s answered neither /metrics nor any of its %d streams for %.1f s; marked "
            "down, its requests sent elsewhere",
            self.config.name, self.config.url, len(self._open), silent_s,
        )  # fmt: skip
        self._healthy = False
        self._upstream.close()
        self._upstream = UpstreamPool(self._url, KEEPALIVE_S)

    def _parse_load(self, body: bytes, now: float) -> UpstreamLoad | None:
        """The load in a /metrics text, summed over the server's engines; None if it has none
        (a server that is not vLLM, or one run with --disable-log-stats)."""
        counts = {b"num_requests_running": 0, b"num_requests_waiting": 0}
        kv_usage: float | None = None
        seen = False
        for match in _LOAD_LINE.finditer(body):
            name, labels, value = match.groups()
            if labels and b"model_name=" in labels and self._model_label not in labels:
                continue  # another model of the same server
            try:
                number = float(value)
            except ValueError:
                continue
            seen = True
            if name in counts:
                counts[name] += int(number)
            else:
                kv_usage = max(kv_usage or 0.0, number)
        if not seen:
            return None
        running, waiting = counts[b"num_requests_running"], counts[b"num_requests_waiting"]
        if waiting:
            self._caps.append(running)
        others = max(0, running + waiting - len(self._open))
        return UpstreamLoad(running, waiting, kv_usage, others, max(self._caps, default=0), now)

    async def recover(self) -> None:
        if not await self._reachable():
            raise EngineUnavailable(f"{self.config.url} does not answer")
        self._healthy = True

    async def _reachable(self) -> bool:
        try:
            async with self.session.get(
                self._url + "/models", timeout=aiohttp.ClientTimeout(total=5.0)
            ) as response:
                if response.status != 200:
                    return False
                listed = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return False
        served = {m.get("id") for m in listed.get("data", []) if isinstance(m, dict)}
        if self.config.served_name not in served:
            raise WrongModel(
                f"{self.config.name}: {self.config.url} serves {sorted(map(str, served))}, not "
                f"{self.config.served_name!r}; set served_name in models.yaml"
            )
        return True

    async def generate(self, request: Request, sampling: Sampling) -> AsyncIterator[TokenDelta]:
        if not self._healthy:
            raise EngineUnavailable(f"{self.config.name}: {self.config.url} is unreachable")
        if sampling.logprobs is not None or sampling.echo:
            # Not relayed yet: the upstream's streamed logprobs would need mapping chunk by chunk.
            raise InvalidRequest(
                f"{self.config.name} is a remote replica, which does not relay logprobs or echo "
                "yet; pin a model this server runs itself.",
                param="logprobs" if sampling.logprobs is not None else "echo",
            )
        held = self._open[request.request_id] = _Open()
        try:
            held.response = await self._start(request, sampling)
            generated = 0
            # The last delta waits for the usage chunk that follows it: that alone says how
            # much of the prompt was cached.
            last: TokenDelta | None = None
            cached: int | None = None
            try:
                async for data in held.response.events():
                    held.reads += 1
                    chunk = decode_chunk(data)
                    if chunk.error is not None:
                        raise EngineError(f"{self.config.name}: {_text(chunk.error)}")
                    usage = chunk.usage
                    if not chunk.choices:
                        details = usage.prompt_tokens_details if usage else None
                        if details is not None:
                            cached = details.cached_tokens
                        continue
                    choice = chunk.choices[0]
                    delta = choice.delta
                    text = (delta.content if delta is not None else choice.text) or ""
                    # vLLM's continuous usage gives exact counts; other servers send one a chunk.
                    total = usage.completion_tokens if usage else generated + (1 if text else 0)
                    out = TokenDelta(
                        text=text,
                        tokens=total - generated,
                        prompt_tokens=usage.prompt_tokens if usage else 0,
                        finish_reason=choice.finish_reason,
                    )
                    generated = total
                    if choice.finish_reason is None:
                        yield out
                    else:
                        last = out
            except OSError:  # TimeoutError included
                if last is None:
                    raise
                # The answer was whole: only what follows its end (the usage chunk, [DONE]) is
                # lost, as it was before the last delta waited for them.
            if last is None:
                raise EngineError(f"{self.config.name}: the stream ended before the answer did")
            yield last if cached is None else replace(last, cached_tokens=cached)
        except msgspec.DecodeError as exc:
            raise EngineError(f"{self.config.name}: a chunk that is not JSON: {exc}") from exc
        except TimeoutError as exc:
            # One slow stream is this request's failure, not proof that the server is gone.
            raise EngineError(
                f"{self.config.name}: no output from {self.config.url} in time"
            ) from exc
        except OSError as exc:  # the connection ended (UpstreamClosed) or broke
            if held.stalled:  # one slow stream, not proof that the server is gone
                raise EngineError(
                    f"{self.config.name}: no output from {self.config.url} in time"
                ) from exc
            if request.request_id not in self._open:  # `abort` closed it
                raise EngineError(f"{self.config.name}: aborted") from exc
            self._healthy = False  # until the supervisor's probe finds it
            raise UpstreamLost(f"{self.config.name}: lost {self.config.url}: {exc!r}") from exc
        finally:
            self._open.pop(request.request_id, None)
            if held.response is not None:
                # Read to its end, its connection goes back to the pool; else it is closed, and
                # vllm serve aborts a request whose connection closes.
                held.response.release()

    async def _start(self, request: Request, sampling: Sampling) -> UpstreamResponse:
        """Send the request. Failures here mean the server never took it, so another may."""
        chat = isinstance(request.prompt, tuple)
        body: dict[str, Any] = {
            "model": self.config.served_name,
            "max_tokens": request.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop": list(sampling.stop) or None,
            "seed": sampling.seed,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": sampling.ignore_eos,
        }
        if sampling.min_tokens:  # vLLM refuses more than max_tokens
            body["min_tokens"] = min(sampling.min_tokens, request.max_tokens or sampling.min_tokens)
        if isinstance(request.prompt, tuple):
            body["messages"] = [{"role": m.role, "content": m.content} for m in request.prompt]
        elif isinstance(request.prompt, TokenIds):
            body["prompt"] = list(request.prompt.ids)
        else:
            body["prompt"] = request.prompt
        path = self._path + ("/chat/completions" if chat else "/completions")
        headers = {"content-type": "application/json", "x-request-id": request.request_id}
        try:
            async with asyncio.timeout(self._read_timeout_s):
                response = await self._upstream.post(path, _encode(body), headers)
        except TimeoutError:
            raise
        except OSError as exc:
            self._healthy = False  # until the supervisor's probe finds it
            raise EngineUnavailable(f"{self.config.name}: cannot reach {self.config.url}") from exc
        if response.status == 200:
            return response
        try:
            async with asyncio.timeout(self._read_timeout_s):
                error = json.loads(await response.body())
        except (OSError, ValueError):  # TimeoutError is an OSError
            error = {}
        finally:
            response.release()
        inner = error.get("error", error) if isinstance(error, dict) else {}
        message = _text(inner) or f"{self.config.url} answered {response.status}"
        if response.status == 400:
            param = inner.get("param") if isinstance(inner, dict) else None
            raise InvalidRequest(message, param if isinstance(param, str) else None)
        if response.status == 503:  # busy or draining: it did not take the request
            raise EngineUnavailable(f"{self.config.name}: {message}")
        raise EngineError(f"{self.config.name}: {response.status}: {message}")

    async def abort(self, request_id: str) -> None:
        held = self._open.pop(request_id, None)
        if held is not None and held.response is not None:
            held.response.close()  # vllm serve aborts a request whose connection closes

    def healthy(self) -> bool:
        return self._healthy

    def unfinished(self) -> int:
        return len(self._open)

    def load(self) -> UpstreamLoad | None:
        return self._load

    async def close(self) -> None:
        self._healthy = False
        for task in (self._watch, self._scrape):
            if task is not None:
                task.cancel()
        self._upstream.close()
        if self._session is not None:
            await self._session.close()


def _text(error: Any) -> str:
    """The message of an OpenAI-shaped error object, where it has one."""
    if isinstance(error, dict):
        message = error.get("message")
        if isinstance(message, str):
            return message
    return ""
