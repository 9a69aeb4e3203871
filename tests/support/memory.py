"""A process tree's resident memory, which the predict tests bound and tools/benchmark.py predict reports."""
from __future__ import annotations

import os


def process_tree_rss(pid: int | None = None) -> int:
    """Resident memory (bytes) of process ``pid`` (default: this one) and all its descendants (DataLoader
    workers), from /proc: what the machine holds for a run, workers included."""
    pid = os.getpid() if pid is None else pid
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status", encoding="utf-8") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children", encoding="utf-8") as f:
                    pending += [int(child) for child in f.read().split()]
        except (OSError, StopIteration):  # the process ended meanwhile
            continue
    return total
