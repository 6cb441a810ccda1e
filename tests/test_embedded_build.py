"""Building the embedded tiny models, as a fresh machine's first `make serve` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.servers import ROOT

# Three builds at once in threads of a fresh interpreter, as the embedded deployment starts its
# engines; transformers is imported for the first time by all three together.
PARALLEL_BUILDS = """
import sys
from concurrent.futures import ThreadPoolExecutor
from config.schema import TinyBuild
from serving.embedded import ensure_built
spec = TinyBuild(hidden_size=128, num_layers=2, num_heads=2, ffn_dim=512)  # tiny-s
with ThreadPoolExecutor(3) as pool:
    paths = list(pool.map(lambda i: ensure_built(f"{sys.argv[1]}/m{i}", spec), range(3)))
print(len(paths))
"""


def test_models_build_in_parallel_threads_of_a_fresh_process(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PARALLEL_BUILDS, str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "3"
    for i in range(3):
        assert (tmp_path / f"m{i}" / "config.json").exists()
