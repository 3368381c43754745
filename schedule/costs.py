"""Cost model for the simulator: per-stage compute, P2P latency, all-to-all per MoE layer, overlap, memory.

Legend: S stages; f, i, w per-stage times of forward, input-grad, weight-grad (b = i + w unless given);
a2a = one all-to-all (a dispatch or a combine) of one MoE layer; L = moe_layers per stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from fmoe.schedule.ir import B, F, I, Op

Num = float | tuple[float, ...]


def _at(x: Num, stage: int) -> float:
    return float(x[stage]) if isinstance(x, tuple) else float(x)


@dataclass(frozen=True)
class Costs:
    """Times in one arbitrary unit. Scalars apply to every stage; tuples give one value per stage.

    Defaults: F = I = W = 1, which is the Zero Bubble paper's FLOP model (F = 24bsh^2 + 4bs^2h,
    I = 24bsh^2 + 8bs^2h, W = 24bsh^2 per layer) when seq << hidden; use `from_flops` for the full
    model. Overlap: a lone F/B/I hides `lone_hide` of its all-to-all behind its own shared-expert / dw
    work (seed: 0.5 with fb overlap, 0 without); a paired F&B step uses the four-stage split, each
    compute part hiding one all-to-all at cost max(compute, comm) (`pair_overlap=False`: plain sum).
    Memory: `act_mem` per in-flight activation (F started, B/I not finished), `wgrad_mem` per deferred
    weight grad (I finished, W not).
    """

    f: Num = 1.0
    i: Num = 1.0
    w: Num = 1.0
    b: Num | None = None
    p2p: float = 0.0
    a2a: float = 0.0
    moe_layers: int = 1
    attn_frac: float = 0.5
    lone_hide: float = 0.0
    pair_overlap: bool = True
    act_mem: float = 1.0
    wgrad_mem: float = 0.0

    @staticmethod
    def from_flops(hidden: int, seq: int, micro_batch: int = 1, layers_per_stage: int = 1,
                   flops_per_unit: float = 1.0) -> Costs:
        """Returns Costs with F, I, W from the Zero Bubble paper's per-layer FLOP counts (B = I + W)."""
        b, s, h, n = micro_batch, seq, hidden, layers_per_stage
        return Costs(f=n * (24 * b * s * h * h + 4 * b * s * s * h) / flops_per_unit,
                     i=n * (24 * b * s * h * h + 8 * b * s * s * h) / flops_per_unit,
                     w=n * 24 * b * s * h * h / flops_per_unit)

    def compute(self, op: Op) -> float:
        """Returns the pure compute time of `op` on its stage."""
        if op.kind == F:
            return _at(self.f, op.stage)
        if op.kind == I:
            return _at(self.i, op.stage)
        if op.kind == B:
            if self.b is not None:
                return _at(self.b, op.stage)
            return _at(self.i, op.stage) + _at(self.w, op.stage)
        return _at(self.w, op.stage)

    def comm(self, op: Op) -> float:
        """Returns the all-to-all time `op` needs (dispatch + combine per MoE layer; W needs none)."""
        return 0.0 if op.kind not in (F, B, I) else 2.0 * self.a2a * self.moe_layers

    def lone(self, op: Op) -> float:
        """Returns the duration of `op` run alone: the hidden share costs max(compute, comm)."""
        c, x = self.compute(op), self.comm(op)
        if x == 0.0:
            return c
        return max(c, self.lone_hide * x) + (1.0 - self.lone_hide) * x

    def pair(self, fop: Op, bop: Op) -> float:
        """Returns the duration of the overlapped F&B step: per MoE layer, Attention(F) hides Combine(B),
        MLP(B) hides Dispatch(F), MLP(F) hides Dispatch(B), Attention(B) hides Combine(F)."""
        if not self.pair_overlap:
            return self.lone(fop) + self.lone(bop)
        cf, cb = self.compute(fop), self.compute(bop)
        if self.a2a == 0.0:
            return cf + cb
        n, a, x = self.moe_layers, self.attn_frac, self.a2a
        per_layer = (max(a * cf / n, x) + max((1 - a) * cb / n, x) + max((1 - a) * cf / n, x)
                     + max(a * cb / n, x))
        return n * per_layer
