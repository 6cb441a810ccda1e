"""`python -m serving.quality`: lm-eval through the server scores each item as lm-eval's own
vLLM backend does on the same model files, and the table it writes is well-formed.

Both runs are the command itself, in a subprocess: the direct one starts a vLLM engine, which
the test process should not host beside the session's servers. The fixtures' five first items
of each task keep them short (about a minute each on two cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from serving.quality.tasks import TASKS
from tests.support.servers import PYTHON, ROOT, Server
from tests.support.tiers import starts

LIMIT = 5
MODELS = ("tiny-s", "tiny-m", "tiny-l")
COMMAND_TIMEOUT_S = 400
TOLERANCE = 1e-3
"""Per item and choice, in nats: both sides run vLLM's CPU kernels in float32, but in
batches of other sizes and make-up, which may move the last bits."""

# The first test's setup runs the command twice (about a minute each on two idle cores, and
# several times that beside other work), after waiting for the session's embedded server.
pytestmark = pytest.mark.timeout(900)


@dataclass
class Run:
    table: dict
    table_text: str
    samples: dict[tuple[str, str, int], dict]
    """(task, model, doc_id) -> the item's line of --samples."""


def quality(out_dir: Path, *args: str, env: dict[str, str] | None = None) -> Run:
    """`python -m serving.quality --limit 5 ARGS`, its table and its samples."""
    table, samples = out_dir / "table.yaml", out_dir / "samples.jsonl"
    command = [PYTHON, "-m", "serving.quality", "--limit", str(LIMIT), "--out", str(table),
               "--samples", str(samples), *args]  # fmt: skip
    log = out_dir / "quality.log"
    with log.open("w") as out:
        # A session of its own, so that whatever happens its vLLM engine goes with it: a
        # killed parent leaves its EngineCore running, and that one ignores SIGTERM.
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=COMMAND_TIMEOUT_S)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    output = log.read_text(errors="replace")
    assert returncode == 0, f"{' '.join(command)}:\n{output[-6000:]}"
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    return Run(
        yaml.safe_load(table.read_text()),
        table.read_text(),
        {(s["task"], s["model"], s["doc_id"]): s for s in lines},
    )


@pytest.fixture(scope="module")
def through_server(
    server: Server, session_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Run:
    """Every model of the embedded server, pinned by name, through /v1/completions."""
    config = session_dir / "models.yaml"
    out = tmp_path_factory.mktemp("quality-server")
    return quality(out, "--config", str(config), "--deployment", "embedded", "--url", server.url)


@pytest.fixture(scope="module")
@starts("vllm")
def direct(session_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """lm-eval's own vllm backend on tiny-s's files, the deployment's engine args."""
    config = session_dir / "models.yaml"
    out = tmp_path_factory.mktemp("quality-direct")
    # Not pinned where vLLM would pin it, the core the embedded engines already take: it can
    # move off a busy core (as the session's `vllm serve` does).
    return quality(out, "--config", str(config), "--deployment", "embedded", "--direct",
                   "--models", "tiny-s", env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})  # fmt: skip


def test_through_the_server_each_item_scores_as_on_vllm_itself(
    through_server: Run, direct: Run
) -> None:
    mine = {key: s for key, s in through_server.samples.items() if key[1] == "tiny-s"}
    assert mine.keys() == direct.samples.keys()
    assert len(mine) == LIMIT * len(TASKS)
    worst = 0.0
    for key, reference in direct.samples.items():
        got, want = mine[key]["loglikelihoods"], reference["loglikelihoods"]
        assert len(got) == len(want) >= 2, key
        worst = max(worst, *(abs(g - w) for g, w in zip(got, want, strict=True)))
        assert got == pytest.approx(want, abs=TOLERANCE), key
        assert mine[key]["acc"] == reference["acc"], key
    for task in TASKS:
        assert (
            through_server.table["tasks"][task]["tiny-s"]["acc"]
            == direct.table["tasks"][task]["tiny-s"]["acc"]
        ), task
    print(f"largest difference: {worst:.2e} nats")


def test_the_table_is_well_formed(through_server: Run) -> None:
    table = through_server.table
    assert set(table) == {"command", "date", "deployment", "data", "num_fewshot", "tasks"}
    assert table["command"].startswith("python -m serving.quality ")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", table["date"])
    assert table["deployment"] == "embedded"
    assert table["data"] == "fixtures"
    assert table["num_fewshot"] == 0
    assert list(table["tasks"]) == list(TASKS)
    for task, by_model in table["tasks"].items():
        assert list(by_model) == list(MODELS), task
        for score in by_model.values():
            assert set(score) == {"acc", "stderr", "n"}
            assert 0.0 <= score["acc"] <= 1.0
            assert score["stderr"] >= 0.0
            assert score["n"] == LIMIT
    # One flow mapping per model, four decimals, as the reader in config/ expects.
    scores = re.findall(r"^    (\S+): \{acc: \d\.\d{4}, stderr: \d\.\d{4}, n: \d+\}$",
                        through_server.table_text, re.MULTILINE)  # fmt: skip
    assert len(scores) == len(TASKS) * len(MODELS)
    assert through_server.table_text.startswith("# written by python -m serving.quality\n")


def test_the_table_feeds_the_router(through_server: Run, tmp_path: Path) -> None:
    """A deployment that names the written table routes on it, normalised to its best model."""
    from config import load_deployment

    table = tmp_path / "measured.yaml"
    table.write_text(through_server.table_text)
    spec = yaml.safe_load((ROOT / "models.yaml").read_text())
    spec["deployments"]["embedded"]["quality_file"] = str(table)
    config = tmp_path / "models.yaml"
    config.write_text(yaml.safe_dump(spec))
    deployment = load_deployment(config, "embedded")
    for task, row in through_server.table["tasks"].items():
        best = max(score["acc"] for score in row.values())
        assert deployment.quality[task] == {
            model: pytest.approx(score["acc"] / best) for model, score in row.items()
        }
    assert "python -m serving.quality" in deployment.quality_source
