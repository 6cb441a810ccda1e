"""`python -m benchmarks.sglang_fidelity`: does the simulator's copy of sglang-router's
cache_aware (`router.prefix.SglangCacheAware`) choose as the real one does?

sglang-router (`--policy cache_aware`, the version `benchmarks.common.PEERS` pins, its
launcher's defaults) in front of `--replicas` null upstreams (`workloads.null_server`, each
logging the SHA-1 of every prompt it gets), sent `benchmarks.prefix_gateways`' requests: its
`--conversations` sharegpt-16 conversations in a closed loop at `--concurrency`, the same seed.
The upstreams answer after `--first-token-ms`, then a token every `--token-gap-ms`, so that
requests overlap as they do in front of vLLM; the router's choices depend only on the text and
its own count of requests in flight, never on the upstreams.

Then every request goes through the copy in the order the client sent it, teacher-forced: the
copy is given the real router's state at that moment (for each upstream, the requests the real
router had sent there whose answers had not ended, by the client's clock; and a tree holding
the texts of its earlier requests where the real router sent them), and its choice is compared
with the real one. The copy's tie-break order is the one the real router's first choice shows
(with nothing in flight and nothing cached, it takes its first worker). Reported: the share of
requests chosen alike (issue 55's target: at least 90%), by the rule that chose them.

    python -m benchmarks.sglang_fidelity                     # about a minute
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx

from benchmarks.common import add_peer_arguments, install_peers, peer_command
from benchmarks.prefix_gateways import load, workload_flags
from router.prefix import SglangCacheAware, routing_text
from router.text_tree import TextTree
from serving.launch import free_port, launch
from workloads import Request, null_server
from workloads.replay import chat_workload, parser


def prompt_digest(request: Request) -> str:
    """`workloads.null_server.prompt_digest` of the body this request becomes."""
    assert isinstance(request.prompt, tuple)
    return null_server.prompt_digest({"messages": [{"content": m.content} for m in request.prompt]})


def start_upstreams(stack: ExitStack, args: argparse.Namespace) -> tuple[list[str], list[Path]]:
    urls, logs = [], []
    for i in range(args.replicas):
        port = free_port()
        log = args.out / f"upstream-{i}.jsonl"
        log.unlink(missing_ok=True)
        command = [sys.executable, "-m", "workloads.null_server", "--port", str(port),
                   "--h3-port", "0", "--model", "auto", "--request-log", str(log),
                   "--first-token-ms", str(args.first_token_ms),
                   "--token-gap-ms", str(args.token_gap_ms)]  # fmt: skip
        upstream = launch(f"null-{i}", command, port, "/health", args.out / f"null-{i}.log")
        stack.enter_context(upstream.ready(60))
        urls.append(upstream.url)
        logs.append(log)
    return urls, logs


def start_router(stack: ExitStack, args: argparse.Namespace, urls: list[str]) -> str:
    binary = peer_command("sglang-router", args.peers_venv)
    if binary is None:
        raise SystemExit("sglang-router is not installed: --install-peers")
    port = free_port()
    command = [*binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
               "--worker-urls", *urls, "--prometheus-port", str(free_port())]  # fmt: skip
    router = launch("sglang-router", command, port, "/health", args.out / "sglang-router.log")
    stack.enter_context(router.ready(120))
    for _ in range(120):  # ready is not yet routing (prefix_gateways says why)
        if httpx.get(router.url + "/v1/models", timeout=10).status_code == 200:
            break
    return router.url


def replayed(
    sent: list[dict], prompts: dict[str, Request], chosen: list[int], replicas: int
) -> Counter[tuple[str, bool]]:
    """Each request through the copy, teacher-forced (module docstring): (rule, agreed) counts."""
    copy = SglangCacheAware()
    order = [chosen[0], *(i for i in range(replicas) if i != chosen[0])]
    tree = TextTree()
    tally: Counter[tuple[str, bool]] = Counter()
    for k, request in enumerate(sent):
        at = request["arrival_s"] + request["lag_s"]
        loads = [
            sum(1 for j in range(k) if chosen[j] == w and sent[j]["end_s"] > at) for w in order
        ]
        text = routing_text(prompts[request["request_id"]])
        pick, rule = copy.decide(tree, text, order, loads)
        tally[rule, pick == chosen[k]] += 1
        tree.insert(text, chosen[k])
    return tally


def main() -> int:
    cli = argparse.ArgumentParser(
        prog="python -m benchmarks.sglang_fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_argument("--replicas", type=int, default=2)
    cli.add_argument("--conversations", type=int, default=24)
    cli.add_argument("--concurrency", type=int, default=4)
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--first-token-ms", type=float, default=100.0)
    cli.add_argument("--token-gap-ms", type=float, default=10.0)
    add_peer_arguments(cli, "sglang_fidelity")
    args = cli.parse_args()
    if args.install_peers:
        install_peers(args.peers_venv)
    args.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        urls, logs = start_upstreams(stack, args)
        record = load(start_router(stack, args, urls), args, args.out / "replay.json")
    where = {}
    for i, log in enumerate(logs):
        for line in log.read_text().splitlines():
            where[json.loads(line)["prompt_sha1"]] = i
    # The requests as the replay built them (prefix_gateways' flags), by id.
    workload, _ = chat_workload(parser().parse_args(workload_flags(args)))
    prompts = {r.request_id: r for r in workload}
    sent = sorted(
        (r for r in record["requests"] if r["error_kind"] is None),
        key=lambda r: r["arrival_s"] + r["lag_s"],
    )
    unseen = [r for r in sent if prompt_digest(prompts[r["request_id"]]) not in where]
    sent = [r for r in sent if r not in unseen]
    chosen = [where[prompt_digest(prompts[r["request_id"]])] for r in sent]
    tally = replayed(sent, prompts, chosen, args.replicas)
    agreed = sum(n for (_, same), n in tally.items() if same)
    report = {
        "requests": len(record["requests"]),
        "failed": sum(1 for r in record["requests"] if r["error_kind"] is not None),
        "not_found_upstream": len(unseen),
        "compared": len(sent),
        "agreed": agreed,
        "agreement": agreed / len(sent) if sent else None,
        "by_rule": {
            f"{rule} {'agreed' if same else 'differed'}": n
            for (rule, same), n in sorted(tally.items())
        },  # fmt: skip
        "real_split": dict(Counter(chosen)),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "sglang_fidelity.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
