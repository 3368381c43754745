"""The executor releases each point-to-point send buffer once its send completed, not at the end of the step.

Oracle: a weak reference to every tensor the executor hands to `dist.isend`, counted live at each later
isend (what the step holds of its sends at that moment). On 1F1B at pp 2 a send is answered within two
messages (an activation by its gradient, a gradient by the activation two microbatches on), so at most
3 send buffers are held at once; holding every one to the end of the step holds all m of them.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from dist_utils import spawn
from test_schedule_execute import _data, _params, _program

from fmoe import schedule as S
from fmoe.schedule.execute import execute

M = 8


def _held_sends(rank: int, world: int, name: str) -> tuple[int, int]:
    """Returns (most send buffers alive at once, sends issued) on this rank."""
    refs: list[weakref.ref] = []
    peak = 0
    isend = dist.isend

    def counting_isend(tensor: torch.Tensor, *args, **kwargs):
        nonlocal peak
        refs.append(weakref.ref(tensor))
        peak = max(peak, sum(r() is not None for r in refs))
        return isend(tensor, *args, **kwargs)

    s = S.build(name, world, M)
    params = _params(max(s.placement.layer_chunk) + 1)
    data = _data(M)
    programs = {st: _program(s, st, params, travelling=True) for st in s.placement.stages_of(rank)}
    dist.isend = counting_isend
    try:
        execute(s, rank, programs, lambda mb: data[mb])
    finally:
        dist.isend = isend
    return peak, len(refs)


def test_a_send_buffer_is_released_once_its_peer_answered() -> None:
    got = {r.rank: r.value for r in spawn(_held_sends, 2, "1f1b", timeout_s=120)}
    for rank, (peak, issued) in got.items():
        assert issued == M, (rank, issued)
        assert peak <= 3, f"rank {rank} held {peak} of its {issued} send buffers at once"
