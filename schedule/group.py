"""group: a schedule's ranks against the process group that runs it, checked before any message moves.

Legend: pp the schedule's ranks (`Schedule.pp`). The executor sends to a peer by its position in the
group, so a schedule built for pp ranks run on a group of another size fails only at a P2P timeout
naming a rank that does not exist (or pairs the wrong peers); `check_group` says so at the step's start.
"""

from __future__ import annotations

import torch.distributed as dist

from fmoe.schedule.ir import Schedule, ScheduleError


def _group_name(group: dist.ProcessGroup | None) -> str:
    return "the default process group" if group is None else "the pipeline group"


def check_group(s: Schedule, rank: int, group: dist.ProcessGroup | None = None) -> None:
    """Raises ScheduleError unless `rank` is one of `s`'s pp ranks and, when pp > 1, `group` (None: the
    default group) is initialised, has pp members and holds this process as its member `rank`; returns
    None. Reads the group's size and rank only (no communication), so every rank raises alike."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < s.pp:
        raise ScheduleError(f"rank must be an int in 0..{s.pp - 1} (schedule {s.name} has {s.pp} ranks), "
                            f"got {rank!r}")
    if s.pp == 1:
        return  # no P2P: the executor never touches the group
    if not (dist.is_available() and dist.is_initialized()):
        raise ScheduleError(f"schedule {s.name} has {s.pp} ranks, which exchange activations and gradients: "
                            "initialise torch.distributed (a group of that size) first")
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if me < 0:  # this process is not a member: its size and rank read -1
        raise ScheduleError(f"rank {rank}: this process is not a member of the pipeline group it was given")
    if size != s.pp:
        processes = "process" if size == 1 else "processes"
        raise ScheduleError(f"schedule {s.name} has {s.pp} ranks but {_group_name(group)} has {size} "
                            f"{processes}: build the schedule for pp={size}, or run it on a group of {s.pp}")
    if me != rank:
        raise ScheduleError(f"asked to run rank {rank} of schedule {s.name}, but this process is rank {me} "
                            f"of {_group_name(group)}: pass rank={me} (peers are addressed by group rank)")
