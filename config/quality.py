"""A quality table measured by `python -m serving.quality`: each model's accuracy per task, with
how it was measured. A deployment that names one (`quality_file:`) routes on it instead of the
file-wide table, which for the OPT sizes is seed 004's Table 1."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Score(BaseModel):
    model_config = ConfigDict(extra="forbid")

    acc: Annotated[float, Field(ge=0, le=1)]
    stderr: Annotated[float, Field(ge=0)] | None
    """None where lm-eval could not estimate it (one item)."""
    n: Annotated[int, Field(gt=0)]
    """Items scored."""


class MeasuredQuality(BaseModel):
    """The file `python -m serving.quality` writes."""

    model_config = ConfigDict(extra="forbid")

    command: str
    date: str
    deployment: str
    data: str
    """Where the items came from: a --data-dir, or the shipped fixtures."""
    num_fewshot: int = 0
    tasks: Annotated[
        dict[str, Annotated[dict[str, Score], Field(min_length=1)]], Field(min_length=1)
    ]
    """task -> model -> its score."""

    def accuracy(self) -> dict[str, dict[str, float]]:
        """task -> model -> accuracy."""
        return {task: {m: s.acc for m, s in row.items()} for task, row in self.tasks.items()}

    def describe(self) -> str:
        return f"measured {self.date} on {self.data} by `{self.command}`"


class QualityFileError(ValueError):
    pass


def load_measured(path: str | Path) -> MeasuredQuality:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise QualityFileError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise QualityFileError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return MeasuredQuality.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise QualityFileError(f"{path}: {where}: {first['msg']}") from None
