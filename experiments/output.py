"""What every experiment writes besides its PNG: a CSV of its rows."""

from __future__ import annotations

import csv
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path


def write_csv(path: Path, rows: Sequence[Mapping[str, object]], skip: Collection[str] = ()) -> None:
    """One row per mapping, the columns those of the first row but `skip`; makes the folder."""
    if not rows:
        raise ValueError(f"{path}: no rows to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        fields = [k for k in rows[0] if k not in skip]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
