"""deferral_report: what split_vjp's dx pass and dw pass compute, in FLOPs, and what was not deferred.

    report = deferral_report(f, params, x, engine="autograd", plain_ops="defer")
    print(report)                        # a table: the totals, then one row per parameter leaf
    report.not_deferred_flops            # weight-gradient work left in the dx pass (0: all deferred)

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode`: matmuls, convolutions, attention (not
elementwise ops, norms or reductions, which it does not count). The *input-only* backward is plain
`torch.autograd.grad` w.r.t. the arguments only, with the parameters held constant and f run outside
split_vjp (fmoe's primitives then take their native paths): the least any dx pass can compute.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from fmoe._compat import keystr
from fmoe.transforms._flat import flatten, unflatten
from fmoe.transforms.split_vjp import PlainOps, _is_diff, _paths, split_vjp


@dataclasses.dataclass(frozen=True)
class LeafDeferral:
    """One parameter leaf, differentiated alone (the other parameters held constant).

    `weight_grad_flops`: what its gradient adds to the input-only backward. `not_deferred_flops`: how much
    split_vjp's dx pass computes beyond the input-only backward (0 when its weight gradient is all
    deferred; `weight_grad_flops` when none of it is)."""

    weight_grad_flops: int
    not_deferred_flops: int

    @property
    def deferred(self) -> bool:
        return self.not_deferred_flops == 0


@dataclasses.dataclass(frozen=True)
class DeferralReport:
    """What each pass of `split_vjp(f, params, *args, engine=..., plain_ops=...)` computes, in FLOPs.

    `dx_flops`, `dw_flops`: the two passes. `full_backward_flops`: plain autograd w.r.t. everything.
    `input_only_flops`: plain autograd w.r.t. the arguments only (parameters constant), the least a dx
    pass can do. `not_deferred_flops` (property): dx_flops - input_only_flops, the weight-gradient work
    the dx pass still does. `per_param`: a `LeafDeferral` per float parameter leaf, keyed by its path in
    params (`params['w']`, `params[0]['b']`); empty when asked for none."""

    engine: str
    plain_ops: str
    dx_flops: int
    dw_flops: int
    full_backward_flops: int
    input_only_flops: int
    per_param: dict[str, LeafDeferral]

    @property
    def not_deferred_flops(self) -> int:
        return self.dx_flops - self.input_only_flops

    @property
    def not_deferred(self) -> list[str]:
        """The parameter leaves with weight-gradient work left in the dx pass."""
        return [k for k, v in self.per_param.items() if not v.deferred]

    def __str__(self) -> str:
        lines = [f"split_vjp(engine={self.engine!r}, plain_ops={self.plain_ops!r}) FLOPs: "
                 f"dx pass {self.dx_flops}, dw pass {self.dw_flops}, "
                 f"full backward {self.full_backward_flops}, "
                 f"input-only backward {self.input_only_flops}, not deferred {self.not_deferred_flops}"]
        if self.per_param:
            width = max(len(k) for k in self.per_param)
            lines.append(f"{'param':<{width}}  weight-grad FLOPs  not deferred")
            lines += [f"{k:<{width}}  {v.weight_grad_flops:>17}  {v.not_deferred_flops:>12}"
                      for k, v in self.per_param.items()]
        return "\n".join(lines)


def _flops(fn: Callable[[], Any]) -> tuple[int, Any]:
    with FlopCounterMode(display=False) as counter:
        result = fn()
    return counter.get_total_flops(), result


def _backward_flops(f: Callable[..., Any], p_leaves: list[Any], p_spec: Any, a_leaves: list[Any],
                    a_spec: Any, grad_params: set[int], has_aux: bool) -> int:
    """FLOPs of plain torch.autograd.grad of f's output (cotangent ones) w.r.t. the float arguments and the
    parameter leaves in `grad_params` (the other parameters constant); f runs outside split_vjp."""
    ps = [p.detach().requires_grad_() if k in grad_params else
          p.detach() if isinstance(p, torch.Tensor) else p for k, p in enumerate(p_leaves)]
    xs = [a.detach().requires_grad_() if _is_diff(a) else a for a in a_leaves]
    with torch.enable_grad():
        res = f(unflatten(ps, p_spec), *unflatten(xs, a_spec))
    out = res[0] if has_aux else res
    outs = [o for o in flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [xs[i] for i, a in enumerate(a_leaves) if _is_diff(a)] + [ps[k] for k in sorted(grad_params)]
    if not outs or not wrt:
        return 0
    cts = [torch.ones_like(o) for o in outs]
    return _flops(lambda: torch.autograd.grad(outs, wrt, cts, allow_unused=True))[0]


def _split_flops(f: Callable[..., Any], params: Any, args: tuple[Any, ...], engine: str, plain_ops: PlainOps,
                 has_aux: bool) -> tuple[int, int]:
    with warnings.catch_warnings():  # what split_vjp's warning names, the report counts
        warnings.simplefilter("ignore", UserWarning)
        res = split_vjp(f, params, *args, engine=engine, plain_ops=plain_ops, has_aux=has_aux)
    out, vjp_dx = res[0], res[1]
    o_leaves, o_spec = flatten(out)
    ct = unflatten([torch.ones_like(o) for o in o_leaves], o_spec)
    dx, (_, vjp_dw) = _flops(lambda: vjp_dx(ct))
    dw, _ = _flops(vjp_dw)
    return dx, dw


def deferral_report(f: Callable[..., Any], params: Any, *args: Any, engine: str = "func",
                    plain_ops: PlainOps = "dx", has_aux: bool = False, per_param: bool = True
                    ) -> DeferralReport:
    """Return a `DeferralReport` of `split_vjp(f, params, *args, engine=engine, plain_ops=plain_ops)`:
    FLOPs of its dx pass and dw pass, of the full and the input-only plain backward, and per float
    parameter leaf (`per_param`, each differentiated alone: one more forward and backward per leaf) its
    weight-gradient FLOPs and how many of them the dx pass still computes.

    Flags what split_vjp does not defer, e.g. `fmoe.ops.linear(h, w.T)` (the tape sees a view, not the
    leaf) or `F.linear` under engine "func" or plain_ops "dx". The cotangent is ones; nothing is modified.
    """
    p_leaves, p_spec = flatten(params)
    a_leaves, a_spec = flatten(args)
    dx, dw = _split_flops(f, params, args, engine, plain_ops, has_aux)
    floats = [k for k, p in enumerate(p_leaves) if _is_diff(p)]
    full = _backward_flops(f, p_leaves, p_spec, a_leaves, a_spec, set(floats), has_aux)
    least = _backward_flops(f, p_leaves, p_spec, a_leaves, a_spec, set(), has_aux)
    rows: dict[str, LeafDeferral] = {}
    if per_param:
        paths = _paths(p_spec)
        for k in floats:
            def f_k(p_k: torch.Tensor, *a: Any, k: int = k) -> Any:
                full_p = [p_k if j == k else (p.detach() if isinstance(p, torch.Tensor) else p)
                          for j, p in enumerate(p_leaves)]
                return f(unflatten(full_p, p_spec), *a)

            dx_k, _ = _split_flops(f_k, p_leaves[k], args, engine, plain_ops, has_aux)
            weight = _backward_flops(f, p_leaves, p_spec, a_leaves, a_spec, {k}, has_aux) - least
            name = f"params{keystr(paths[k])}" if paths is not None else f"params leaf {k}"
            rows[name] = LeafDeferral(weight_grad_flops=weight, not_deferred_flops=dx_k - least)
    return DeferralReport(engine=engine, plain_ops=plain_ops, dx_flops=dx, dw_flops=dw,
                          full_backward_flops=full, input_only_flops=least, per_param=rows)
