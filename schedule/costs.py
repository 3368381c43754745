"""Cost model for the simulator: per-stage compute, P2P latency, all-to-all per MoE layer, overlap, memory.

Legend: S stages; f, i, w per-stage times of forward, input-grad, weight-grad (b = i + w unless given);
a2a = one all-to-all (a dispatch or a combine) of one MoE layer; L = moe_layers per stage.

Every field is checked at construction (`Costs.__post_init__`) and a bad value raises ScheduleError
naming the field and the value; `check_stages` checks the per-stage tuples against a schedule's stage
count (`simulate` calls it). What is allowed, and why:
  f, i, b    finite and > 0: a zero-time F or backward makes an activation's acquisition and release
             coincide, which the peak-memory count cannot order (and a step cannot take no time).
  w          finite and >= 0: W = 0 is meaningful (weight grads free, B = I; the ZB closed forms hold).
  p2p, a2a   finite and >= 0 scalars (0 = no communication).
  attn_frac, lone_hide   shares in [0, 1]; unpaired_hide too, or None.
  self_f, self_b         finite and >= 0.
  moe_layers an int >= 1 (the F&B split divides by it).
  act_mem, wgrad_mem     finite and >= 0.
  pair_overlap           a bool.
Per-stage values are a tuple (a list is turned into one) of at least one such number; a scalar
applies to every stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from fmoe.schedule.gen_common import positive
from fmoe.schedule.ir import B, F, I, Op, ScheduleError

Num = float | tuple[float, ...]

_PER_STAGE = ("f", "i", "w", "b")


def _at(x: Num, stage: int) -> float:
    return float(x[stage]) if isinstance(x, tuple) else float(x)


def _is_real(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _number(name: str, x: object, *, strict: bool, upper: float | None = None) -> None:
    """Raises ScheduleError unless `x` is a finite real > 0 (`strict`) or >= 0, and <= `upper` if given."""
    low = "> 0" if strict else ">= 0"
    want = f"in [0, {upper:g}]" if upper is not None else low
    if not _is_real(x) or not math.isfinite(x):
        raise ScheduleError(f"Costs.{name} must be a finite number {want}, got {x!r}")
    if (x <= 0 if strict else x < 0) or (upper is not None and x > upper):
        raise ScheduleError(f"Costs.{name} must be {want}, got {x!r}")


@dataclass(frozen=True)
class Costs:
    """Times in one arbitrary unit. Scalars apply to every stage; tuples give one value per stage.

    Defaults: F = I = W = 1, which is the Zero Bubble paper's FLOP model (F = 24bsh^2 + 4bs^2h,
    I = 24bsh^2 + 8bs^2h, W = 24bsh^2 per layer) when seq << hidden; use `from_flops` for the full
    model. Overlap: a lone F/B/I hides `lone_hide` of its all-to-all behind its own shared-expert / dw
    work (seed: 0.5 with fb overlap, 0 without), and where it hides them by itself (self-overlap: row
    chunks, fmoe.overlap) it also pays `self_f` (an F) or `self_b` (a B or I) per MoE layer, its
    smaller GEMMs and extra exchanges; a paired F&B step uses the four-stage split, each compute part
    hiding one all-to-all at cost max(compute, comm) (`pair_overlap=False`: the two ops run lone, each
    hiding `unpaired_hide` of its exchanges when given, else `lone_hide`).
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
    unpaired_hide: float | None = None
    self_f: float = 0.0
    self_b: float = 0.0
    pair_overlap: bool = True
    act_mem: float = 1.0
    wgrad_mem: float = 0.0

    def __post_init__(self) -> None:
        for name in _PER_STAGE:
            x = getattr(self, name)
            if x is None and name == "b":
                continue
            if isinstance(x, list):  # a frozen dataclass holds tuples (hashable, and what _at indexes)
                x = tuple(x)
                object.__setattr__(self, name, x)
            if isinstance(x, tuple):
                if not x:
                    raise ScheduleError(f"Costs.{name} is an empty per-stage tuple; give one value per stage")
                for s, v in enumerate(x):
                    _number(f"{name}[{s}]", v, strict=name != "w")
            elif _is_real(x):
                _number(name, x, strict=name != "w")
            else:
                raise ScheduleError(f"Costs.{name} must be a number or a tuple of per-stage numbers, "
                                    f"got {x!r}")
        for name in ("p2p", "a2a", "act_mem", "wgrad_mem", "self_f", "self_b"):
            _number(name, getattr(self, name), strict=False)
        for name in ("attn_frac", "lone_hide"):
            _number(name, getattr(self, name), strict=False, upper=1.0)
        if self.unpaired_hide is not None:
            _number("unpaired_hide", self.unpaired_hide, strict=False, upper=1.0)
        n = self.moe_layers
        if not isinstance(n, Integral) or isinstance(n, bool) or n < 1:
            raise ScheduleError(f"Costs.moe_layers must be an int >= 1, got {n!r}")
        if not isinstance(self.pair_overlap, bool):
            raise ScheduleError(f"Costs.pair_overlap must be a bool, got {self.pair_overlap!r}")

    def check_stages(self, num_stages: int, where: str = "the schedule") -> None:
        """Raises ScheduleError unless every per-stage tuple has `num_stages` values; returns None."""
        for name in _PER_STAGE:
            x = getattr(self, name)
            if isinstance(x, tuple) and len(x) != num_stages:
                raise ScheduleError(f"Costs.{name} has {len(x)} per-stage values, {where} has {num_stages} "
                                    f"stages: {x!r}")

    @staticmethod
    def from_flops(hidden: int, seq: int, micro_batch: int = 1, layers_per_stage: int = 1,
                   flops_per_unit: float = 1.0) -> Costs:
        """Returns Costs with F, I, W from the Zero Bubble paper's per-layer FLOP counts (B = I + W);
        ScheduleError unless the sizes are positive ints and `flops_per_unit` a finite number > 0."""
        positive("Costs.from_flops", hidden=hidden, seq=seq, micro_batch=micro_batch,
                 layers_per_stage=layers_per_stage)
        _number("from_flops: flops_per_unit", flops_per_unit, strict=True)
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

    def lone(self, op: Op, hide: float | None = None) -> float:
        """Returns the duration of `op` run alone: the hidden share (`hide`, default lone_hide) costs
        max(compute, comm), compute including what hiding its own exchanges costs (`self_f`, `self_b`
        per MoE layer)."""
        c, x = self.compute(op), self.comm(op)
        if x == 0.0:
            return c
        h = self.lone_hide if hide is None else hide
        c += self.moe_layers * (self.self_f if op.kind == F else self.self_b)
        return max(c, h * x) + (1.0 - h) * x

    def pair(self, fop: Op, bop: Op) -> float:
        """Returns the duration of the overlapped F&B step: per MoE layer, Attention(F) hides Combine(B),
        MLP(B) hides Dispatch(F), MLP(F) hides Dispatch(B), Attention(B) hides Combine(F)."""
        if not self.pair_overlap:
            return self.lone(fop, self.unpaired_hide) + self.lone(bop, self.unpaired_hide)
        cf, cb = self.compute(fop), self.compute(bop)
        if self.a2a == 0.0:
            return cf + cb
        n, a, x = self.moe_layers, self.attn_frac, self.a2a
        per_layer = (max(a * cf / n, x) + max((1 - a) * cb / n, x) + max((1 - a) * cf / n, x)
                     + max(a * cb / n, x))
        return n * per_layer
