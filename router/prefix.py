"""Prefix-aware routing: send a request where its prompt's KV cache already is.

Three ways to know where that is, each behind the `Policy` interface (and, to compare with,
sglang-router's own, `SglangCacheAware`):
- `PrefixHash`: KubeAI's consistent hashing with bounded loads. It never knows; it sends every
  request of a conversation to one place, so that the cache builds up there.
- `PrefixAffinity` with an approximate `PrefixIndex`, kept from the router's own decisions: a
  request's blocks are taken to be cached where it was sent (SGLang's and vllm-router's
  `cache_aware`, the vLLM production stack's prefix router), and forgotten least recently used
  first once a replica's share exceeds its KV cache.
- `PrefixAffinity` with a precise index, kept from the engines' own KV events: blocks stored and
  removed (llm-d's precise prefix-cache scorer, Dynamo's KV router).

Both affinity policies take, among the replicas within the load bound, the one holding the
longest cached prefix of the request's prompt (`Request.blocks`), the least loaded on ties and
where none holds any. The bound is KubeAI's, with room added at light load: load + 1 <=
ceil((total + 1) / replicas x load_factor) + SLACK, over the replicas of the request's model.

Where the request may go to several models, these policies do not choose among them: they take
the best model for its task that it may use, as a client that names a model would. With the
learned router, the DQN chooses the model and one of these the replica
(`router.policies.ModelThenReplica`).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import xxhash

from router.kv_cache import REMOVED
from router.text_tree import TextTree
from router.view import ClusterView
from workloads import Request, TokenIds

Quality = Mapping[str, Mapping[str, float]]
"""task -> model -> quality."""


def model_for(request: Request, view: ClusterView, quality: Quality | None) -> str:
    """The model a prefix policy routes `request` to: the only one it may use, else the best
    for its task among those it may use (by mean quality where the task is unknown)."""
    models = list(dict.fromkeys(r.model for r in view.replicas if r.available))
    if not models:
        raise ValueError("no replica is available")
    if len(models) == 1 or not quality:
        return models[0]
    row = quality.get(request.task or "")
    if row is None:
        return max(models, key=lambda m: sum(r.get(m, 0.0) for r in quality.values()))
    return max(models, key=lambda m: row.get(m, 0.0))


SLACK = 8
"""Requests a replica may run past the multiplicative bound before a request leaves its cached
prefix (`PrefixAffinity`). At light load ceil(mean x 1.25) is a handful: with 2 replicas and 4
requests in flight it is 3, and a conversation's next turn left its cache as soon as its holder
ran one more than the other. There one more request in a batch costs a few percent of a step,
and a cache miss a whole prefill. At heavy load the x 1.25 dominates (125 + 8 at 100 a
replica). Chosen by a sweep of 0, 4, 8, 16 and 32 on seed 003's workload and its Zipf variant
in the simulator (docs/results/prefix-aware.md)."""


def within_bound(
    view: ClusterView, model: str, load_factor: float, slack: int = 0
) -> tuple[list[int], int]:
    """The available replicas of `model`, and the most requests one may run after taking this
    one: ceil((total + 1) / replicas x load_factor) + slack, which some replica always meets."""
    mine = [i for i, r in enumerate(view.replicas) if r.available and r.model == model]
    total = sum(view.replicas[i].running for i in mine)
    return mine, math.ceil((total + 1) / len(mine) * load_factor) + slack


class PrefixHash:
    """KubeAI's PrefixHash: consistent hashing with bounded loads (Mirrokni et al.),
    one ring per model.

    The key is the first `prefix_chars` characters of the first user message, so every turn of a
    conversation maps to the same point on its model's ring of `replication` virtual nodes per
    replica. From there the walk takes the first available replica whose load stays within the
    bound (`within_bound`). Hashes are xxHash64, as KubeAI's."""

    def __init__(
        self,
        replicas: Sequence[str],
        models: Sequence[str] | None = None,
        quality: Quality | None = None,
        prefix_chars: int = 100,
        replication: int = 256,
        load_factor: float = 1.25,
    ) -> None:
        """`replicas` by name and `models` (each replica's; default: all of one model)."""
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self.quality = quality
        models = models or [""] * len(replicas)
        self._rings: dict[str, tuple[list[int], list[int]]] = {}
        for model in dict.fromkeys(models):
            points = sorted(
                (xxhash.xxh64_intdigest(f"{name}{i}".encode()), index)
                for index, (name, m) in enumerate(zip(replicas, models, strict=True))
                if m == model
                for i in range(replication)
            )
            self._rings[model] = ([h for h, _ in points], [index for _, index in points])

    def key(self, request: Request) -> str:
        if isinstance(request.prompt, str):
            return request.prompt[: self.prefix_chars]
        if isinstance(request.prompt, TokenIds):  # a token is a few characters: 1 in 4 will do
            return ",".join(map(str, request.prompt.ids[: self.prefix_chars // 4]))
        first = next((m.content for m in request.prompt if m.role == "user"), "")
        return first[: self.prefix_chars]

    def choose(
        self, obs: np.ndarray, request: Request, view: ClusterView, model: str | None = None
    ) -> int:
        """`model`: route among its replicas (default: `model_for`'s choice)."""
        model = model or model_for(request, view, self.quality)
        _, bound = within_bound(view, model, self.load_factor)
        hashes, owners = self._rings[model if model in self._rings else ""]
        start = bisect.bisect(hashes, xxhash.xxh64_intdigest(self.key(request).encode()))
        n = len(hashes)
        replicas = view.replicas
        for step in range(n):
            index = owners[(start + step) % n]
            if replicas[index].available and replicas[index].running + 1 <= bound:
                return index
        raise AssertionError("unreachable: the least loaded available replica is within bound")


class PrefixIndex:
    """Which replicas hold each block: block hash -> a bit per replica.

    Fed either by the router's own decisions (`routed`: approximate, each replica's share
    bounded by `capacity` blocks, least recently routed forgotten first) or by the engines' KV
    events (`event`: precise)."""

    def __init__(self, replicas: int, capacity: Sequence[int | None] | None = None) -> None:
        self.replicas = replicas
        self._holders: dict[int, int] = {}
        self._capacity = list(capacity) if capacity is not None else [None] * replicas
        self._recent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]

    def __len__(self) -> int:
        return len(self._holders)

    def held_by(self, replica: int) -> set[int]:
        bit = 1 << replica
        return {h for h, mask in self._holders.items() if mask & bit}

    def match(
        self, blocks: Sequence[int], candidates: Sequence[int], also: PrefixIndex | None = None
    ) -> dict[int, int]:
        """How many leading blocks of `blocks` each candidate holds (here, or in `also`)."""
        want = 0
        for i in candidates:
            want |= 1 << i
        depth = dict.fromkeys(candidates, 0)
        alive = want
        holders = self._holders
        more = also._holders if also is not None else {}
        for n, h in enumerate(blocks):
            still = alive & (holders.get(h, 0) | more.get(h, 0))
            if still != alive:
                for i in candidates:
                    if alive & ~still & (1 << i):
                        depth[i] = n
                alive = still
            if not alive:
                return depth
        for i in candidates:
            if alive & (1 << i):
                depth[i] = len(blocks)
        return depth

    def event(self, replica: int, kind: str, blocks: Sequence[int]) -> None:
        """A replica's engine stored or removed `blocks` (vLLM's BlockStored, BlockRemoved)."""
        bit = 1 << replica
        holders = self._holders
        if kind == REMOVED:
            for h in blocks:
                mask = holders.get(h, 0) & ~bit
                if mask:
                    holders[h] = mask
                else:
                    holders.pop(h, None)
        else:
            for h in blocks:
                holders[h] = holders.get(h, 0) | bit

    def routed(self, replica: int, blocks: Sequence[int]) -> None:
        """A request with `blocks` was sent to `replica`: take them to be cached there."""
        if not blocks:
            return
        recent = self._recent[replica]
        for h in reversed(blocks):  # a prompt's head last, so forgotten last, as vLLM frees
            recent[h] = None
            recent.move_to_end(h)
        self.event(replica, "stored", blocks)
        capacity = self._capacity[replica]
        if capacity is not None and len(recent) > capacity:
            gone = [recent.popitem(last=False)[0] for _ in range(len(recent) - capacity)]
            self.event(replica, REMOVED, gone)


BALANCE, MATCH, LEAST, GONE = "balance", "match", "least-loaded", "holder-gone"
"""The rules of `SglangCacheAware.decide`."""


def routing_text(request: Request) -> str:
    """The text sglang-router matches a request by: a chat's message contents joined by single
    spaces (no roles, no template), a completion's prompt, or token ids as decimals joined by
    spaces (its /generate's `input_ids`)."""
    if isinstance(request.prompt, str):
        return request.prompt
    if isinstance(request.prompt, TokenIds):
        return " ".join(map(str, request.prompt.ids))
    return " ".join(m.content for m in request.prompt if m.content)


class SglangCacheAware:
    """sglang-router's `cache_aware` (sgl-model-gateway 0.3.2, `src/policies/cache_aware.rs`),
    with its launcher's defaults, to compare ours with at scales real engines cannot reach here.

    Over the available replicas of the request's model, load being the requests dispatched and
    not finished (the router's own count, as `ReplicaState.running` is):
    - if max - min > `balance_abs` and max > min x `balance_rel` (both strict), the least
      loaded, first on ties;
    - else, if the longest prefix any replica holds in the model's `TextTree` covers more than
      `cache_threshold` of the request's characters (`routing_text`), the replica that
      created that prefix, however loaded;
    - else the least loaded, first on ties.
    The request's text is then inserted for the replica chosen. Every `eviction_interval_s` of
    arrivals, each replica's share of the tree is trimmed to `max_tree_chars`.

    One departure: sglang's "first" worker is first in an order its registry draws at start
    (a map keyed by random ids); here it is the first listed, unless `order` gives another."""

    def __init__(
        self,
        quality: Quality | None = None,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        eviction_interval_s: float = 60.0,
        max_tree_chars: int = 2**26,
        order: Sequence[int] | None = None,
    ) -> None:
        self.quality = quality
        # Compared in single precision, as its Rust does: 0.3 is 0.30000001 there.
        self.cache_threshold = np.float32(cache_threshold)
        self.balance_abs = balance_abs
        self.balance_rel = np.float32(balance_rel)
        self.eviction_interval_s = eviction_interval_s
        self.max_tree_chars = max_tree_chars
        self.order = order
        self.trees: dict[str, TextTree] = {}
        self._evicted_at: float | None = None

    def choose(
        self, obs: np.ndarray, request: Request, view: ClusterView, model: str | None = None
    ) -> int:
        """`model`: route among its replicas (default: `model_for`'s choice)."""
        model = model or model_for(request, view, self.quality)
        replicas = view.replicas
        listed = self.order if self.order is not None else range(len(replicas))
        workers = [i for i in listed if replicas[i].available and replicas[i].model == model]
        tree = self.trees.setdefault(model, TextTree())
        self._evict(request.arrival)
        text = routing_text(request)
        best, why = self.decide(tree, text, workers, [replicas[i].running for i in workers])
        if why != GONE:
            tree.insert(text, best)
        return best

    def decide(
        self, tree: TextTree, text: str, workers: Sequence[int], loads: Sequence[int]
    ) -> tuple[int, str]:
        """The replica among `workers` (in tie-break order, with their `loads`) for `text`,
        and which rule chose it: BALANCE, MATCH, LEAST or GONE (the match's holder is not
        among them: it is forgotten and the first taken, and nothing is inserted)."""
        least = workers[loads.index(min(loads))]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs and np.float32(high) > np.float32(low) * self.balance_rel:
            return least, BALANCE
        matched, holder = tree.match(text)
        rate = np.float32(matched) / np.float32(len(text)) if text else np.float32(0.0)
        if rate <= self.cache_threshold:
            return least, LEAST
        if holder is None:  # no tenant at the node reached: sglang's "empty"
            return workers[0], GONE
        if holder in workers:
            return holder, MATCH
        tree.remove(holder)
        return workers[0], GONE

    def _evict(self, now: float) -> None:
        if self._evicted_at is None:
            self._evicted_at = now
        elif self.eviction_interval_s and now - self._evicted_at >= self.eviction_interval_s:
            self._evicted_at = now
            for tree in self.trees.values():
                tree.evict(self.max_tree_chars)


PENDING_BLOCKS = 4096
"""Blocks per replica the precise policy remembers having sent there before the engine said it
stored them: a bound for those it never will (a recomputed copy, a request aborted first)."""


class PrefixAffinity:
    """The replica within the load bound that holds the longest cached prefix of the prompt
    (module docstring). `precise`: the index is fed by the engines' KV events (`event`, called
    by whoever holds this policy); otherwise the policy feeds it from its own decisions.

    A precise index alone is blind to what was sent but not yet stored: a request waits in the
    engine's queue before its blocks are computed, and meanwhile the next turn of its
    conversation would find nothing. So the precise policy also remembers the blocks it sent
    (`pending`) until the engine reports them stored, as Dynamo's KV router counts a request's
    blocks on its worker from the moment it routes it."""

    def __init__(
        self,
        index: PrefixIndex,
        precise: bool,
        quality: Quality | None = None,
        load_factor: float = 1.25,
        slack: int = SLACK,
    ) -> None:
        self.index = index
        self.precise = precise
        self.quality = quality
        self.load_factor = load_factor
        self.slack = slack
        replicas = index.replicas
        self.pending = PrefixIndex(replicas, [PENDING_BLOCKS] * replicas) if precise else None

    def event(self, replica: int, kind: str, blocks: Sequence[int]) -> None:
        """A replica's engine stored or removed `blocks`."""
        self.index.event(replica, kind, blocks)
        if self.pending is not None and kind != REMOVED:
            self.pending.event(replica, REMOVED, blocks)

    def choose(
        self, obs: np.ndarray, request: Request, view: ClusterView, model: str | None = None
    ) -> int:
        """`model`: route among its replicas (default: `model_for`'s choice)."""
        model = model or model_for(request, view, self.quality)
        mine, bound = within_bound(view, model, self.load_factor, self.slack)
        replicas = view.replicas
        fits = [i for i in mine if replicas[i].running + 1 <= bound]
        blocks = request.blocks or ()
        depth = self.index.match(blocks, fits, self.pending) if blocks else dict.fromkeys(fits, 0)
        best = max(fits, key=lambda i: (depth[i], -replicas[i].running))
        if self.pending is None:
            self.index.routed(best, blocks)
        elif blocks:  # what neither the engine nor an earlier sending holds yet
            self.pending.routed(best, blocks[depth[best] :])
        return best
