"""The quality table: the file models.yaml references, and the comparison printed beside seed
004's Table 1."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from serving.quality.evaluate import NUM_FEWSHOT, Score


@dataclass(frozen=True)
class Table:
    command: str
    date: str
    """ISO date of the run."""
    deployment: str
    data: str
    """The data directory, or 'fixtures' for the shipped ones."""
    scores: dict[str, dict[str, Score]]
    """task -> model -> score."""


def render(table: Table) -> str:
    """The table as YAML, written by hand so that each score stays one flow mapping per line."""

    def quoted(text: str) -> str:
        return json.dumps(text)  # a JSON string is a YAML double-quoted scalar

    def number(value: float | None) -> str:
        return "null" if value is None else f"{value:.4f}"

    lines = [
        "# written by python -m serving.quality",
        f"command: {quoted(table.command)}",
        f"date: {quoted(table.date)}",
        f"deployment: {table.deployment}",
        f"data: {quoted(table.data)}",
        f"num_fewshot: {NUM_FEWSHOT}",
        "tasks:",
    ]
    for task, by_model in table.scores.items():
        lines.append(f"  {task}:")
        for model, s in by_model.items():
            lines.append(
                f"    {model}: {{acc: {number(s.acc)}, stderr: {number(s.stderr)}, n: {s.n}}}"
            )
    return "\n".join(lines) + "\n"


def write(table: Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(table))


def normalised(by_model: dict[str, float]) -> dict[str, float]:
    """Each value over the best one, as models.yaml's quality and seed 004's Table 1 are."""
    best = max(by_model.values(), default=0.0)
    return {m: (v / best if best > 0 else 0.0) for m, v in by_model.items()}


@dataclass(frozen=True)
class SeedRow:
    """Where a model of ours has a row in seed 004's Table 1 (models.yaml `quality.tasks`)."""

    name: str
    """The seed's model: the model itself, or the one it stands in for."""
    stand_in: bool
    derived: bool
    """Not measured in the seed: models.yaml's `quality.derived` says how it was made up."""


def comparison(
    table: Table, seed: dict[str, dict[str, float]], rows: dict[str, SeedRow | None]
) -> str:
    """Accuracy, the same normalised to the best model of each task, and the seed's Table 1
    normalised over the same models, where the seed has them."""
    header = f"{'task':<11} {'model':<10} {'acc':>7} {'stderr':>7} {'n':>5} {'norm.':>6}   seed"
    out = [header, "-" * (len(header) + 30)]
    for task, by_model in table.scores.items():
        ours = normalised({m: s.acc for m, s in by_model.items()})
        theirs = normalised(
            {
                m: seed[task][row.name]
                for m in by_model
                if (row := rows.get(m)) is not None and row.name in seed.get(task, {})
            }
        )
        for i, (model, s) in enumerate(by_model.items()):
            stderr = f"{s.stderr:.4f}" if s.stderr is not None else "-"
            line = (
                f"{task if i == 0 else '':<11} {model:<10} {s.acc:>7.4f} {stderr:>7} {s.n:>5} "
                f"{ours[model]:>6.2f}"
            )
            if model in theirs:
                row = rows[model]
                assert row is not None
                note = f"stand-in for {row.name}" if row.stand_in else row.name
                if row.derived:
                    note += ", derived, not in Table 1"
                line += f"   {theirs[model]:.2f} ({note})"
            out.append(line)
    return "\n".join(out)
