"""The four tasks of Chuppala (2024), §5.1.1, as lm-eval's built-in tasks, reading local files.

Nothing may reach a dataset hub, so each task's data comes from a file under a data directory.
Everything else (prompt, choices, target, metrics, hellaswag's process_docs and copa's
functions in lm-eval's super_glue/copa/utils.py) stays the built-in task's own.

The mechanism, checked against lm-eval 0.4.13's TaskFactory: a dict inside a *group's* `task:`
list whose `task` names a registered task is built from that task's YAML with the dict's keys
laid over it (`_build_group_members`, then `_load_full_config`: `{**yaml, **overrides}`), and
the YAML's `!function` references resolve next to the built-in YAML. A dict passed on its own
(`tasks=[{"task": "hellaswag", ...}]`) does not do this: it becomes a new inline task made of
the dict alone, without hellaswag's prompt, and fails for want of a split. So every spec here
is one group that lists the built-in tasks with their data fields replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS = ("hellaswag", "copa", "piqa", "openbookqa")
"""The thesis's tasks, by their lm-eval names (copa is lm-eval's super_glue copa)."""

EVAL_SPLIT = {"hellaswag": "validation", "copa": "validation", "piqa": "validation",
              "openbookqa": "test"}  # fmt: skip
"""The split each built-in task evaluates (its test_split if it has one, else validation_split).
The local file is loaded as this split, so lm-eval evaluates it just as it would the hub's."""

FIXTURES = Path(__file__).resolve().parent / "data"
"""The default data: about 20 hand-written items per task, in each hub dataset's exact fields.
For trying the pipeline only: their accuracies say nothing about a model."""

GROUP = "serving_quality"

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""The `datasets` builders that read local files (both are packaged: no download)."""


def data_file(data_dir: Path, task: str) -> Path:
    """The file of `task` under `data_dir`: `<task>.jsonl`, `.json` or `.parquet`."""
    candidates = [data_dir / f"{task}{suffix}" for suffix in _BUILDERS]
    for path in candidates:
        if path.is_file():
            return path
    names = ", ".join(p.name for p in candidates)
    raise FileNotFoundError(f"no data for {task} in {data_dir} (looked for {names})")


def local_task(task: str, data_dir: Path) -> dict[str, Any]:
    """The overrides that point built-in task `task` at its file under `data_dir`."""
    if task not in EVAL_SPLIT:
        raise ValueError(f"unknown task {task!r} (known: {', '.join(TASKS)})")
    path = data_file(data_dir, task)
    split = EVAL_SPLIT[task]
    return {
        "task": task,
        "dataset_path": _BUILDERS[path.suffix],
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: str(path.resolve())}},
        # The file holds one split. lm-eval builds the few-shot sampler from the training split
        # when the task names one (even at zero shots) and would look for it in the file.
        "training_split": None,
        "validation_split": split if split == "validation" else None,
        "test_split": split if split == "test" else None,
    }


def task_spec(tasks: list[str], data_dir: Path) -> dict[str, Any]:
    """One lm-eval task spec (for simple_evaluate's `tasks`) of `tasks` on local data."""
    return {"group": GROUP, "task": [local_task(task, data_dir) for task in tasks]}
