"""The quality table (`config.quality.MeasuredQuality`, the file models.yaml references) beside
Table 1 of Chuppala (2024), as the quality command prints it."""

from __future__ import annotations

from dataclasses import dataclass

from config.quality import MeasuredQuality


def normalised(by_model: dict[str, float]) -> dict[str, float]:
    """Each value over the best one, as models.yaml's quality and the thesis's Table 1 are."""
    best = max(by_model.values(), default=0.0)
    return {m: (v / best if best > 0 else 0.0) for m, v in by_model.items()}


@dataclass(frozen=True)
class ThesisRow:
    """Where a model of ours has a row in the thesis's Table 1 (models.yaml `quality.tasks`)."""

    name: str
    """The thesis's model: the model itself, or the one it stands in for."""
    stand_in: bool
    derived: bool
    """Not measured in the thesis: models.yaml's `quality.derived` says how it was made up."""


def comparison(
    table: MeasuredQuality, thesis: dict[str, dict[str, float]], rows: dict[str, ThesisRow | None]
) -> str:
    """Accuracy, the same normalised to the best model of each task, and the thesis's Table 1
    normalised over the same models, where the thesis has them."""
    header = f"{'task':<11} {'model':<10} {'acc':>7} {'stderr':>7} {'n':>5} {'norm.':>6}   seed"
    out = [header, "-" * (len(header) + 30)]
    for task, by_model in table.tasks.items():
        ours = normalised({m: s.acc for m, s in by_model.items()})
        theirs = normalised(
            {
                m: thesis[task][row.name]
                for m in by_model
                if (row := rows.get(m)) is not None and row.name in thesis.get(task, {})
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
