"""What a process and everything under it use, from /proc (Linux): the whole of a supervised
server (supervisor, workers, engine host and their children) as one number."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class TreeUse(NamedTuple):
    cpu_s: float
    """User + system CPU of every live member, and of the children each has reaped (a
    supervisor's restarted workers): it only grows, as a counter must."""
    rss_bytes: int
    """Resident memory of the live members, summed (pages two of them share count twice)."""
    open_fds: int
    processes: int


def tree(pid: int) -> set[int]:
    """`pid` and its live descendants."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue  # gone meanwhile
    members, grew = {pid}, True
    while grew:
        below = {child for child, parent in parents.items() if parent in members} - members
        members |= below
        grew = bool(below)
    return members


def tree_use(pid: int) -> TreeUse:
    cpu_s, rss, fds, live = 0.0, 0, 0, 0
    for member in tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            open_fds = len(os.listdir(f"/proc/{member}/fd"))
        except OSError:
            continue  # gone meanwhile (or not ours to read)
        # utime, stime, cutime, cstime; rss in pages.
        cpu_s += sum(int(field) for field in fields[11:15]) * _TICK_S
        rss += int(fields[21]) * _PAGE_BYTES
        fds += open_fds
        live += 1
    return TreeUse(cpu_s, rss, fds, live)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU so far of a process, its live descendants, and the children they have
    reaped."""
    return tree_use(pid).cpu_s
