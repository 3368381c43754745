"""Zero-bubble schedules: ZB-H1 (1F1B with B split into I and W) and ZB-V (V placement).

Legend: pp ranks, m microbatches; ZB-V rank r holds chunk 0 = stage r and chunk 1 = stage 2pp-1-r.
Both follow torch.distributed.pipelining (ScheduleInterleavedZeroBubble with one chunk, and
ScheduleZBVZeroBubble), which follow the Zero Bubble paper's handcrafted schedules.
"""

from __future__ import annotations

from collections import deque

from fmoe.schedule import stages
from fmoe.schedule.gen_common import build, positive, require
from fmoe.schedule.ir import Action, F, I, Op, Schedule, W


def zb_h1(pp: int, m: int) -> Schedule:
    """Returns ZB-H1: 1F1B with I on the critical path; rank r defers the W of its first r steady steps
    to the cooldown, where they fill the bubbles. Peak pp activations. Needs pp, m >= 1."""
    positive("zb_h1", pp=pp, m=m)
    ranks = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        acts: list[Action] = [Op(F, r, j) for j in range(warm)]
        pending: deque[Op] = deque()
        for t in range(m):  # one I per step; steps >= warm carry no new F
            if warm + t < m:
                acts.append(Op(F, r, warm + t))
            acts.append(Op(I, r, t))
            pending.append(Op(W, r, t))
            if t >= r:
                acts.append(pending.popleft())
        acts.extend(pending)
        ranks.append(acts)
    return build("zb_h1", stages.loop(pp), m, ranks)


def zbv(pp: int, m: int) -> Schedule:
    """Returns ZB-V: 2pp stages in a V; warmup 2pp-1 forwards on every rank (2pp-1-r on chunk 0, r on
    chunk 1 before the first backward), then F I W per chunk, then a cooldown that fills with W.
    This is torch's ScheduleZBVZeroBubble order: at F = I = W its simulated bubble is pp - 1 chunk
    forwards (not the paper's zero), at pp activations of full-stage size (docs/schedules.md).
    Needs pp >= 1, m >= 2pp - 1."""
    positive("zbv", pp=pp, m=m)
    require(m >= 2 * pp - 1, "zbv", f"needs at least 2*pp-1 = {2 * pp - 1} microbatches, got m={m}")
    ranks = []
    for r in range(pp):
        s0, s1 = r, 2 * pp - 1 - r
        cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
        acts: list[Action] = []

        def op(kind: str, key: str, stage: int, cnt: dict = cnt) -> Op:
            j = cnt[key]
            cnt[key] += 1
            return Op(kind, stage, j)

        acts += [op(F, "f0", s0) for _ in range(2 * (pp - r) - 1)]
        for _ in range(r):
            acts += [op(F, "f1", s1), op(F, "f0", s0)]
        for _ in range(pp - r):
            acts.append(op(F, "f1", s1))
            acts += [Op(I, s1, cnt["b1"]), op(W, "b1", s1)]
        while cnt["f1"] < cnt["f0"] or cnt["f0"] < m:
            if cnt["f0"] < m:
                acts.append(op(F, "f0", s0))
            acts += [Op(I, s0, cnt["b0"]), op(W, "b0", s0)]
            acts.append(op(F, "f1", s1))
            acts += [Op(I, s1, cnt["b1"]), op(W, "b1", s1)]
        w0, w1 = cnt["b0"], cnt["b1"]
        for _ in range(r):
            acts += [op(I, "b0", s0), op(I, "b1", s1)]
        for _ in range(pp - r):
            acts += [op(I, "b0", s0), Op(W, s0, w0)]
            w0 += 1
        acts += [Op(W, s1, j) for j in range(w1, cnt["b1"])]
        acts += [Op(W, s0, j) for j in range(w0, cnt["b0"])]
        ranks.append(acts)
    return build("zbv", stages.vshape(pp), m, ranks)
