"""`python -m benchmarks.upstream_kill`: one of three `vllm serve`-shaped upstreams is SIGKILLed
with requests queued in it, under load through our gateway; where did those requests go?

Three null upstreams (`workloads.null_server`: first token at `--first-token-ms`, then one every
`--token-gap-ms`, at most `--max-num-seqs` running, the rest waiting in its queue, as vLLM's
scheduler holds them) behind `python -m serving` with a `remote` deployment, as
`benchmarks.upstream_gateways` runs it. `vllm bench serve` sends `--rate` req/s for
`--duration` s. `--kill-at` s into the load, the upstream whose /metrics shows the most
requests waiting is killed, and stays dead.

Then the client (`vllm bench serve`), the server's /metrics and its request log are reconciled:
every request sent is in each, with one outcome, and every retry the server counted is in the
request log. The requests the dead upstream held are read from the log: those it failed before
their first token were sent on (`retries` names it), and those that had begun streaming ended
in an error event. None should end in a 504 (its deadline spent waiting for a dead server).

    python -m benchmarks.upstream_kill
    python -m benchmarks.upstream_kill --rate 60 --max-num-seqs 4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import ROOT, server_counts, start_upstreams
from benchmarks.upstream_gateways import bench, start_gateway


def waiting(url: str) -> dict[str, float]:
    """Each replica's requests waiting in its server's queue, as the gateway last read them."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "serving_upstream_waiting"
    }


def kill_upstream(url: str) -> None:
    """SIGKILL the null server listening at `url`."""
    port = url.rsplit(":", 1)[1]
    found = subprocess.run(
        ["pgrep", "-f", f"workloads.null_server --port {port} "], capture_output=True, text=True
    )
    for pid in found.stdout.split():
        os.kill(int(pid), signal.SIGKILL)


def run(args: argparse.Namespace) -> dict:
    folder = args.out
    folder.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        paces = [(args.first_token_ms, args.token_gap_ms)] * 3
        urls = start_upstreams(stack, folder, paces, args.max_num_seqs)
        gateway = start_gateway("ours", urls, folder, args)
        assert gateway is not None
        stack.enter_context(gateway)
        result: dict = {}
        load = threading.Thread(
            target=lambda: result.update(bench(gateway.url, args.rate, args, folder / "load.json"))
        )
        load.start()
        log = folder / "requests-ours.jsonl"
        while not log.exists() or not log.read_text():  # `vllm bench serve` imports first
            time.sleep(0.2)
        time.sleep(args.kill_at)
        queues = waiting(gateway.url)
        victim = max(queues, key=lambda replica: queues[replica])
        dead_url = next(u for u in urls if u.split("//")[1] in victim)
        kill_upstream(dead_url)
        killed_at = time.strftime("%X")
        load.join()
        time.sleep(2)
        counts = server_counts(gateway.url, log)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
    # `.get`: the request log had no `retries` before failover (this runs on older commits too).
    failed_there = [
        [r for r in line.get("retries", ()) if r["replica"] == victim] for line in lines
    ]
    sent_on = [line for line, there in zip(lines, failed_there, strict=True) if there]
    ended_there = [line for line in lines if line["replica"] == victim]
    summary = {
        "rate": args.rate, "duration_s": args.duration, "max_num_seqs": args.max_num_seqs,
        "killed": victim, "killed_at": killed_at, "queues_at_kill": queues,
        "client": {"sent": result["num_prompts"], "completed": result["completed"],
                   "failed": result["num_prompts"] - result["completed"]},
        **counts,
        "logged_lines": len(lines),
        "sent_on_from_dead": dict(Counter(line["outcome"] for line in sent_on)),
        "retry_reasons_from_dead": dict(Counter(r["reason"] for rs in failed_there for r in rs)),
        "ended_at_dead": dict(Counter(line["outcome"] for line in ended_there)),
    }  # fmt: skip
    summary["reconciled"] = (
        summary["client"]["sent"] == len(lines) == sum(counts["outcomes"].values())
        and counts["outcomes"] == counts["logged"]
        and sum(counts["retries"].values()) == counts["logged_retries"]
        and counts["in_flight"] == 0
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.upstream_kill", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--rate", type=float, default=50.0, help="req/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--kill-at", type=float, default=8.0, help="seconds into the load")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="each upstream's batch")
    parser.add_argument("--first-token-ms", type=float, default=20.0)
    parser.add_argument("--token-gap-ms", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "upstream_kill")
    args = parser.parse_args(argv)
    args.peers_venv = None  # start_gateway's, for the peers: only ours runs here
    summary = run(args)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    print("every request accounted for" if summary["reconciled"] else "NOT accounted for")
    timed_out = summary["ended_at_dead"].get("deadline", 0)
    print(f"requests the dead upstream held that ended in a 504: {timed_out}")
    return 0 if summary["reconciled"] else 1


if __name__ == "__main__":
    sys.exit(main())
