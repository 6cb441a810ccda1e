"""`python -m benchmarks.prefix_choices FOLDER`: where prefix-aware gateways' choices differ on
the same requests, and what each choice cost, from a `benchmarks.prefix_gateways` run's files.

Each request of `workloads.replay`'s record (FOLDER/GATEWAY-ROUND.json) is a conversation's turn
(`c3t2`: conversation 3, turn 2). vLLM says what the request found cached in its usage
(`prompt_tokens_details.cached_tokens`), and which replica served it in its log
(FOLDER/vllm-serve-N.log, `--enable-log-requests`), by the id in the answer's chunks: vLLM's,
which a peer gateway passes on, or ours, which our gateway sent vLLM as its x-request-id (which
vLLM logs after `chatcmpl-`). A
later turn either *stays* on the replica of the conversation's turn before, where its history
may be cached, or *moves*. Reported per gateway: how often each, with the cached share of the
prompt and the mean TTFT; then, request by request in the same round, each gateway against
`--against`, split by what each chose, with the mean difference in cached tokens and TTFT and
each cell's share of the whole TTFT difference.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from experiments.stable import interval

FIRST, STAYED, MOVED = "first", "stayed", "moved"
RECEIVED = re.compile(r"Received request (\S+?):")
TURN = re.compile(r"^(.*)t(\d+)$")


def turn_of(request_id: str) -> tuple[str, int]:
    """`c3t2` -> ("c3", 2): its conversation and turn."""
    found = TURN.match(request_id)
    if found is None:
        raise ValueError(f"{request_id!r} is no conversation's turn")
    return found[1], int(found[2])


@dataclass(frozen=True)
class Choice:
    """One request as a gateway placed it."""

    request_id: str
    replica: int
    kind: str
    """FIRST, STAYED or MOVED."""
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float


def served_by(folder: Path) -> dict[str, int]:
    """Each request id vLLM logged -> the replica (N of vllm-serve-N.log) that logged it."""
    where: dict[str, int] = {}
    for log in folder.glob("vllm-serve-*.log"):
        replica = int(log.stem.rsplit("-", 1)[1])
        for line in log.read_text(errors="replace").splitlines():
            if (found := RECEIVED.search(line)) is not None:
                where[found.group(1)] = replica
    return where


def choices(record: dict, where: dict[str, int]) -> list[Choice]:
    """The completed requests of one run, each with its replica and whether it stayed."""
    placed: dict[str, tuple[int, int, dict]] = {}  # request id -> (replica, turn, its record)
    for r in record["requests"]:
        theirs = r["response_id"] or ""
        replica = where.get(theirs, where.get("chatcmpl-" + theirs))
        if r["error_kind"] is None and replica is not None:
            placed[r["request_id"]] = (replica, turn_of(r["request_id"])[1], r)
    out = []
    for request_id, (replica, turn, r) in placed.items():
        before = placed.get(f"{turn_of(request_id)[0]}t{turn - 1}")
        kind = FIRST if turn == 0 else STAYED if before and before[0] == replica else MOVED
        if turn and before is None:
            continue  # its turn before failed or was not found: no choice to judge
        out.append(Choice(request_id, replica, kind, r["prompt_tokens"] or 0,
                          r["cached_tokens"] or 0, 1000 * r["ttft_s"]))  # fmt: skip
    return out


def runs(folder: Path) -> dict[tuple[str, int], list[Choice]]:
    """(gateway, round) -> its choices, for every record in `folder`."""
    where = served_by(folder)
    found = {}
    for path in sorted(folder.glob("*-[0-9]*.json")):
        gateway, _, round_ = path.stem.rpartition("-")
        record = json.loads(path.read_text())
        if "requests" in record and round_.isdigit():
            found[gateway, int(round_)] = choices(record, where)
    return found


def report(found: dict[tuple[str, int], list[Choice]], against: str) -> str:
    gateways = list(dict.fromkeys(g for g, _ in found))
    lines = ["Per gateway, over every round: its later turns that stayed on their conversation's",
             "replica or moved; the cached share of their prompts; their mean TTFT.", "",
             "| gateway | requests matched | stayed | moved | cached, stayed | cached, moved "
             "| TTFT stayed / moved / first (ms) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for gateway in gateways:
        mine = [c for (g, _), cs in found.items() if g == gateway for c in cs]
        by = {k: [c for c in mine if c.kind == k] for k in (FIRST, STAYED, MOVED)}

        def share(cs: list[Choice]) -> str:
            prompt = sum(c.prompt_tokens for c in cs)
            return f"{sum(c.cached_tokens for c in cs) / prompt:.2f}" if prompt else "-"

        def ttft(cs: list[Choice]) -> str:
            return f"{np.mean([c.ttft_ms for c in cs]):.0f}" if cs else "-"

        later = len(by[STAYED]) + len(by[MOVED])
        lines.append(f"| {gateway} | {len(mine)} | {len(by[STAYED]) / max(later, 1):.2f} | "
                     f"{len(by[MOVED]) / max(later, 1):.2f} | {share(by[STAYED])} | "
                     f"{share(by[MOVED])} | {ttft(by[STAYED])} / {ttft(by[MOVED])} / "
                     f"{ttft(by[FIRST])} |")  # fmt: skip
    lines += ["", f"Request by request against {against}, in the same round: its choice, the "
              "other's, how many requests, and the other's difference (other - "
              f"{against}) in cached tokens and TTFT, mean ± 95% interval over the requests; "
              "`of total`: the cell's share of the summed TTFT difference.", "",
              f"| gateway | {against} | other | requests | cached tokens | TTFT (ms) | of total |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for gateway in gateways:
        if gateway == against:
            continue
        cells: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
        for (g, round_), theirs in found.items():
            ours = {c.request_id: c for c in found.get((against, round_), [])}
            if g != gateway:
                continue
            for c in theirs:
                if (o := ours.get(c.request_id)) is not None:
                    cells[o.kind, c.kind].append(
                        (c.cached_tokens - o.cached_tokens, c.ttft_ms - o.ttft_ms)
                    )
        total = sum(d for pairs in cells.values() for _, d in pairs)
        for (kind, other_kind), pairs in sorted(cells.items()):
            more_cached = [float(p) for p, _ in pairs]
            slower = [d for _, d in pairs]
            lines.append(f"| {gateway} | {kind} | {other_kind} | {len(pairs)} | "
                         f"{np.mean(more_cached):+.0f} ± {interval(more_cached):.0f} | "
                         f"{np.mean(slower):+.0f} ± {interval(slower):.0f} | "
                         f"{sum(slower) / total if total else 0:+.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="a benchmarks.prefix_gateways --out folder")
    parser.add_argument("--against", default="ours-precise")
    args = parser.parse_args()
    found = runs(args.folder)
    if not found:
        parser.error(f"{args.folder} has no prefix_gateways records (GATEWAY-ROUND.json)")
    table = report(found, args.against)
    (args.folder / "prefix_choices.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
