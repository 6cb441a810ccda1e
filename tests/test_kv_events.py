"""vLLM's KV cache events, as they come over the wire, re-hashed into the router's block names.

The payloads are vLLM's wire form (an array-like KVEventBatch of tagged map events), written
out here; tests/test_remote.py hears a real `vllm serve`'s."""

from __future__ import annotations

import random

import msgspec

from config import load_deployment
from router.kv_cache import REMOVED, STORED, block_hashes
from router.prefix import PrefixAffinity
from serving.app import build_app
from serving.engines.kv_events import Rehasher

ENGINE_BLOCK, HASH_BLOCK = 32, 16
IDS = [random.Random(3).randrange(50_000) for _ in range(200)]


def stored(theirs: list[bytes], parent: bytes | None, ids: list[int], medium: str = "GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": theirs, "parent_block_hash": parent,
            "token_ids": ids, "block_size": ENGINE_BLOCK, "lora_id": None, "medium": medium,
            "lora_name": None, "group_idx": 0}  # fmt: skip


def batch(*events: dict) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events)])


def rehasher() -> tuple[Rehasher, list[tuple[str, list[int]]]]:
    heard: list[tuple[str, list[int]]] = []
    return Rehasher(HASH_BLOCK, lambda kind, hashes: heard.append((kind, hashes))), heard


def test_stored_blocks_get_the_names_the_gateway_hashes_a_prompt_with() -> None:
    mine = block_hashes(IDS, HASH_BLOCK)  # what the gateway counted before routing
    events, heard = rehasher()
    # Two of the engine's blocks, then two more chained on the second (a later turn's), under
    # vLLM's own names, which are nothing like ours.
    events.batch(batch(stored([b"a", b"b"], None, IDS[:64])))
    events.batch(batch(stored([b"c", b"d"], b"b", IDS[64:128])))
    assert heard == [(STORED, list(mine[:4])), (STORED, list(mine[4:8]))]
    events.batch(batch({"type": "BlockRemoved", "block_hashes": [b"d", b"zz"], "medium": "GPU"}))
    assert heard[-1] == (REMOVED, list(mine[6:8]))
    events.batch(batch({"type": "AllBlocksCleared"}))
    assert heard[-1][0] == REMOVED and sorted(heard[-1][1]) == sorted(mine[:6])
    assert events.ours == {}


def test_what_cannot_be_named_is_left_out() -> None:
    events, heard = rehasher()
    events.batch(batch(stored([b"x"], b"never-heard", IDS[32:64])))  # joined after its parent
    events.batch(batch(stored([b"y"], None, IDS[:32], medium="CPU")))  # an offload tier's
    partial = stored([b"z"], None, IDS[:20])  # fewer tokens than a block
    events.batch(batch(partial))
    assert heard == [] and events.unmatched == 1


def test_the_precise_index_hears_its_engines_with_the_dqn_choosing_the_model() -> None:
    """`dqn+prefix-precise` on the twin: the replica policy's index is fed by every engine."""
    twin = load_deployment(name="paper-4gpu-sim")
    app = build_app(twin, "dqn+prefix-precise")
    policy = app.state.gateway.policy
    assert isinstance(policy.replica_policy, PrefixAffinity)
    engines = [replica.engine for replica in app.state.gateway.replicas]
    assert engines and all(e._batch.kv.on_event is not None for e in engines)
