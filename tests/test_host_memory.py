"""keep_freed_memory: freed host memory is reused without page faults (fresh processes, glibc only)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fmoe.train.host_memory import _mallopt, keep_freed_memory, set_malloc_thresholds

# Allocate 64 tensors of 1 MiB, free them, three times; print the minor page faults of each round.
_ROUNDS = """
import resource, sys, torch
from fmoe.train.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def one_round():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ts = [torch.ones(2**18) for _ in range(64)]
    del ts
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
print(" ".join(str(one_round()) for _ in range(3)))
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=120,
                         check=True)
    return [int(v) for v in out.stdout.split()]


def test_freed_memory_is_reused_without_page_faults():
    if _mallopt() is None:  # not glibc: nothing to set, and it says so
        assert keep_freed_memory() is False
        return
    default, kept = _faults("default"), _faults("keep")
    pages = 64 * 2**20 // 4096
    # the oracle: glibc's defaults hand the freed blocks back, so the second round faults them in again
    assert default[1] > pages // 2, default
    assert kept[1] < pages // 4, kept
    assert kept[2] < pages // 8, kept


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="trim_bytes"):
        set_malloc_thresholds(-1, 2**20)
    with pytest.raises(ValueError, match="mmap_bytes"):
        set_malloc_thresholds(2**20, 2**31)
