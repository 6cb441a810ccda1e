"""`python -m benchmarks.upstream_comparison`: the whole comparison with sglang-router and
vllm-router in front of `vllm serve`-shaped upstreams, in one command (about 45 minutes):

1. `benchmarks.upstream_gateways`: 20, 80 and 200 req/s, two interleaved rounds: CPU per
   request, added TTFT, failures;
2. `benchmarks.upstream_overload`: the upstreams saturated at 5x their capacity, and one
   upstream three times slower than the others: goodput, time to a 429, SLO per class, RSS;
3. `benchmarks.upstream_gateways --upstream vllm`: one low-rate round in front of a real
   `vllm serve` (CPU, the embedded tiny-s), to show that the shape holds on vLLM.

Each part writes its rows and table under `--out`; the three tables are joined in
`--out/table.md`. `--install-peers` first makes the peers' virtual environment.

    python -m benchmarks.upstream_comparison --install-peers
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import upstream_gateways, upstream_overload
from serving.launch import ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.upstream_comparison", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--peers-venv", type=Path, default=ROOT / ".peers-venv")
    parser.add_argument("--install-peers", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "upstream_comparison")
    args = parser.parse_args(argv)
    peers = ["--peers-venv", str(args.peers_venv)]
    parts = {
        "rates": (upstream_gateways, ["--rounds", "2", "--duration", "20"]),
        "overload": (upstream_overload, []),
        "vllm": (
            upstream_gateways,
            ["--upstream", "vllm", "--rates", "2", "--rounds", "2", "--duration", "30"],
        ),  # fmt: skip
    }
    tables = []
    for i, (name, (module, extra)) in enumerate(parts.items()):
        install = ["--install-peers"] if args.install_peers and i == 0 else []
        out = args.out / name
        module.main([*extra, *peers, *install, "--out", str(out)])
        tables.append(f"## {name}\n\n{(out / 'table.md').read_text()}")
    (args.out / "table.md").write_text("\n".join(tables))
    print(f"wrote {args.out / 'table.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
