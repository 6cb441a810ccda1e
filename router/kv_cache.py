"""One replica's KV cache in blocks, with vLLM's automatic prefix caching, without a clock.

A prompt is cut into blocks of `block_size` tokens, and each full block is named by a chained
hash of its tokens and its parent block's hash (`block_hashes`), as vLLM names them
(vllm/v1/core/kv_cache_utils.py, `hash_block_tokens`): two prompts share a block's hash exactly
where they share every token up to that block's end. A request holds its blocks while it runs.
A full prompt block stays cached when the last request holding it ends, idle, until a new block
needs its room: idle blocks are reclaimed least recently used first, and a request's last blocks
are first in that line, as vLLM frees them. A request that finds the leading blocks of its prompt
cached holds them too, and computes only the rest.

What is left out: output tokens' blocks are never found by later prompts (a later turn re-sends
an answer as text, under the chat template's framing, not as the ids that were generated), and
hashes ignore LoRA and multimodal keys, which no workload here has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

ROOT = 0
"""The parent hash of a prompt's first block."""

STORED, REMOVED = "stored", "removed"
"""What a cache event says of its blocks: vLLM's BlockStored and BlockRemoved."""


def block_hashes(ids: Sequence[int], block_size: int, parent: int = ROOT) -> tuple[int, ...]:
    """The chained hash of each full block of `ids`, the first block's parent `parent` (ROOT:
    `ids` start a prompt). xxHash64 where vLLM takes sha256: an index
    of vLLM's blocks re-hashes the token ids its events carry with this same function, so it
    need not match vLLM's choice, and this is ten times faster in the simulator's hot path."""
    data = np.asarray(ids, dtype=np.int64)
    out = []
    for start in range(0, len(data) - block_size + 1, block_size):
        parent = xxhash.xxh64_intdigest(data[start : start + block_size].tobytes(), parent)
        out.append(parent)
    return tuple(out)


class Hold:
    """The blocks one request holds."""

    __slots__ = ("hashes", "private")

    def __init__(self, hashes: list[int], private: int) -> None:
        self.hashes = hashes
        """Cached prompt blocks it holds a reference on, in prompt order."""
        self.private = private
        """Blocks only it holds: its output, and the tail of its prompt that fills no block."""


class KvCache:
    """A replica's KV blocks: those held by running requests, cached ones that none holds
    (idle), and free ones. Held plus idle never exceeds `capacity`."""

    def __init__(
        self,
        capacity: int,
        block_size: int,
        on_event: Callable[[str, list[int]], None] | None = None,
    ) -> None:
        """`capacity` in blocks. `on_event(kind, hashes)`, if given, hears every block that
        enters the cache (STORED) and every one that leaves it (REMOVED), as vLLM publishes
        them for a KV-aware router."""
        if capacity <= 0 or block_size <= 0:
            raise ValueError(f"a KV cache needs blocks, got {capacity} of {block_size} tokens")
        self.capacity = capacity
        self.block_size = block_size
        self.on_event = on_event
        self.held = 0
        """Blocks some request holds."""
        self._refs: dict[int, int] = {}
        """Every cached block's hash -> how many requests hold it."""
        self._idle: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request holds, least recently used first."""

    def fork(self) -> KvCache:
        """A copy that goes on apart and tells no one of its blocks."""
        kv = KvCache(self.capacity, self.block_size)
        kv.held = self.held
        kv._refs = dict(self._refs)
        kv._idle = OrderedDict(self._idle)
        return kv

    @property
    def free(self) -> int:
        """Blocks neither held nor cached."""
        return self.capacity - self.held - len(self._idle)

    @property
    def idle(self) -> int:
        """Cached blocks no request holds: reclaimed, least recently used first, when a new
        block finds none free."""
        return len(self._idle)

    @property
    def cached(self) -> int:
        """Blocks whose contents a later prompt may find."""
        return len(self._refs)

    def __contains__(self, block: int) -> bool:
        return block in self._refs

    def hashes(self) -> set[int]:
        """Every cached block: what an exact index of this replica holds."""
        return set(self._refs)

    def prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are cached."""
        found = 0
        for h in hashes:
            if h not in self._refs:
                break
            found += 1
        return found

    def hold(self, hashes: Sequence[int], blocks: int, lookup: int) -> tuple[Hold, int] | None:
        """Hold `blocks` blocks for a request whose prompt's full blocks hash to `hashes`: the
        cached ones among the first `lookup` of them shared, the rest new (reclaiming idle
        blocks as needed), and its new full prompt blocks cached. Returns what it holds and how
        many leading blocks it found cached; None, changing nothing, if they do not fit."""
        hit = self.prefix(hashes[:lookup])
        reused = sum(1 for h in hashes[:hit] if self._refs[h] == 0)
        if blocks - hit > self.free + len(self._idle) - reused:
            return None
        for h in hashes[:hit]:
            self._take(h)
        stored: list[int] = []
        held = list(hashes[:hit])
        private = blocks - hit
        for h in hashes[hit:]:
            count = self._refs.get(h)
            if count:  # another request computes the same block: this copy is not cached
                continue
            if count == 0:  # a stale copy whose parent was reclaimed: the new one replaces it
                del self._idle[h]
                del self._refs[h]
            self._make_room()
            self._refs[h] = 1
            self.held += 1
            private -= 1
            held.append(h)
            stored.append(h)
        for _ in range(private):
            self._make_room()
            self.held += 1
        if stored and self.on_event is not None:
            self.on_event(STORED, stored)
        return Hold(held, private), hit

    def extend(self, hold: Hold) -> bool:
        """One more private block for `hold` (its output grew past a block): False, changing
        nothing, if there is no room."""
        if self.free == 0 and not self._idle:
            return False
        self._make_room()
        self.held += 1
        hold.private += 1
        return True

    def release(self, hold: Hold) -> None:
        """A request lets go of its blocks. Its cached blocks that no one else holds stay
        cached, idle, its last ones first in line to be reclaimed; the rest are free."""
        self.held -= hold.private
        for h in reversed(hold.hashes):
            left = self._refs[h] - 1
            self._refs[h] = left
            if left == 0:
                self.held -= 1
                self._idle[h] = None
        hold.hashes, hold.private = [], 0

    def clear(self) -> None:
        """Forget every cached block, as an engine that dies loses its cache (vLLM's
        AllBlocksCleared, told as each block removed). Only once no request holds any."""
        if self.held:
            raise RuntimeError(f"{self.held} blocks are still held: release them first")
        gone = list(self._refs)
        self._refs.clear()
        self._idle.clear()
        if gone and self.on_event is not None:
            self.on_event(REMOVED, gone)

    def _take(self, h: int) -> None:
        if self._refs[h] == 0:
            del self._idle[h]
            self.held += 1
        self._refs[h] += 1

    def _make_room(self) -> None:
        """Free one block if none is: reclaim the least recently used idle one."""
        if self.free > 0:
            return
        h, _ = self._idle.popitem(last=False)
        del self._refs[h]
        if self.on_event is not None:
            self.on_event(REMOVED, [h])
