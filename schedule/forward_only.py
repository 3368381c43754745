"""forward_only: microbatches through the stage programs of a placement, forward only (evaluation).

    sums = forward_only(placement, rank, programs, data, m, group=pp_group)   # {loss name: sum over mbs}

Why not `execute`: a schedule pairs every F with a B (verify's completeness rule) and the executor keeps each
forward's activations for its backward, so no schedule here runs forwards alone. This is GPipe's forward
half without the backward: every microbatch takes path 0 of the placement (DualPipe's two directions run
the same model, so one is enough), and every rank walks the same global order, by position k on the path,
then microbatch: (k, 0), (k, 1), ..., (k + 1, 0), ... running the (k, mb) whose stage it holds. A stage
hands its output to the next one in memory when that stage is on the same rank (the turn of a V), else
with an isend to its rank, waited at the end; its inputs arrive through receives all posted before the
position's first send (the wire order: NCCL matches by issue order). Every message is
sent before (in the global order) it is received, and the ranks of an exchange inside a stage (expert
parallelism) hold the same stages and so run it at the same (k, mb): nothing waits on what comes later.
Phases run in order, an exchange's side phase while the exchange travels; nothing is differentiated (the
caller runs it under torch.no_grad()) and nothing is kept: a microbatch's state is freed once it moved on.

Generic: knows stage programs (fmoe.transforms.program), never the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from fmoe.schedule.ir import Placement, ScheduleError
from fmoe.transforms.program import Acts, Meta, StageProgram, run_phases, tree_params

_MAX_KEYS = 64  # acts per message; tags are (position on the path, microbatch, key index)


def run_stage(prog: StageProgram, acts: Acts, meta: Meta) -> tuple[Acts, dict[str, torch.Tensor]]:
    """Runs every phase of `prog` forward on `acts` / `meta` (`run_phases`); returns (the acts it passes
    on, its losses). Routing statistics (meta["stats"]) are dropped: evaluating updates no state."""
    ran = run_phases(prog.layers, tree_params(prog.params), acts, meta)
    return ran.acts, ran.losses


def forward_only(placement: Placement, rank: int, programs: Mapping[int, StageProgram],
                 data: Callable[[int], Meta], m: int, *, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Runs microbatches 0..m-1 forward through the stages `placement` puts on `rank` (module docstring);
    returns {loss name: its sum over the microbatches whose loss stage is on this rank} (empty elsewhere).
    `data(mb)`: the microbatch's meta (token ids, targets). `group`: the pipeline group (None: pp = 1, or
    the default group). `device`: where receive buffers live (default: CPU)."""
    device = device or torch.device("cpu")
    path = placement.paths[0]
    mine = set(placement.stages_of(rank))
    if set(programs) != mine:
        raise ScheduleError(f"rank {rank}: programs for stages {sorted(programs)}, the placement puts "
                            f"{sorted(mine)} there")
    def peer(stage: int) -> int:
        r = placement.stage_rank[stage]
        return r if group is None else dist.get_global_rank(group, r)

    held: dict[int, Acts] = {}  # mb -> output of this rank's stage at the previous position
    sends: list[tuple[Any, torch.Tensor]] = []
    sums: dict[str, torch.Tensor] = {}
    for k, stage in enumerate(path):
        if stage not in mine:
            continue
        prog = programs[stage]
        prev = path[k - 1] if k else None
        nxt = path[k + 1] if k + 1 < len(path) else None
        posted: dict[int, tuple[Acts, list]] = {}
        if prev is not None and placement.stage_rank[prev] != rank:
            # every receive of this position goes out before its first send: the global order sends all
            # of position k's messages before any of k + 1's, and NCCL / HCCL match a pair of ranks' sends
            # and receives by issue order on one stream (a receive issued between this position's sends
            # would wait for a send that waits for it; tests/test_nccl_rules.py replays it)
            for mb in range(m):
                bufs, works = {}, []
                for i, name in enumerate(sorted(prog.in_spec)):
                    shape, dtype = prog.in_spec[name]
                    bufs[name] = torch.empty(shape, dtype=dtype, device=device)
                    works.append(dist.irecv(bufs[name], peer(prev), group=group,
                                            tag=(k * m + mb) * _MAX_KEYS + i))
                posted[mb] = (bufs, works)
        for mb in range(m):
            if prev is None:
                acts: Acts = {}
            elif placement.stage_rank[prev] == rank:
                acts = held.pop(mb)
            else:
                acts, works = posted.pop(mb)
                for work in works:
                    work.wait()
            acts, losses = run_stage(prog, acts, dict(data(mb)))
            for name, v in losses.items():
                sums[name] = v.detach() if name not in sums else sums[name] + v.detach()
            if nxt is None:
                if acts:
                    raise ScheduleError(f"stage {stage} ends the path but leaves acts {sorted(acts)}")
            elif placement.stage_rank[nxt] == rank:
                held[mb] = acts
            else:
                if len(acts) > _MAX_KEYS:
                    raise ScheduleError(f"stage {stage}: {len(acts)} acts in one message (at most "
                                        f"{_MAX_KEYS})")
                for i, name in enumerate(sorted(acts)):
                    buf = acts[name].contiguous()
                    work = dist.isend(buf, peer(nxt), group=group, tag=((k + 1) * m + mb) * _MAX_KEYS + i)
                    sends.append((work, buf))  # the buffer lives until its send is waited
    for work, _ in sends:
        work.wait()
    return sums
