"""Stage-to-rank placements: loop, interleaved (v chunks per rank), V-shape, bidirectional (DualPipe).

Legend: pp ranks, v chunks per rank, S = number of stages; stage ids are global.
"""

from __future__ import annotations

from fmoe.schedule.gen_common import positive
from fmoe.schedule.ir import Placement


def loop(pp: int) -> Placement:
    """Returns the plain placement: S = pp stages, stage s on rank s."""
    positive("loop", pp=pp)
    return Placement("loop", pp, tuple(range(pp)), (tuple(range(pp)),), tuple(range(pp)))


def interleaved(pp: int, v: int) -> Placement:
    """Returns the interleaved placement: S = v*pp stages, stage s on rank s % pp (chunk s // pp)."""
    positive("interleaved", pp=pp, v=v)
    n = pp * v
    return Placement("interleaved", pp, tuple(s % pp for s in range(n)), (tuple(range(n)),), tuple(range(n)))


def vshape(pp: int) -> Placement:
    """Returns the V placement: S = 2*pp stages, rank r holds stages r and 2*pp-1-r."""
    positive("vshape", pp=pp)
    n = 2 * pp
    ranks = tuple(s if s < pp else n - 1 - s for s in range(n))
    return Placement("vshape", pp, ranks, (tuple(range(n)),), tuple(range(n)))


def bidirectional(pp: int) -> Placement:
    """Returns DualPipe's placement: two copies of a pp-stage model. Stages 0..pp-1 (copy 0) run down,
    stage j on rank j; stages pp..2pp-1 (copy 1) run up, stage pp+j on rank pp-1-j and runs chunk j."""
    positive("bidirectional", pp=pp)
    ranks = tuple(range(pp)) + tuple(pp - 1 - j for j in range(pp))
    paths = (tuple(range(pp)), tuple(range(pp, 2 * pp)))
    return Placement("bidirectional", pp, ranks, paths, tuple(range(pp)) * 2)


def chunk_placement(placement: Placement) -> Placement:
    """Returns the placement whose stages are the model's chunks (what the layers are spread over):
    `placement` itself, or for DualPipe's two copies (`bidirectional`) the loop placement of one copy."""
    if placement.kind == "bidirectional":
        return loop(placement.pp)
    return placement


def cost_placement(placement: Placement) -> Placement:
    """Returns the placement over the model's chunks whose rank costs are each rank's load per
    microbatch (what a layer cut balances): `chunk_placement`, except for DualPipe with an even pp, whose
    rank j runs chunk j for the microbatches going down and chunk pp-1-j for those going up, half each:
    ranks j and pp-1-j carry the same load, the V placement's over pp/2 ranks (rank j holding chunks j and
    pp-1-j)."""
    if placement.kind == "bidirectional" and placement.pp % 2 == 0:
        return vshape(placement.pp // 2)
    return chunk_placement(placement)

