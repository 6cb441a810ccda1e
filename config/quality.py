"""A quality table measured by `python -m serving.quality`: each model's accuracy per task, with
how it was measured. A deployment that names one (`quality_file:`) routes on it instead of the
file-wide table, which for the OPT sizes is seed 004's Table 1."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


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
