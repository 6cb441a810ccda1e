"""A quality table measured by `python -m serving.quality`: each model's accuracy per task, with
how it was measured. A deployment that names one (`quality_file:`) routes on it instead of the
file-wide table, which for the OPT sizes is Table 1 of Chuppala (2024). One model, for reading
the file and for writing it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field


class Score(BaseModel):
    """One model's accuracy on one task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    acc: Annotated[float, Field(ge=0, le=1)]
    stderr: Annotated[float, Field(ge=0)] | None
    """lm-eval's standard error of the mean; None where it could not estimate it (one item)."""
    n: Annotated[int, Field(gt=0)]
    """Items scored."""


class MeasuredQuality(BaseModel):
    """The file `python -m serving.quality` writes."""

    model_config = ConfigDict(extra="forbid")

    command: str
    date: str
    """ISO date of the run."""
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

    def write(self, path: Path) -> None:
        """The file: each score a flow mapping on a line of its own, to four decimals."""
        path.parent.mkdir(parents=True, exist_ok=True)
        text = yaml.dump(
            self.model_dump(), Dumper=_FourDecimals, sort_keys=False, default_flow_style=None
        )
        path.write_text("# written by python -m serving.quality\n" + text)


class _FourDecimals(yaml.SafeDumper):
    """Floats as 0.2500: an accuracy over a few hundred items has no more digits worth reading."""


_FourDecimals.add_representer(
    float, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:float", f"{value:.4f}")
)
