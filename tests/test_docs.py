"""The documentation's links lead somewhere: every relative link names a file of the repository,
and every #anchor a heading of the page it points into (as GitHub makes a heading's anchor)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(p for p in ROOT.glob("*.md")) + sorted((ROOT / "docs").rglob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation but `-` and `_`
    dropped, spaces to hyphens, a repeated one numbered."""
    seen: Counter[str] = Counter()
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        text = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_the_pages_are_found() -> None:
    assert ROOT / "README.md" in PAGES and len(PAGES) > 20


def test_a_heading_gets_githubs_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# KV capacity (`config/deployment.py`, `kv_capacity`)\n## Notes\n## Notes\n")
    assert anchors(page) == {"kv-capacity-configdeploymentpy-kv_capacity", "notes", "notes-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_a_page_leads_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        into = (page.parent / path).resolve() if path else page
        if not into.exists():
            broken.append(f"{target}: no such file")
        elif anchor and into.suffix == ".md" and anchor not in anchors(into):
            broken.append(f"{target}: no such heading in {into.relative_to(ROOT)}")
    assert not broken, broken


def test_every_benchmark_and_experiment_has_a_results_page_in_the_index() -> None:
    """Each `python -m benchmarks.X` and `experiments.X` is named on the results index, with the
    page that holds what it measured."""
    index = (ROOT / "docs" / "results" / "README.md").read_text()
    modules = [f"{p.parent.name}.{p.stem}" for package in ("benchmarks", "experiments")
               for p in sorted((ROOT / package).glob("*.py"))
               if '__name__ == "__main__"' in p.read_text()]  # fmt: skip
    missing = [m for m in modules if not re.search(rf"\b{re.escape(m)}\b", index)]
    assert not missing, f"not on docs/results/README.md: {missing}"
