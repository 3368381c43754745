"""fmoe.parallel.local_ranks, the one way tests, benchmarks and the calibration start local gloo ranks:
values come back in rank order, a rank's traceback comes back as its error, a rank that hangs is killed at
the timeout (its peers' results kept), `stop_on_error` stops waiting at the first traceback, and a rank
that draws a tqdm bar (torch's inductor does in every compile) leaves no semaphore for the launcher's
resource tracker to report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fmoe.parallel.local_ranks import failures, run_ranks


def _sum_ranks(rank: int, world: int, scale: int) -> int:
    x = torch.tensor([rank + 1])
    dist.all_reduce(x)
    return scale * int(x)


def _rank_one_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return rank


def _rank_one_fails_rank_zero_hangs(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(600)
    return rank


def _rank_one_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_values_in_rank_order() -> None:
    results = run_ranks(_sum_ranks, 3, 10, timeout_s=60)
    assert [r.value for r in results] == [60, 60, 60] and failures(results) == ""
    assert [r.rank for r in results] == [0, 1, 2] and all(r.exitcode == 0 for r in results)


def test_a_failing_rank_reports_its_traceback_and_a_hung_one_is_killed() -> None:
    results = run_ranks(_rank_one_fails, 2, timeout_s=60)
    assert results[0].value == 0 and results[0].error is None
    assert "ValueError: rank 1 fails on purpose" in (results[1].error or "")
    assert failures(results).startswith("--- rank 1 ---\n")
    t0 = time.monotonic()
    results = run_ranks(_rank_one_hangs, 2, timeout_s=8)
    assert time.monotonic() - t0 < 30  # killed at the timeout, not after the sleep
    assert results[0].value == 0 and "no result" in (results[1].error or "")
    assert results[1].exitcode is not None and results[1].exitcode != 0


def test_stop_on_error_stops_at_the_first_traceback() -> None:
    t0 = time.monotonic()
    results = run_ranks(_rank_one_fails_rank_zero_hangs, 2, timeout_s=300, stop_on_error=True)
    assert "rank 1 fails on purpose" in (results[1].error or "")
    assert "no result" in (results[0].error or "")  # killed at once, not left to the gloo timeout
    assert time.monotonic() - t0 < 60


_BAR_SCRIPT = """
from fmoe.parallel.local_ranks import run_ranks

def bar(rank, world):
    from tqdm import tqdm
    with tqdm(total=1, disable=True) as b:  # tqdm's default lock: a named semaphore, made at the first bar
        b.update(1)
    return rank

if __name__ == "__main__":
    print([r.value for r in run_ranks(bar, 2, timeout_s=60)])
"""


def test_a_rank_with_a_progress_bar_leaves_no_semaphore(tmp_path: Path) -> None:
    """A rank ends with os._exit, which skips multiprocessing's exit handlers: a semaphore it made stays
    registered with the launcher's resource tracker, which warns of it when the launcher exits."""
    script = tmp_path / "bars.py"
    script.write_text(_BAR_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1]"
    assert "leaked semaphore" not in done.stderr, done.stderr
