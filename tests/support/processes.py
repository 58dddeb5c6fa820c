"""A server's process tree as the kernel sees it (/proc): its descendants and their resident memory, read here
rather than through the server's own code."""
from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...)."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        current = pending.pop()
        for path in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                kids = {int(p) for p in path.read_text().split()}
            except OSError:  # a thread that ended meanwhile
                continue
            pending += kids - found
            found |= kids
    return found


def rss(pid: int) -> int:
    """Resident memory of one process in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(pid: int) -> int:
    """Resident memory of `pid` and all its descendants, in bytes."""
    return sum(rss(p) for p in {pid, *descendants(pid)})
