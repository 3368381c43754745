"""`fmoe.schedule.group.check_group`: a schedule run on a process group of another size, or on the wrong
rank of it, fails at the start in one line naming both numbers (before, the step ran until a P2P timeout
named a rank that does not exist).

Legend: pp the schedule's ranks, P the processes spawned.
"""

from __future__ import annotations

import re

import pytest
import torch.distributed as dist
from dist_utils import spawn

import fmoe.schedule as S
from fmoe.schedule.group import check_group

P = 2


def _error(fn) -> str | None:
    try:
        fn()
    except S.ScheduleError as e:
        return str(e)
    return None


def _rank(rank: int, world: int) -> dict[str, str | None]:
    only_0 = dist.new_group([0])  # every process creates it; rank 1 is no member
    return {
        "right": _error(lambda: check_group(S.one_f_one_b(P, 2), rank)),
        "pp 3 on 2": _error(lambda: check_group(S.one_f_one_b(3, 3), rank)),
        "other rank": _error(lambda: check_group(S.one_f_one_b(P, 2), 1 - rank)),
        "pp 2 on a group of 1": _error(lambda: check_group(S.one_f_one_b(P, 2), rank, only_0)),
        "pp 1": _error(lambda: check_group(S.one_f_one_b(1, 2), 0, only_0 if rank == 0 else None)),
    }


def test_a_schedule_for_another_group_size_fails_on_every_rank_naming_both() -> None:
    for r, res in enumerate(spawn(_rank, P, timeout_s=90)):
        got = res.value
        assert got["right"] is None and got["pp 1"] is None, got
        assert got["pp 3 on 2"] == ("schedule 1f1b has 3 ranks but the default process group has 2 "
                                    "processes: build the schedule for pp=2, or run it on a group of 3")
        assert got["other rank"] == (f"asked to run rank {1 - r} of schedule 1f1b, but this process is rank "
                                     f"{r} of the default process group: pass rank={r} (peers are addressed "
                                     "by group rank)")
        want = ("schedule 1f1b has 2 ranks but the pipeline group has 1 process" if r == 0
                else "rank 1: this process is not a member of the pipeline group it was given")
        assert got["pp 2 on a group of 1"].startswith(want), got


@pytest.mark.parametrize("rank, msg", [
    (2, "rank must be an int in 0..1 (schedule 1f1b has 2 ranks), got 2"),
    (-1, "rank must be an int in 0..1 (schedule 1f1b has 2 ranks), got -1"),
    (1.0, "rank must be an int in 0..1 (schedule 1f1b has 2 ranks), got 1.0"),
    (0, "schedule 1f1b has 2 ranks, which exchange activations and gradients: initialise torch.distributed"),
])
def test_bad_rank_or_no_process_group_fails_in_one_line(rank: object, msg: str) -> None:
    assert not dist.is_initialized()
    with pytest.raises(S.ScheduleError, match=re.escape(msg)):
        check_group(S.one_f_one_b(2, 2), rank)


def test_one_rank_needs_no_process_group() -> None:
    check_group(S.one_f_one_b(1, 2), 0)
