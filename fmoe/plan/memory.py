"""Peak activation bytes per pipeline rank from a schedule's action order.

On one rank the actions run one after another, so its activation high-water mark depends on the order
alone, not on the times: an F holds its stage's activations from its start, a B frees them at its end,
an I frees them but keeps the weight-gradient part (`w_bytes`) until the W. This is the count
`fmoe.schedule.simulate` makes (`Report.peak_memory`), with bytes per stage instead of one size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fmoe.schedule.comms import without_comms
from fmoe.schedule.ir import B, F, I, Schedule, W, ops_of


def peak_bytes(s: Schedule, act_S: Sequence[float], w_S: Sequence[float]) -> tuple[float, ...]:
    """Returns the peak activation bytes of each rank [pp] when stage s keeps `act_S[s]` bytes per
    microbatch in flight and `w_S[s]` bytes from its I to its W."""
    key = id(s)
    if key not in _POINTS or _POINTS[key][0] is not s:
        _POINTS[key] = (s, _candidate_points(s))
    counts_RPX = _POINTS[key][1]
    bytes_X = torch.tensor([*act_S, *w_S], dtype=torch.float64)
    return tuple((counts_RPX @ bytes_X).amax(1).tolist())


_POINTS: dict[
    int, tuple[Schedule, torch.Tensor]
] = {}  # id -> (the schedule, kept alive so the id stays its own; points)


def _candidate_points(s: Schedule) -> torch.Tensor:
    """Returns counts_RPX [pp, points, 2 S]: per rank, the in-flight activations per stage and deferred
    weight grads per stage at every point where the total can peak, keeping only the points no other
    dominates (zero rows pad the ranks with fewer). For non-negative byte sizes the peak is the largest
    dot product, so one walk of the order serves every size."""
    s = without_comms(s)
    S = s.placement.num_stages
    ranks = []
    for acts in s.ranks:
        act, w = [0] * S, [0] * S
        points: set[tuple[int, ...]] = set()
        for a in acts:
            ops = ops_of(a)
            for op in ops:  # acquisitions first: a paired F&B holds both at once
                if op.kind == F:
                    act[op.stage] += 1
            points.add(tuple(act + w))
            for op in ops:
                if op.kind == B:
                    act[op.stage] -= 1
                elif op.kind == I:
                    act[op.stage] -= 1
                    w[op.stage] += 1
                    points.add(tuple(act + w))
                elif op.kind == W:
                    w[op.stage] -= 1
        pts = torch.tensor(sorted(points), dtype=torch.float64).reshape(-1, 2 * S)
        # drop dominated points: p <= q everywhere for some other q
        le = (pts[:, None, :] <= pts[None, :, :]).all(-1) & (pts[:, None, :] != pts[None, :, :]).any(-1)
        ranks.append(pts[~le.any(1)])
    width = max(len(r) for r in ranks)
    return torch.stack([torch.cat([r, r.new_zeros(width - len(r), 2 * S)]) for r in ranks])
