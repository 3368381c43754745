"""DualPipe (bidirectional, 2 model copies) and DualPipeV (the same schedule folded onto a V).

Legend: N ranks of one half (DualPipeV: all pp ranks; DualPipe: pp/2), C microbatches per direction,
r the rank's position from its nearer end; chunk 0 = the rank's stage nearer its own input end, chunk 1
= its other stage. The eight steps follow DeepSeek's reference (github.com/deepseek-ai/DualPipe):
1 F0 | 2 F0 F1 | 3 I1 W F1 | 4 [F0&B1] [F1&B0] | 5 B1 [F1&B0] | 6 B1 B0 | 7 W I0 | 8 W...
W pops the oldest deferred weight grad (a FIFO, as DeepSeek's WeightGradStore).
"""

from __future__ import annotations

from collections import deque

from fmoe.schedule import stages
from fmoe.schedule.gen_common import build, positive, require
from fmoe.schedule.ir import Action, B, F, I, Op, Overlap, Schedule, W


def _steps(n: int, c: int, r: int, stage: tuple[int, int], mb0: tuple[int, int],
           cooldown_zb: bool) -> list[Action]:
    # `stage[k]`, `mb0[k]`: chunk k's stage id and first microbatch id; the turning rank (r = n-1) keeps
    # its first F0 and B1 apart (DeepSeek: "we don't overlap these two chunks to reduce bubble").
    fc, bc = [0, 0], [0, 0]
    queue: deque[Op] = deque()
    acts: list[Action] = []

    def fwd(k: int) -> Op:
        fc[k] += 1
        return Op(F, stage[k], mb0[k] + fc[k] - 1)

    def bwd(k: int, zb: bool) -> Op:
        bc[k] += 1
        j = mb0[k] + bc[k] - 1
        if zb:
            queue.append(Op(W, stage[k], j))
            return Op(I, stage[k], j)
        return Op(B, stage[k], j)

    acts += [fwd(0) for _ in range(2 * (n - r - 1))]
    for _ in range(r + 1):
        acts += [fwd(0), fwd(1)]
    for _ in range(n - r - 1):
        i1 = bwd(1, True)
        acts += [i1, queue.popleft(), fwd(1)]
    for i in range(c - 2 * n + r + 1):
        if i == 0 and r == n - 1:
            acts += [fwd(0), bwd(1, False)]
        else:
            acts.append(Overlap(fwd(0), bwd(1, False)))
        acts.append(Overlap(fwd(1), bwd(0, False)))
    for _ in range(n - r - 1):
        acts.append(bwd(1, False))
        acts.append(Overlap(fwd(1), bwd(0, False)))
    zb = False
    for i in range(r + 1):
        if cooldown_zb and i == (r + 1) // 2 and r % 2 == 1:
            zb = True
        acts.append(bwd(1, zb))
        if cooldown_zb and i == (r + 1) // 2 and r % 2 == 0:
            zb = True
        acts.append(bwd(0, zb))
    for _ in range(n - r - 1):
        if cooldown_zb:
            acts.append(queue.popleft())
        acts.append(bwd(0, cooldown_zb))
    acts.extend(queue)
    return acts


def check_dualpipev_layers(pp: int, layers: int) -> None:
    """Raises ScheduleError unless `layers` suit DualPipeV on pp ranks: at least 2pp and a multiple of 2pp
    (seed 001: every one of the 2pp stages of the V holds as many layers)."""
    require(isinstance(layers, int) and layers >= 2 * pp, "dualpipev",
            f"needs layers >= 2*pp = {2 * pp}, got layers={layers}")
    require(layers % (2 * pp) == 0, "dualpipev",
            f"layers must be a multiple of 2*pp = {2 * pp}, got {layers}")


def dualpipev(pp: int, m: int, dw_detach: bool = False, *, layers: int | None = None, v: int = 1) -> Schedule:
    """Returns DualPipeV on pp ranks (2pp stages in a V, rank r holds stages r and 2pp-1-r).

    `dw_detach=False` (default, feature 9) computes every cooldown backward as a full B, so the last
    ranks do not hold activations until a deferred W; True reproduces DeepSeek's reference (dw deferred
    from the middle of step 6, popped in steps 7-8). Needs pp > 1, m >= 2pp, no interleaving (v == 1),
    and when `layers` is given: layers >= 2pp and a multiple of 2pp.
    """
    positive("dualpipev", pp=pp, m=m, v=v)
    require(pp > 1, "dualpipev", f"needs pp > 1, got pp={pp}")
    require(m >= 2 * pp, "dualpipev", f"needs microbatches >= 2*pp = {2 * pp}, got m={m}")
    require(v == 1, "dualpipev", f"cannot be combined with interleaving (virtual pipeline), got v={v}")
    if layers is not None:
        check_dualpipev_layers(pp, layers)
    ranks = [_steps(pp, m, r, (r, 2 * pp - 1 - r), (0, 0), dw_detach) for r in range(pp)]
    return build("dualpipev" + ("+dw_detach" if dw_detach else ""), stages.vshape(pp), m, ranks)


def dualpipe(pp: int, m: int) -> Schedule:
    """Returns bidirectional DualPipe on pp ranks: microbatches 0..m/2-1 run down stages 0..pp-1,
    microbatches m/2..m-1 run up a second model copy (stages pp..2pp-1, stage pp+j on rank pp-1-j).
    Needs pp even and >= 2, m even and >= 2pp."""
    positive("dualpipe", pp=pp, m=m)
    require(pp % 2 == 0, "dualpipe", f"is bidirectional and needs an even pp, got pp={pp}")
    require(m % 2 == 0 and m >= 2 * pp, "dualpipe", f"needs an even m >= 2*pp = {2 * pp}, got m={m}")
    n, h = pp // 2, m // 2
    ranks = []
    for r in range(pp):
        down, up = r, pp + (pp - 1 - r)  # this rank's stage in each direction
        if r < n:
            acts = _steps(n, h, r, (down, up), (0, h), True)
        else:
            acts = _steps(n, h, pp - 1 - r, (up, down), (h, 0), True)
        ranks.append(acts)
    return build("dualpipe", stages.bidirectional(pp), m, ranks, [0] * h + [1] * h)
