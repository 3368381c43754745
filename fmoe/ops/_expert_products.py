"""The routed experts' products fused for a split backward: the gate/up pair, and the SwiGLU + down.

    gate_MF, up_MF = grouped_linear_pair(x_MD, w_gate_EDF, w_up_EDF, counts_E)  # two grouped_linear
    y_MD = swiglu_grouped_linear(gate_MF, up_MF, w_EFD, counts_E)   # == grouped_linear(swiglu(g, u), w)

Legend (the package's, docs/moe.md): M rows grouped by expert, F hidden features, D output features,
E experts (local).

Why fused: in a split backward (`split_vjp`) the down projection's deferred weight gradient needs its
input h = silu(gate) * up until the dw pass, while the SwiGLU backward needs gate and up (and silu(gate))
during the dx pass. Composed, the dx pass holds gate, up, silu(gate) and h at once, one [M, F] more than
tape autograd (which turns h and the output gradient into the weight gradient at once). Fused, the
forward saves gate and up only; the deferred thunk keeps them and recomputes h (one elementwise pass)
in the dw pass, and the SwiGLU backward works in place on the [M, F] gradient it made itself. The
gradients are bit-identical to the composition: the same aten ops on the same values.

The pair: x feeds two products, so its gradient is the sum of two [M, D] products. torch.func's vjp
adds them out of place (three [M, D] tensors at once, while the dw inputs are held); the pair's backward
adds the second into the first in place, as tape autograd's engine does.

Both are used where a weight gradient may be deferred (`may_defer()`: a split_vjp forward or a dx pass);
elsewhere the plain composition runs, which keeps h from the forward and recomputes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fmoe._compat import Function
from fmoe.ops._grouped_linear import _choose_backend, _fwd, _weight_grad, check_grouped_args, grouped_linear
from fmoe.ops._swiglu import swiglu
from fmoe.transforms.tape import may_defer, weight_grad_or_defer


def _h(gate_MF: torch.Tensor, up_MF: torch.Tensor) -> torch.Tensor:
    """h_MF = silu(gate) * up in the inputs' dtype (swiglu's own expression)."""
    return torch.nn.functional.silu(gate_MF).mul_(up_MF)


def _down_weight_grad(gate_MF: torch.Tensor, up_MF: torch.Tensor, g_MD: torch.Tensor,
                      counts: tuple[int, ...], backend: str) -> torch.Tensor:
    """dw_EFD from the recomputed h (freed as soon as the product is made)."""
    return _weight_grad(_h(gate_MF, up_MF), g_MD, counts, backend)


class _SwiGLUGroupedLinear(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(gate_MF: torch.Tensor, up_MF: torch.Tensor, w_EFD: torch.Tensor, counts: tuple[int, ...],
                backend: str) -> torch.Tensor:
        return _fwd(_h(gate_MF, up_MF), w_EFD, counts, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        gate_MF, up_MF, w_EFD, counts, backend = inputs
        ctx.save_for_backward(gate_MF, up_MF, w_EFD)
        ctx.counts, ctx.backend = counts, backend
        ctx.w_plain = w_EFD  # the caller's tensor object: the tape keys deferral on it

    @staticmethod
    def backward(ctx, g_MD):
        gate_MF, up_MF, w_EFD = ctx.saved_tensors
        counts, backend = ctx.counts, ctx.backend
        g_MD = g_MD.contiguous()  # the grouped kernels reject an expanded (stride-0) cotangent
        dw = None
        if ctx.needs_input_grad[2]:
            dw = weight_grad_or_defer(ctx.w_plain, _down_weight_grad, gate_MF, up_MF, g_MD, counts, backend)
        dgate = dup = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # dh is made here and read by nothing else: the SwiGLU backward may overwrite it.
            dh = _fwd(g_MD, w_EFD.transpose(-2, -1), counts, backend)
            if ctx.needs_input_grad[1]:  # dup = dh * silu(gate), silu recomputed into the result
                dup = torch.nn.functional.silu(gate_MF).mul_(dh)
            if ctx.needs_input_grad[0]:  # dgate = silu'(gate) * dh * up, as aten's silu_backward
                dgate = torch.ops.aten.silu_backward(dh.mul_(up_MF), gate_MF)
        return dgate, dup, dw, None, None


def swiglu_grouped_linear(gate_MF: torch.Tensor, up_MF: torch.Tensor, w_EFD: torch.Tensor,
                          counts_E: torch.Tensor | Sequence[int], backend: str | None = None) -> torch.Tensor:
    """Return y_MD = grouped_linear(swiglu(gate_MF, up_MF), w_EFD, counts_E) ([M, D], the inputs' dtype).

    Same contract, errors and backends as `grouped_linear` (whose input is h = silu(gate) * up). Where a
    weight gradient may be deferred (a split_vjp forward) the forward keeps gate and up, not h, and the
    deferred weight gradient recomputes h (see the module docstring); elsewhere this is the composition.
    """
    if gate_MF.shape != up_MF.shape or gate_MF.dtype != up_MF.dtype:
        raise ValueError(f"swiglu_grouped_linear: gate {tuple(gate_MF.shape)} {gate_MF.dtype} and up "
                         f"{tuple(up_MF.shape)} {up_MF.dtype} must share one shape and dtype")
    if not may_defer():
        return grouped_linear(swiglu(gate_MF, up_MF), w_EFD, counts_E, backend)
    counts = check_grouped_args("swiglu_grouped_linear", gate_MF, w_EFD, counts_E)
    return _SwiGLUGroupedLinear.apply(gate_MF, up_MF, w_EFD, counts, _choose_backend(gate_MF, w_EFD, backend))


class _GroupedLinearPair(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_MD: torch.Tensor, wa_EDF: torch.Tensor, wb_EDF: torch.Tensor, counts: tuple[int, ...],
                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        return _fwd(x_MD, wa_EDF, counts, backend), _fwd(x_MD, wb_EDF, counts, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_MD, wa_EDF, wb_EDF, counts, backend = inputs
        ctx.save_for_backward(x_MD, wa_EDF, wb_EDF)
        ctx.counts, ctx.backend = counts, backend
        ctx.w_plain = (wa_EDF, wb_EDF)  # the caller's tensor objects: the tape keys deferral on them
        ctx.set_materialize_grads(False)  # an output that reaches nothing gets no zero-filled gradient

    @staticmethod
    def backward(ctx, ga_MF, gb_MF):
        x_MD, wa_EDF, wb_EDF = ctx.saved_tensors
        counts, backend = ctx.counts, ctx.backend
        dx, dws = None, []
        for k, (g_MF, w_EDF) in enumerate(((ga_MF, wa_EDF), (gb_MF, wb_EDF))):
            if g_MF is None:
                dws.append(None)
                continue
            g_MF = g_MF.contiguous()  # the grouped kernels reject an expanded (stride-0) cotangent
            dws.append(weight_grad_or_defer(ctx.w_plain[k], _weight_grad, x_MD, g_MF, counts, backend)
                       if ctx.needs_input_grad[1 + k] else None)
            if ctx.needs_input_grad[0]:
                part = _fwd(g_MF, w_EDF.transpose(-2, -1), counts, backend)
                dx = part if dx is None else dx.add_(part)  # dx is this backward's own tensor
        return dx, dws[0], dws[1], None, None


def grouped_linear_pair(x_MD: torch.Tensor, wa_EDF: torch.Tensor, wb_EDF: torch.Tensor,
                        counts_E: torch.Tensor | Sequence[int],
                        backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (grouped_linear(x_MD, wa_EDF, counts_E), grouped_linear(x_MD, wb_EDF, counts_E)), each [M, F].

    Same contract, errors and backends as `grouped_linear`; wa and wb must have one shape. Where a weight
    gradient may be deferred, one Function whose backward sums x's two gradients in place (see the module
    docstring); elsewhere the two products.
    """
    if wa_EDF.shape != wb_EDF.shape or wa_EDF.dtype != wb_EDF.dtype:
        raise ValueError(f"grouped_linear_pair: the weights {tuple(wa_EDF.shape)} {wa_EDF.dtype} and "
                         f"{tuple(wb_EDF.shape)} {wb_EDF.dtype} must share one shape and dtype")
    if not may_defer():
        return (grouped_linear(x_MD, wa_EDF, counts_E, backend),
                grouped_linear(x_MD, wb_EDF, counts_E, backend))
    counts = check_grouped_args("grouped_linear_pair", x_MD, wa_EDF, counts_E)
    return _GroupedLinearPair.apply(x_MD, wa_EDF, wb_EDF, counts, _choose_backend(x_MD, wa_EDF, backend))
