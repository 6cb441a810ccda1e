"""What every experiment writes besides its PNG: a CSV of its rows."""

from __future__ import annotations

import csv
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path


def write_csv(path: Path, rows: Sequence[Mapping[str, object]], skip: Collection[str] = ()) -> None:
    """One row per mapping, the columns every key of any row but `skip` (in order of first
    appearance; a row without one leaves it empty); makes the folder."""
    if not rows:
        raise ValueError(f"{path}: no rows to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        fields = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in skip]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def as_float(value: object) -> float:
    """A number of a row: as an experiment made it, or its text, as a CSV gives it back."""
    if isinstance(value, int | float | str):
        return float(value)
    raise TypeError(f"not a number: {value!r}")


def as_int(value: object) -> int:
    """An integer of a row, taken as `as_float` takes a number."""
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"not an integer: {value!r}")
