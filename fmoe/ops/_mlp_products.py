"""The SwiGLU MLP's products fused for a split backward: the gate/up pair, and the SwiGLU + down.

    gate_MF, up_MF = grouped_linear_pair(x_MD, w_gate_EDF, w_up_EDF, counts_E)  # two grouped_linear
    y_MD = swiglu_grouped_linear(gate_MF, up_MF, w_EFD, counts_E)   # == grouped_linear(swiglu(g, u), w)
    y_MD = swiglu_packed_grouped_linear(gate_up_MZ, w_EFD, counts_E)  # gate | up from one fused product
    gate_XF, up_XF = linear_pair(x_XD, w_gate_DF, w_up_DF)           # the same for dense weights (linear)
    y_XD = swiglu_linear(gate_XF, up_XF, w_FD)

Legend (the package's, docs/moe.md): M rows grouped by expert (X: any rows), F hidden features, D model
features, E experts (local), Z = 2 F (gate | up side by side).

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

All four are used where a weight gradient may be deferred (`may_defer()`: a split_vjp forward or a dx
pass); elsewhere the plain composition runs, which keeps h from the forward and recomputes nothing. One
Function pair serves both weight kinds: the product (`Grouped` or `Dense`, defined next to
`grouped_linear` and `linear`) is a non-tensor argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fmoe._compat import Function, functorch_active, needs_grad
from fmoe.ops._donate import may_donate, new_buffer_faults
from fmoe.ops._grouped_linear import (
    Counts,
    Grouped,
    check_grouped_args,
    expert_blocks,
    expert_weight_grads,
    grouped_linear,
    traced,
)
from fmoe.ops._linear import DENSE, Dense, linear
from fmoe.ops._swiglu import halves, packed_swiglu_grad, packed_swiglu_grad_over, swiglu, swiglu_packed
from fmoe.transforms.tape import may_defer, weight_grad_or_defer


def _h(gate_MF: torch.Tensor, up_MF: torch.Tensor) -> torch.Tensor:
    """h_MF = silu(gate) * up in the inputs' dtype (swiglu's own expression)."""
    return torch.nn.functional.silu(gate_MF).mul_(up_MF)


def _down_weight_grad(gate_MF: torch.Tensor, up_MF: torch.Tensor, g_MD: torch.Tensor,
                      prod: Grouped | Dense) -> torch.Tensor:
    """The down projection's dw from the recomputed h (freed as soon as the product is made)."""
    return prod.dw(_h(gate_MF, up_MF), g_MD)


def _down_weight_grad_into(out_FD: torch.Tensor, gate_MF: torch.Tensor, up_MF: torch.Tensor,
                           g_MD: torch.Tensor, prod: Grouped | Dense) -> torch.Tensor:
    """Adds _down_weight_grad into out_FD in place; returns out_FD."""
    return prod.dw_into(out_FD, _h(gate_MF, up_MF), g_MD)


def _gate_and_up(a: torch.Tensor, up_MF: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): a and up_MF, or a's two column halves when up_MF is None (a is gate_up_MZ)."""
    return halves(a) if up_MF is None else (a, up_MF)


class _SwiGLUDown(Function):
    """y = prod(silu(gate) * up, w); `up_MF` None: `gate_MF` is gate_up_MZ (gate | up, one product's output)
    and its gradient is one [M, 2F] tensor."""

    generate_vmap_rule = True

    @staticmethod
    def forward(gate_MF: torch.Tensor, up_MF: torch.Tensor | None, w_FD: torch.Tensor,
                prod: Grouped | Dense) -> torch.Tensor:
        return prod.fwd(_h(*_gate_and_up(gate_MF, up_MF)), w_FD)

    @staticmethod
    def setup_context(ctx, inputs, output):
        gate_MF, up_MF, w_FD, prod = inputs
        ctx.save_for_backward(gate_MF, up_MF, w_FD)
        ctx.prod = prod
        ctx.packed = up_MF is None
        ctx.w_plain = w_FD  # the caller's tensor object: the tape keys deferral on it

    @staticmethod
    def backward(ctx, g_MD):
        a, b, w_FD = ctx.saved_tensors
        gate_MF, up_MF = _gate_and_up(a, None if ctx.packed else b)
        prod = ctx.prod
        g_MD = g_MD.contiguous()  # an expanded (stride-0) cotangent: the grouped kernels reject it
        dw = None
        if needs_grad(ctx)[2]:
            dw = weight_grad_or_defer(ctx.w_plain, _down_weight_grad, gate_MF, up_MF, g_MD, prod,
                                      accumulate=_down_weight_grad_into)
        if ctx.packed:  # one [M, 2F] gradient for gate | up
            dgate_up = packed_swiglu_grad(prod.dx(g_MD, w_FD), a) if needs_grad(ctx)[0] else None
            return dgate_up, None, dw, None
        dgate = dup = None
        if needs_grad(ctx)[0] or needs_grad(ctx)[1]:
            # dh is made here and read by nothing else: the SwiGLU backward may overwrite it.
            dh = prod.dx(g_MD, w_FD)
            if needs_grad(ctx)[1]:  # dup = dh * silu(gate), silu recomputed into the result
                dup = torch.nn.functional.silu(gate_MF).mul_(dh)
            if needs_grad(ctx)[0]:  # dgate = silu'(gate) * dh * up, as aten's silu_backward
                dgate = torch.ops.aten.silu_backward(dh.mul_(up_MF), gate_MF)
        return dgate, dup, dw, None


class _SwiGLUDownBlocked(Function):
    """y = prod(swiglu_packed(gate_up_MZ), w_EFD) one expert's rows at a time (the CPU, host ints known,
    plain tape autograd): a block's silu(gate) * up lives in a scratch buffer that the block's GEMM reads
    at once, from cache, instead of two new [M, F] buffers (silu and h) that a page fault maps in and
    the next products read back from memory. The forward saves gate_up only; the backward recomputes a
    block's silu and h, makes its dw slice and dh, and writes the block's gate | up gradient over
    gate_up's rows when `donate` (a new buffer otherwise). The same aten ops on the same values, per
    block, as the composition."""

    @staticmethod
    def forward(gate_up_MZ: torch.Tensor, w_EFD: torch.Tensor, prod: Grouped, donate: bool) -> torch.Tensor:
        y_MD = gate_up_MZ.new_empty(gate_up_MZ.shape[0], w_EFD.shape[-1])
        h_scratch = gate_up_MZ.new_empty(max(prod.counts.host, default=0), w_EFD.shape[-2])
        for e, a, b in expert_blocks(prod.counts.host):
            gate_XF, up_XF = halves(gate_up_MZ[a:b])
            h_XF = torch.ops.aten.silu.out(gate_XF, out=h_scratch[:b - a]).mul_(up_XF)
            torch.mm(h_XF, w_EFD[e], out=y_MD[a:b])
        return y_MD

    @staticmethod
    def setup_context(ctx, inputs, output):
        gate_up_MZ, w_EFD, prod, donate = inputs
        ctx.save_for_backward(gate_up_MZ, w_EFD)
        ctx.prod = prod
        ctx.donate = donate

    @staticmethod
    def backward(ctx, g_MD):
        gate_up_MZ, w_EFD = ctx.saved_tensors
        g_MD = g_MD.contiguous()  # an expanded (stride-0) cotangent
        need_x, need_w = needs_grad(ctx)[0], needs_grad(ctx)[1]
        over = need_x and ctx.donate and may_donate()
        d_MZ = gate_up_MZ if over else torch.empty_like(gate_up_MZ) if need_x else None
        host = ctx.prod.counts.host
        dw_EFD = expert_weight_grads(w_EFD, host) if need_w else None
        silu_scratch = gate_up_MZ.new_empty(max(host, default=0), w_EFD.shape[-2])
        h_scratch = torch.empty_like(silu_scratch)  # h for the dw, then dh
        for e, a, b in expert_blocks(host):
            rows_XZ = gate_up_MZ[a:b]
            gate_XF, up_XF = halves(rows_XZ)
            silu_XF = torch.ops.aten.silu.out(gate_XF, out=silu_scratch[:b - a])
            if need_w:  # dw first: it reads the block's gate | up as the forward had them
                torch.mm(torch.mul(silu_XF, up_XF, out=h_scratch[:b - a]).t(), g_MD[a:b], out=dw_EFD[e])
            if need_x:
                dh_XF = torch.mm(g_MD[a:b], w_EFD[e].t(), out=h_scratch[:b - a])
                if over:
                    packed_swiglu_grad_over(dh_XF, rows_XZ, silu_XF)
                else:
                    dgate_XF, dup_XF = halves(d_MZ[a:b])
                    torch.mul(dh_XF, silu_XF, out=dup_XF)
                    torch.mul(dh_XF, up_XF, out=dgate_XF)
                    torch.ops.aten.silu_backward.grad_input(dgate_XF, gate_XF, grad_input=dgate_XF)
        return d_MZ, dw_EFD, None, None


def _blocks_pay(gate_up_MZ: torch.Tensor, prod: Grouped) -> bool:
    """Whether the blocked SwiGLU + down product runs: plain tape autograd or no autograd (no tape, no
    torch.func, no trace), where new buffers fault and the host ints are known (`Grouped.donates`)."""
    return not (functorch_active() or traced()) and prod.donates(gate_up_MZ)


def swiglu_grouped_linear(gate_MF: torch.Tensor, up_MF: torch.Tensor, w_EFD: torch.Tensor,
                          counts_E: torch.Tensor | Sequence[int] | Counts,
                          backend: str | None = None) -> torch.Tensor:
    """Return y_MD = grouped_linear(swiglu(gate_MF, up_MF), w_EFD, counts_E) ([M, D], the inputs' dtype).

    Same contract, errors and backends as `grouped_linear` (whose input is h = silu(gate) * up). Where a
    weight gradient may be deferred (a split_vjp forward) the forward keeps gate and up, not h, and the
    deferred weight gradient recomputes h (see the module docstring); elsewhere this is the composition.
    """
    if gate_MF.shape != up_MF.shape or gate_MF.dtype != up_MF.dtype:
        raise ValueError(f"swiglu_grouped_linear: gate {tuple(gate_MF.shape)} {gate_MF.dtype} and up "
                         f"{tuple(up_MF.shape)} {up_MF.dtype} must share one shape and dtype")
    if not may_defer():  # h is made here and read by nothing else: its memory takes its gradient
        return grouped_linear(swiglu(gate_MF, up_MF), w_EFD, counts_E, backend, donate=True)
    prod = check_grouped_args("swiglu_grouped_linear", gate_MF, w_EFD, counts_E, backend)
    return _SwiGLUDown.apply(gate_MF, up_MF, w_EFD, prod)


def swiglu_packed_grouped_linear(gate_up_MZ: torch.Tensor, w_EFD: torch.Tensor,
                                 counts_E: torch.Tensor | Sequence[int] | Counts,
                                 backend: str | None = None, *, donate: bool = False) -> torch.Tensor:
    """Return y_MD = grouped_linear(swiglu_packed(gate_up_MZ), w_EFD, counts_E) ([M, D], the input's dtype).

    gate_up_MZ [M, 2F]: gate | up, one fused product's output (`grouped_linear(x, w_gate_up_EDZ)`); its
    gradient is one [M, 2F] tensor, so that product's backward is one GEMM with no sum of two input
    gradients. Where a weight gradient may be deferred, the forward keeps gate_up, not h (module docstring).
    `donate`: gate_up_MZ is handed over (`swiglu_packed`'s donate; where weight gradients may be deferred
    it is kept for them, so nothing is donated there).
    """
    if gate_up_MZ.shape[-1] != 2 * w_EFD.shape[-2]:
        raise ValueError(f"swiglu_packed_grouped_linear: gate_up has {gate_up_MZ.shape[-1]} columns, the "
                         f"down weight {tuple(w_EFD.shape)} wants 2 x {w_EFD.shape[-2]}")
    if may_defer() or new_buffer_faults(gate_up_MZ):  # else the composition, whose grouped_linear checks
        prod = check_grouped_args("swiglu_packed_grouped_linear", halves(gate_up_MZ)[0], w_EFD, counts_E,
                                  backend)
        if may_defer():
            return _SwiGLUDown.apply(gate_up_MZ, None, w_EFD, prod)
        if _blocks_pay(gate_up_MZ, prod):
            return _SwiGLUDownBlocked.apply(gate_up_MZ, w_EFD, prod, donate)
    # h is made here and read by nothing else: its memory takes its gradient
    return grouped_linear(swiglu_packed(gate_up_MZ, donate=donate), w_EFD, counts_E, backend, donate=True)


class _Pair(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_MD: torch.Tensor, wa_DF: torch.Tensor, wb_DF: torch.Tensor,
                prod: Grouped | Dense) -> tuple[torch.Tensor, torch.Tensor]:
        return prod.fwd(x_MD, wa_DF), prod.fwd(x_MD, wb_DF)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_MD, wa_DF, wb_DF, prod = inputs
        ctx.save_for_backward(x_MD, wa_DF, wb_DF)
        ctx.prod = prod
        ctx.w_plain = (wa_DF, wb_DF)  # the caller's tensor objects: the tape keys deferral on them
        ctx.set_materialize_grads(False)  # an output that reaches nothing gets no zero-filled gradient

    @staticmethod
    def backward(ctx, ga_MF, gb_MF):
        x_MD, wa_DF, wb_DF = ctx.saved_tensors
        prod = ctx.prod
        dx, dws = None, []
        for k, (g_MF, w_DF) in enumerate(((ga_MF, wa_DF), (gb_MF, wb_DF))):
            if g_MF is None:
                dws.append(None)
                continue
            g_MF = g_MF.contiguous()  # an expanded (stride-0) cotangent: the grouped kernels reject it
            dws.append(weight_grad_or_defer(ctx.w_plain[k], prod.dw, x_MD, g_MF, accumulate=prod.dw_into)
                       if needs_grad(ctx)[1 + k] else None)
            if needs_grad(ctx)[0]:
                part = prod.dx(g_MF, w_DF)
                dx = part if dx is None else dx.add_(part)  # dx is this backward's own tensor
        return dx, dws[0], dws[1], None


def grouped_linear_pair(x_MD: torch.Tensor, wa_EDF: torch.Tensor, wb_EDF: torch.Tensor,
                        counts_E: torch.Tensor | Sequence[int] | Counts,
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
    return _Pair.apply(x_MD, wa_EDF, wb_EDF, check_grouped_args("grouped_linear_pair", x_MD, wa_EDF, counts_E,
                                                                backend))


def _check_dense(name: str, x_XD: torch.Tensor, w_DF: torch.Tensor) -> None:
    if w_DF.dim() != 2 or x_XD.shape[-1] != w_DF.shape[0]:
        raise ValueError(f"{name}: x has {x_XD.shape[-1]} features, w is {tuple(w_DF.shape)} ([in, out])")
    if x_XD.dtype != w_DF.dtype:
        raise ValueError(f"{name}: x is {x_XD.dtype} but w is {w_DF.dtype}; cast one first")


def swiglu_linear(gate_XF: torch.Tensor, up_XF: torch.Tensor, w_FD: torch.Tensor) -> torch.Tensor:
    """Return y_XD = linear(swiglu(gate_XF, up_XF), w_FD) (leading dims kept, the inputs' dtype).

    Where a weight gradient may be deferred, the forward keeps gate and up, not h, and the deferred weight
    gradient recomputes h (module docstring); elsewhere this is the composition.
    """
    if gate_XF.shape != up_XF.shape or gate_XF.dtype != up_XF.dtype:
        raise ValueError(f"swiglu_linear: gate {tuple(gate_XF.shape)} {gate_XF.dtype} and up "
                         f"{tuple(up_XF.shape)} {up_XF.dtype} must share one shape and dtype")
    if not may_defer():
        return linear(swiglu(gate_XF, up_XF), w_FD)
    _check_dense("swiglu_linear", gate_XF, w_FD)
    return _SwiGLUDown.apply(gate_XF, up_XF, w_FD, DENSE)


def linear_pair(x_XD: torch.Tensor, wa_DF: torch.Tensor,
                wb_DF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (linear(x_XD, wa_DF), linear(x_XD, wb_DF)), each [..., F]; wa and wb must have one shape.

    Where a weight gradient may be deferred, one Function whose backward sums x's two gradients in place;
    elsewhere the two products.
    """
    if wa_DF.shape != wb_DF.shape or wa_DF.dtype != wb_DF.dtype:
        raise ValueError(f"linear_pair: the weights {tuple(wa_DF.shape)} {wa_DF.dtype} and "
                         f"{tuple(wb_DF.shape)} {wb_DF.dtype} must share one shape and dtype")
    if not may_defer():
        return linear(x_XD, wa_DF), linear(x_XD, wb_DF)
    _check_dense("linear_pair", x_XD, wa_DF)
    return _Pair.apply(x_XD, wa_DF, wb_DF, DENSE)
