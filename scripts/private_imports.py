"""Fail on a private name imported across packages: `from serving.engines.remote import
_decode_chunk` in benchmarks/ reaches past the module's interface, and breaks without notice
when that module changes. Inside one package, a module may use its neighbours' private names;
tests may use any. Run by `make lint`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("config", "transport", "netsim", "workloads", "router", "serving", "experiments",
            "benchmarks")  # fmt: skip


def crossings(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
                    continue
                if node.module.split(".")[0] == package:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_"):
                        where = path.relative_to(root)
                        found.append(f"{where}:{node.lineno}: {node.module}.{alias.name}")
    return found


def main() -> int:
    found = crossings(Path(__file__).resolve().parent.parent)
    for line in found:
        print(f"{line}: a private name imported from another package", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
