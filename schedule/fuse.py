"""fuse_adjacent_iw: the B an I amounts to when its W comes right after it.

A zero-bubble schedule splits a backward into I (input gradients) and W (weight gradients) so that the
input gradient can leave before the weight gradients are made, and W can fill a bubble later. Where a
rank's list runs W(s, mb) as the very next compute action after I(s, mb), with no send between them
(only receives, which change nothing on this rank), nothing can observe the split: the gradient I makes
is sent, or taken by the next stage on this rank, only after the W anyway. Running the pair as one B
gives the same results at the same points of the list for less work: its forward keeps no deferrable
weight gradients, and one autograd pass makes both (on this CPU a deferring forward plus separate dx and
dw passes cost about 8% more than F + B). On 2 ranks and 8 microbatches: ZB-H1's first stage has every
backward so, ZBV's first stage all and its third all but one, DualPipeV with dw_detach the first stage's
last two, DualPipe one per rank.

The executor runs this form by default (`execute(..., fuse_iw=True)`), so whatever predicts its time
(`fmoe plan`) simulates it too. The result verifies like any schedule: B needs what I needed and makes
the gradient I made; the DEFERRED data that only W needed is never made.
"""

from __future__ import annotations

from dataclasses import replace

from fmoe.schedule.comms import with_comms
from fmoe.schedule.ir import Action, B, I, Op, Recv, Schedule, W


def adjacent_iw(actions: tuple[Action, ...]) -> set[tuple[int, int]]:
    """Returns the (stage, mb) of one rank's action list (with its sends and receives) whose lone I is
    followed by its lone W as the next action other than a receive."""
    out: set[tuple[int, int]] = set()
    last_i: Op | None = None  # the latest lone I, while only receives have followed it
    for a in actions:
        if (isinstance(a, Op) and a.kind == W and last_i is not None
                and (a.stage, a.mb) == (last_i.stage, last_i.mb)):
            out.add((a.stage, a.mb))
        if isinstance(a, Recv):
            continue
        last_i = a if isinstance(a, Op) and a.kind == I else None
    return out


def fuse_adjacent_iw(s: Schedule) -> Schedule:
    """Returns `s` (with its sends and receives inserted, `with_comms`) where every adjacent I / W pair of
    a rank (`adjacent_iw`) is one B at the I's place and no W. Unchanged where there is none."""
    s = with_comms(s)
    ranks = []
    for acts in s.ranks:
        fused = adjacent_iw(acts)
        if not fused:
            ranks.append(acts)
            continue
        out: list[Action] = []
        for a in acts:
            if isinstance(a, Op) and a.kind in (I, W) and (a.stage, a.mb) in fused:
                if a.kind == I:
                    out.append(Op(B, a.stage, a.mb))
                continue  # its W: the B made the weight gradients
            out.append(a)
        ranks.append(tuple(out))
    return replace(s, ranks=tuple(ranks))
