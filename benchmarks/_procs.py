"""A job's processes as /proc shows them, for benchmarks that time `fmoe train` runs from outside (no fmoe
import here: benchmarks/revisions.py runs other revisions' packages)."""

from __future__ import annotations


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out.extend(kids)
        todo.extend(kids)
    return out


def hwm_kib(pid: int) -> int:
    """Process `pid`'s resident high-water mark (VmHWM, KiB); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return 0
