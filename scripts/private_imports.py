"""Fail on a private name reached across packages: `from serving.engines.remote import
_decode_chunk` in benchmarks/, or `remote._decode_chunk` on a module imported from another
package, reaches past the module's interface, and breaks without notice when that module
changes. Inside one package, a module may use its neighbours' private names; tests may use any.
Run by `make lint`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("config", "transport", "netsim", "workloads", "router", "serving", "experiments",
            "benchmarks")  # fmt: skip


def _foreign(module: str, package: str) -> bool:
    return module.split(".")[0] in PACKAGES and module.split(".")[0] != package


def crossings(root: Path) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            where = path.relative_to(root)
            modules: dict[str, str] = {}
            """Names bound here to a module of another package, and that module."""
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        if _foreign(alias.name, package):
                            modules[alias.asname or alias.name.split(".")[0]] = alias.name
                elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    if not _foreign(node.module, package):
                        continue
                    for alias in node.names:
                        name = f"{node.module}.{alias.name}"
                        if alias.name.startswith("_"):
                            found.append(f"{where}:{node.lineno}: {name}")
                        elif (root / name.replace(".", "/")).with_suffix(".py").exists():
                            modules[alias.asname or alias.name] = name
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                        and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                        and node.value.id in modules):  # fmt: skip
                    found.append(f"{where}:{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def main() -> int:
    found = crossings(Path(__file__).resolve().parent.parent)
    for line in found:
        print(f"{line}: a private name reached from another package", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
