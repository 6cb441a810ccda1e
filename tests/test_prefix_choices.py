"""benchmarks.prefix_choices on hand-written run files: the replica each request was served by
comes from vLLM's log, by the id a peer passes on or the one our gateway sent; each later turn
stayed or moved; and the paired table compares the same request's two placements."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.prefix_choices import FIRST, MOVED, STAYED, report, runs


def outcome(request_id: str, response_id: str, cached: int, ttft_s: float) -> dict:
    return {"request_id": request_id, "response_id": response_id, "error_kind": None,
            "prompt_tokens": 1000, "cached_tokens": cached, "ttft_s": ttft_s}  # fmt: skip


def logged(request_ids: list[str]) -> str:
    return "".join(
        f"(APIServer pid=1) INFO [request_logger.py:65] Received request {r}: params: x\n"
        for r in request_ids
    )


def test_each_turn_is_placed_by_vllms_log_and_paired_with_the_other_gateways(
    tmp_path: Path,
) -> None:
    # A peer passes vLLM's ids on; ours sent its own, which vLLM logs after "chatcmpl-".
    ours = "chatcmpl-chatcmpl-o"
    (tmp_path / "vllm-serve-0.log").write_text(logged(["chatcmpl-a0", "chatcmpl-a1", ours + "0"]))
    (tmp_path / "vllm-serve-1.log").write_text(logged(["chatcmpl-a2", ours + "1", ours + "2"]))
    peer = [outcome("c0t0", "chatcmpl-a0", 0, 0.1), outcome("c0t1", "chatcmpl-a1", 900, 0.05),
            outcome("c0t2", "chatcmpl-a2", 0, 0.3)]  # fmt: skip
    mine = [outcome("c0t0", "chatcmpl-o0", 0, 0.1), outcome("c0t1", "chatcmpl-o1", 0, 0.2),
            outcome("c0t2", "chatcmpl-o2", 950, 0.05)]  # fmt: skip
    (tmp_path / "sglang-router-0.json").write_text(json.dumps({"requests": peer}))
    (tmp_path / "ours-precise-0.json").write_text(json.dumps({"requests": mine}))
    found = runs(tmp_path)
    assert [(c.replica, c.kind) for c in found["sglang-router", 0]] == [
        (0, FIRST), (0, STAYED), (1, MOVED)
    ]  # fmt: skip
    assert [(c.replica, c.kind) for c in found["ours-precise", 0]] == [
        (0, FIRST), (1, MOVED), (1, STAYED)
    ]  # fmt: skip
    table = report(found, "ours-precise")
    # Turn 1: ours moved, the peer stayed and found 900 more tokens, 150 ms sooner; of the
    # whole difference, +100 ms, that is -1.5 times.
    assert "| sglang-router | moved | stayed | 1 | +900 ± nan | -150 ± nan | -1.50 |" in table
    assert "| sglang-router | stayed | moved | 1 | -950 ± nan | +250 ± nan | +2.50 |" in table
