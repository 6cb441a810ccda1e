"""The processes under a server, from /proc: which exist, and which cores their threads may
run on (the CPU pinning tests)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ENGINE_CORE = "VLLM::EngineCor"
"""A vLLM EngineCore process's name (its title, cut to the kernel's 15 characters)."""


def processes_under(pid: int) -> dict[int, str]:
    """Every process descended from `pid`, with its name."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        # A process may end while it is being looked at (an engine being killed, say).
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                for child in (task / "children").read_text().split():
                    found[int(child)] = Path(f"/proc/{child}/comm").read_text().strip()
                    todo.append(int(child))
    return found


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets the threads of a process may run on."""
    return {
        frozenset(os.sched_getaffinity(int(task.name)))
        for task in Path(f"/proc/{pid}/task").iterdir()
    }
