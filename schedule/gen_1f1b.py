"""GPipe, 1F1B and interleaved 1F1B (Megatron's virtual pipeline), optionally with fb overlap.

Legend: pp ranks, m microbatches, v chunks per rank (stage of chunk c on rank r is c*pp + r).
"""

from __future__ import annotations

from fmoe.schedule import stages
from fmoe.schedule.gen_common import build, positive, require
from fmoe.schedule.ir import Action, B, F, Op, Overlap, Schedule


def gpipe(pp: int, m: int) -> Schedule:
    """Returns GPipe: on every rank all m forwards, then all m full backwards. Needs pp, m >= 1."""
    positive("gpipe", pp=pp, m=m)
    ranks = [[Op(F, r, j) for j in range(m)] + [Op(B, r, j) for j in range(m)] for r in range(pp)]
    return build("gpipe", stages.loop(pp), m, ranks)


def one_f_one_b(pp: int, m: int) -> Schedule:
    """Returns 1F1B: rank r runs min(pp-r-1, m) warmup forwards, then alternates F and B, then drains
    the backwards. Needs pp, m >= 1 (m < pp is allowed; it degenerates towards GPipe)."""
    positive("one_f_one_b", pp=pp, m=m)
    return interleaved_1f1b(pp, m, 1, name="1f1b")


def combined_1f1b(m: int) -> Schedule:
    """Returns Megatron's combined 1F1B for one pipeline rank (pp = 1, for expert parallelism without
    pipeline parallelism): F0, then F(i+1)&B(i) pairs, then B(m-1); each pair's forward hides the
    backward's all-to-all and the other way round. Needs m >= 1 (m = 1: F0 then B0, no pair)."""
    positive("combined_1f1b", m=m)
    return interleaved_1f1b(1, m, 1, extra_warmup=True, overlap=m > 1, name="combined_1f1b")


def _virtual_order(pp: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    # Megatron: groups of pp microbatches sweep chunk 0..v-1 (backward: v-1..0) before the next group.
    out = []
    for k in range(m * v):
        group, within = divmod(k, pp * v)
        chunk = within // pp
        out.append((v - 1 - chunk if backward else chunk, group * pp + within % pp))
    return out


def interleaved_1f1b(pp: int, m: int, v: int, extra_warmup: bool = False, overlap: bool | None = None,
                     *, name: str = "interleaved_1f1b") -> Schedule:
    """Returns interleaved 1F1B with v chunks per rank (v=1 is plain 1F1B).

    Rank r warms up with 2(pp-r-1) + (v-1)pp forwards (pp-r-1 when v=1), capped at v*m, then alternates
    one forward and one backward, then drains. `extra_warmup` adds one warmup forward (feature 5), which
    makes the steady-phase F and B of different microbatches independent, so `overlap` (default: equal
    to `extra_warmup`) can fuse them into F&B pairs. Needs pp, m, v >= 1; m a multiple of pp when v > 1;
    overlap only with extra_warmup.
    """
    positive(name, pp=pp, m=m, v=v)
    require(v == 1 or m % pp == 0, name,
            f"with v={v} > 1 microbatches must be a multiple of pp, got m={m}, pp={pp}")
    overlap = extra_warmup if overlap is None else overlap
    require(not overlap or extra_warmup, name, "overlap needs extra_warmup=True (else the steady F and B of "
            "the last stage are the same microbatch)")
    fwd, bwd = _virtual_order(pp, m, v, False), _virtual_order(pp, m, v, True)
    total = m * v
    ranks = []
    for r in range(pp):
        warm = (pp - r - 1) if v == 1 else 2 * (pp - r - 1) + (v - 1) * pp
        warm = min(warm + int(extra_warmup), total)
        acts: list[Action] = [Op(F, c * pp + r, j) for c, j in fwd[:warm]]
        for t in range(total - warm):
            (cf, jf), (cb, jb) = fwd[warm + t], bwd[t]
            fop, bop = Op(F, cf * pp + r, jf), Op(B, cb * pp + r, jb)
            acts.extend([Overlap(fop, bop)] if overlap else [fop, bop])
        acts.extend(Op(B, c * pp + r, j) for c, j in bwd[total - warm:])
        ranks.append(acts)
    placement = stages.loop(pp) if v == 1 else stages.interleaved(pp, v)
    return build(name, placement, m, ranks)
