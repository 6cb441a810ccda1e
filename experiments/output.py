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
