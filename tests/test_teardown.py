"""fmoe.parallel.teardown, the end of a rank's process: `exit_process` keeps what was printed and skips the
interpreter's finalization (where gloo's threads abort the process), and `close_default_group` waits for
the peers only after a success. The research script and `fmoe train` under torchrun end through both:
tests/test_schedule_file.py and tests/test_train.py run them as torchrun jobs and check the exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch.distributed as dist

from fmoe.parallel.local_ranks import run_ranks
from fmoe.parallel.teardown import close_default_group

TIMEOUT_S = 60

# A process that leaves output unflushed, an atexit handler and an object whose finalizer prints: after
# exit_process(3) the output is there, and neither the handler nor the finalizer ran.
CHILD = """
import atexit, sys
from fmoe.parallel.teardown import exit_process

class Finalized:
    def __del__(self):
        print("finalizer ran", file=sys.stderr)

atexit.register(lambda: print("atexit ran", file=sys.stderr))
held = Finalized()
sys.stdout.write("unflushed line")
exit_process(3)
"""


def test_exit_process_keeps_output_and_skips_finalization() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed line"
    assert "atexit ran" not in done.stderr and "finalizer ran" not in done.stderr, done.stderr


def _close(rank: int, world: int, outcome: str, closed: str = "") -> dict:
    """Rank 1 closes after `outcome`; rank 0 only after 3 s (a slow peer), or never (it failed, once rank 1
    has closed: the file at `closed` exists)."""
    if outcome == "failed":
        # both ranks are through the group's setup: a rank 0 that failed at once could leave while rank 1
        # still connects to it, and rank 1 would fail to start rather than close
        dist.barrier()
    if rank == 0:
        if outcome == "failed":
            # alive and never at a barrier while rank 1 closes: a rank 1 that waited would wait in vain
            deadline = time.monotonic() + TIMEOUT_S / 2
            while not os.path.exists(closed) and time.monotonic() < deadline:
                time.sleep(0.01)
            raise ValueError("rank 0 failed on purpose")
        time.sleep(3.0)
        close_default_group(succeeded=True)
        return {"up": dist.is_initialized()}
    t0 = time.perf_counter()
    close_default_group(succeeded=outcome == "succeeded")
    seconds = time.perf_counter() - t0
    if closed:
        open(closed, "w").close()
    return {"seconds": seconds, "up": dist.is_initialized()}


def test_after_a_success_a_rank_waits_for_its_slow_peer_before_closing() -> None:
    results = run_ranks(_close, 2, "succeeded", timeout_s=TIMEOUT_S)
    assert [r.error for r in results] == [None, None], [r.error for r in results]
    assert results[1].value["seconds"] > 2.0, results[1].value  # it waited at the barrier
    assert not results[0].value["up"] and not results[1].value["up"]


def test_after_a_failure_a_rank_closes_without_waiting_for_its_peers(tmp_path: Path) -> None:
    results = run_ranks(_close, 2, "failed", str(tmp_path / "closed"), timeout_s=TIMEOUT_S, pg_timeout_s=30.0)
    assert "rank 0 failed on purpose" in results[0].error
    assert results[1].error is None, results[1].error
    assert results[1].value["seconds"] < 10.0 and not results[1].value["up"], results[1].value


def test_without_a_group_it_does_nothing() -> None:
    assert not dist.is_initialized()
    close_default_group(succeeded=True)
    close_default_group(succeeded=False)
    assert not dist.is_initialized()
