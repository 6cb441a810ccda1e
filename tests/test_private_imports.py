"""`make lint`'s check that no package reaches another's private names
(scripts/private_imports.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.support.servers import ROOT

_spec = importlib.util.spec_from_file_location(
    "private_imports", ROOT / "scripts" / "private_imports.py"
)
assert _spec is not None and _spec.loader is not None
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name in check.PACKAGES:
        (root / name).mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_a_private_name_from_another_package_is_found_imported_or_reached(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "serving/engines/remote.py": "_chunk = 1\n",
        "benchmarks/a.py": "from serving.engines.remote import _chunk\n",
        "benchmarks/b.py": "from serving.engines import remote\nx = remote._chunk\n",
        "benchmarks/c.py": "import serving.engines.remote as r\nx = r._chunk\n",
    })  # fmt: skip
    found = check.crossings(root)
    assert [line.split(":")[0] for line in found] == [
        "benchmarks/a.py",
        "benchmarks/b.py",
        "benchmarks/c.py",
    ], found


def test_public_names_and_a_packages_own_private_names_pass(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "serving/engines/remote.py": "_chunk = 1\ndecode = 2\n",
        "serving/api.py": "from serving.engines.remote import _chunk\n",
        "benchmarks/a.py": "from serving.engines.remote import decode\n",
    })  # fmt: skip
    assert check.crossings(root) == []


def test_the_repository_reaches_no_private_name_across_packages() -> None:
    assert check.crossings(ROOT) == []
