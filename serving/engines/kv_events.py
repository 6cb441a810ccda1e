"""vLLM's KV cache events, heard over ZMQ and told in the router's own block hashes.

A `vllm serve` started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557"}'` publishes, on a ZMQ PUB socket, each batch of its block
pool's events as three frames (topic, an 8-byte big-endian sequence number, a msgpack
`KVEventBatch`): BlockStored (hashes, their parent's hash, the token ids of those blocks),
BlockRemoved (hashes) and AllBlocksCleared (vllm/distributed/kv_events.py). The decoding
structs below are ours, not vLLM's: a gateway runs without vLLM installed, and msgspec skips
the fields they do not name.

vLLM names a block by a sha256 chain over its tokens and a per-process random seed, which a
gateway cannot compute. So `Rehasher` re-hashes each stored block's tokens with the router's
own chain (`router.kv_cache.block_hashes`), from its parent's re-hashed name, and keeps vLLM's
name -> ours for the removals. A block whose parent it never heard of (events from before it
subscribed, or dropped) cannot be named, nor can any block after it: the index holds only what
it can match, which costs hits, never wrong routing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from router.kv_cache import REMOVED, ROOT, STORED, block_hashes

log = logging.getLogger(__name__)

Hash = int | bytes
"""vLLM's ExternalBlockHash."""
GPU_TIERS = (None, "GPU")
"""Events of the engine's own cache (the CPU build's pass this filter: tests/test_remote.py
hears them); those of an offload tier (CPU, storage) are not what a prompt finds without
loading."""


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_decode = msgspec.msgpack.Decoder(_Batch).decode


class Rehasher:
    """Turns one engine's event batches into the router's (`hear(kind, hashes)`), sans I/O.
    `block_size`: the router's hash block (`Deployment.hash_block`), which the engine's block
    size is a multiple of: each of the engine's blocks is named as that many of the router's."""

    def __init__(self, block_size: int, hear: Callable[[str, list[int]], None]) -> None:
        self.block_size = block_size
        self.hear = hear
        self.ours: dict[Hash, tuple[int, ...]] = {}
        """vLLM's name of each block it holds -> the router's names of its tokens' blocks."""
        self.unmatched = 0
        """Stored blocks that could not be named: an unknown parent, a block size that is not
        a multiple of the router's."""

    def batch(self, payload: bytes) -> None:
        for event in _decode(payload).events:
            if isinstance(event, _Cleared):
                self.hear(REMOVED, [h for named in self.ours.values() for h in named])
                self.ours.clear()
            elif event.medium not in GPU_TIERS:
                continue
            elif isinstance(event, _Removed):
                popped = (self.ours.pop(h, ()) for h in event.block_hashes)
                gone = [h for named in popped for h in named]
                if gone:
                    self.hear(REMOVED, gone)
            else:
                self._stored(event)

    def _stored(self, event: _Stored) -> None:
        size, theirs = event.block_size, event.block_hashes
        parent: int | None = ROOT
        if event.parent_block_hash is not None:
            known = self.ours.get(event.parent_block_hash)
            parent = known[-1] if known else None
        if parent is None or size % self.block_size:
            self.unmatched += len(theirs)
            return
        per = size // self.block_size
        named = block_hashes(event.token_ids[: len(theirs) * size], self.block_size, parent)
        named = named[: len(named) // per * per]  # whole engine blocks only
        for i, name in enumerate(theirs[: len(named) // per]):
            self.ours[name] = named[i * per : (i + 1) * per]
        if named:
            self.hear(STORED, list(named))


async def subscribe(endpoint: str, rehasher: Rehasher, name: str) -> None:
    """Feed `rehasher` every batch published at `endpoint`, until cancelled. A gap in the
    sequence numbers (the publisher's high-water mark dropped some) is logged: the blocks it
    named stay unmatched, or stay in the index until a later removal or clear."""
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    log.info("%s: hearing its KV cache events at %s", name, endpoint)
    last = -1
    try:
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                continue
            seq = int.from_bytes(frames[1], "big")
            if last >= 0 and seq != last + 1:
                log.warning("%s: missed %d KV event batches", name, seq - last - 1)
            last = seq
            try:
                rehasher.batch(frames[2])
            except msgspec.DecodeError as exc:
                log.warning("%s: a KV event batch that does not decode: %s", name, exc)
    finally:
        socket.close()
