"""A local MoE layer's routed SwiGLU experts with permute and unpermute inside, one expert's rows at a time.

    if local_experts_pay(x_TD, layout):  # counts: the layout's rows per expert, as host ints
        y_TD = local_experts(x_TD, probs_TK, w_gate_up_EDZ, w_down_EFD, layout, counts)

Legend (the package's, docs/moe.md): T tokens, D model width, F expert width, Z = 2 F (gate | up),
E experts (all local), K top-k slots, R = T * K rows of the dropless expert-sorted layout, X one expert's
rows (a block).

y_TD[t] = sum_k probs_TK[t, k] * (swiglu(x_TD[t] @ w_gate_up[e]) @ w_down[e]) with e the expert of slot
(t, k): what `permute`, `routed_experts` and `unpermute` compute in three steps, where every step makes
a new [R, *] buffer (the permuted rows, gate | up, y) and the next reads it back. Where the experts live on
this rank (no exchange between the steps) and new buffers fault (the CPU: fmoe/ops/_donate.py), this op
walks the experts' blocks instead: a block's rows are gathered into a scratch buffer, its gate | up
written into the one [R, Z] buffer the backward needs, its silu * up and its y made in scratch and added
into y_TD with their gate weights at once. Saved: gate | up, the rows' gate weights and the inputs (no
rows, no y). The backward walks the blocks twice. First the down product and the SwiGLU backward: the
block's tokens' cotangents gathered into scratch, silu and h recomputed, the gate weights' gradient as
<g @ w_down^T, h> per row (= <g, y>: no y kept), gate | up's gradient written over gate | up (a new
buffer where the graph is kept). Then the gate | up product: the rows gathered again for its weight
gradient, its input gradient added into dx_TD. Each GEMM kind runs back to back (interleaved per block,
the same GEMMs ran ~2% slower: BENCHMARKS.md). The same products as the three steps; the sums over a
token's K slots run in expert order (the three steps' in slot order), so values agree to rounding, not
bit for bit.
"""

from __future__ import annotations

import torch

from fmoe._compat import Function, functorch_active, is_tracing, needs_grad
from fmoe.ops._donate import may_donate, new_buffer_faults
from fmoe.ops._grouped_linear import expert_blocks, expert_weight_grads
from fmoe.ops._permute import Layout
from fmoe.ops._swiglu import halves
from fmoe.transforms.tape import may_defer

LOCAL_EXPERT_DTYPES = (torch.float32, torch.float64)
"""Dtypes the op runs in: its sums over a token's slots add in the rows' dtype (index_add), where the bag
sums it replaces accumulate half precision in fp32."""


def local_experts_pay(x_TD: torch.Tensor, layout: Layout) -> bool:
    """Whether `local_experts` runs for tokens x_TD routed by `layout` (the module docstring): plain tape
    autograd or none (no torch.func, no trace, no deferred weight gradient: a split backward keeps its
    inputs for the dw pass), a dropless layout, a contiguous fp32 / fp64 x on the CPU (whose host reads
    the counts without a wait), and permuted rows [R, D] big enough that a new buffer of them faults
    (`new_buffer_faults`)."""
    # the size first: a pipeline's small microbatches ask at every MoE layer, and fail there
    return (new_buffer_faults(x_TD, layout.num_rows * x_TD.shape[-1]) and layout.full
            and x_TD.dtype in LOCAL_EXPERT_DTYPES and x_TD.device.type == "cpu" and x_TD.is_contiguous()
            and not (functorch_active() or is_tracing() or may_defer()))


class _LocalExperts(Function):
    @staticmethod
    def forward(x_TD: torch.Tensor, probs_TK: torch.Tensor, w_gate_up_EDZ: torch.Tensor,
                w_down_EFD: torch.Tensor, tok_R: torch.Tensor, row_src_R: torch.Tensor,
                counts: tuple[int, ...]) -> torch.Tensor:
        blocks = expert_blocks(counts)
        F, D = w_down_EFD.shape[-2:]
        most = max((b - a for _, a, b in blocks), default=0)
        p_R1 = probs_TK.reshape(-1, 1).index_select(0, row_src_R).to(x_TD.dtype)
        gate_up_RZ = x_TD.new_empty(tok_R.shape[0], 2 * F)
        y_TD = x_TD.new_zeros(x_TD.shape[0], D)
        rows, h, y = (x_TD.new_empty(most, n) for n in (D, F, D))
        for e, a, b in blocks:
            n = b - a
            torch.index_select(x_TD, 0, tok_R[a:b], out=rows[:n])
            torch.mm(rows[:n], w_gate_up_EDZ[e], out=gate_up_RZ[a:b])
            gate_XF, up_XF = halves(gate_up_RZ[a:b])
            torch.ops.aten.silu.out(gate_XF, out=h[:n]).mul_(up_XF)
            torch.mm(h[:n], w_down_EFD[e], out=y[:n]).mul_(p_R1[a:b])
            y_TD.index_add_(0, tok_R[a:b], y[:n])
        return y_TD, gate_up_RZ, p_R1

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_TD, probs_TK, w_gate_up_EDZ, w_down_EFD, tok_R, row_src_R, counts = inputs
        _, gate_up_RZ, p_R1 = output
        ctx.save_for_backward(x_TD, probs_TK, w_gate_up_EDZ, w_down_EFD, tok_R, row_src_R, gate_up_RZ, p_R1)
        ctx.counts = counts
        ctx.mark_non_differentiable(gate_up_RZ, p_R1)
        ctx.set_materialize_grads(False)  # no zero-filled [R, Z] cotangent for the saved-only outputs

    @staticmethod
    def backward(ctx, g_TD, _g_gate_up, _g_p):
        if g_TD is None:  # y reached nothing that was differentiated
            return None, None, None, None, None, None, None
        x_TD, probs_TK, w_gu, w_dn, tok_R, row_src_R, gate_up_RZ, p_R1 = ctx.saved_tensors
        need_x, need_p, need_gu, need_dn = needs_grad(ctx)[:4]
        g_TD = g_TD.contiguous()  # an expanded (stride-0) cotangent: the gathers want rows
        blocks = expert_blocks(ctx.counts)
        F, D = w_dn.shape[-2:]
        most = max((b - a for _, a, b in blocks), default=0)
        dx_TD = torch.zeros_like(x_TD) if need_x else None
        dp_R1 = torch.zeros_like(p_R1) if need_p else None
        # an expert with no rows keeps a zero slice; the others are written whole below
        dw_gu = expert_weight_grads(w_gu, ctx.counts) if need_gu else None
        dw_dn = expert_weight_grads(w_dn, ctx.counts) if need_dn else None
        g, silu, h, dh = (x_TD.new_empty(most, n) for n in (D, F, F, F))
        # gate | up's gradient over gate | up (this op's own buffer, read by nothing after this backward)
        # where autograd frees the graph after it, else into a new buffer
        d_gate_up_RZ = gate_up_RZ if may_donate() else torch.empty_like(gate_up_RZ)
        want_d_gate_up = need_x or need_gu
        for e, a, b in blocks:  # the down product and SwiGLU backward, block by block
            n, p_X1 = b - a, p_R1[a:b]
            gate_XF, up_XF = halves(gate_up_RZ[a:b])
            torch.ops.aten.silu.out(gate_XF, out=silu[:n])
            torch.mul(silu[:n], up_XF, out=h[:n])
            torch.index_select(g_TD, 0, tok_R[a:b], out=g[:n])  # the block's tokens' cotangents
            torch.mm(g[:n], w_dn[e].t(), out=dh[:n])  # dh before the gate weight: g @ w_down^T
            if need_p:  # d p = <g, y> = <g @ w_down^T, h>, one dot product per row
                torch.linalg.vecdot(dh[:n], h[:n], out=dp_R1[a:b].view(n))
            if need_dn:
                torch.mm(h[:n].t(), g[:n].mul_(p_X1), out=dw_dn[e])
            if want_d_gate_up:  # dup = dh * silu, dgate = silu'(gate) * dh * up (gate | up read first)
                dgate_XF, dup_XF = halves(d_gate_up_RZ[a:b])
                dh[:n].mul_(p_X1)
                torch.mul(dh[:n], up_XF, out=h[:n])
                torch.mul(dh[:n], silu[:n], out=dup_XF)
                torch.ops.aten.silu_backward.grad_input(h[:n], gate_XF, grad_input=dgate_XF)
        # the gate | up product's two gradients in a second walk: each GEMM kind back to back (interleaving
        # the four kinds per block ran the same GEMMs ~2% slower here)
        rows = g  # the [most, D] scratch, free now
        for e, a, b in blocks if want_d_gate_up else ():
            n = b - a
            torch.index_select(x_TD, 0, tok_R[a:b], out=rows[:n])
            if need_gu:
                torch.mm(rows[:n].t(), d_gate_up_RZ[a:b], out=dw_gu[e])
            if need_x:
                dx_TD.index_add_(0, tok_R[a:b], torch.mm(d_gate_up_RZ[a:b], w_gu[e].t(), out=rows[:n]))
        dprobs_TK = None
        if need_p:  # each row's gate weight is one slot's: back to slot order
            dprobs_N = torch.empty_like(dp_R1).index_copy_(0, row_src_R, dp_R1)
            dprobs_TK = dprobs_N.view(probs_TK.shape).to(probs_TK.dtype)
        return dx_TD, dprobs_TK, dw_gu, dw_dn, None, None, None


def local_experts(x_TD: torch.Tensor, probs_TK: torch.Tensor, w_gate_up_EDZ: torch.Tensor,
                  w_down_EFD: torch.Tensor, layout: Layout, counts: tuple[int, ...]) -> torch.Tensor:
    """Return y_TD [T, D] = unpermute(routed_experts({"w_gate_up", "w_down"}, permute(x_TD, layout), counts),
    probs_TK, layout) in x's dtype, one expert's rows at a time (module docstring). Differentiable in x,
    probs and both weights, under tape autograd (RuntimeError under torch.func or a trace). Needs what
    `local_experts_pay` checks of the inputs: a dropless layout, host counts, a contiguous fp32 / fp64 x
    on the CPU; raises ValueError otherwise or on mismatched shapes."""
    if functorch_active() or is_tracing():
        raise RuntimeError("local_experts runs under tape autograd only (its blocks write into buffers with "
                           "out=); under torch.func or torch.compile use permute, routed_experts and "
                           "unpermute (fmoe.moe picks the path itself: local_experts_pay)")
    T, D = x_TD.shape
    E, _, Z = w_gate_up_EDZ.shape
    if not (layout.full and x_TD.dtype in LOCAL_EXPERT_DTYPES and x_TD.device.type == "cpu"):
        raise ValueError("local_experts: needs a dropless layout and an fp32 / fp64 x on the CPU, got "
                         f"full={layout.full}, {x_TD.dtype} on {x_TD.device}")
    if (layout.num_tokens != T or tuple(probs_TK.shape) != (T, layout.top_k) or len(counts) != E
            or sum(counts) != layout.num_rows or w_gate_up_EDZ.shape[1] != D
            or tuple(w_down_EFD.shape) != (E, Z // 2, D)):
        raise ValueError(f"local_experts: x {tuple(x_TD.shape)}, probs {tuple(probs_TK.shape)}, w_gate_up "
                         f"{tuple(w_gate_up_EDZ.shape)}, w_down {tuple(w_down_EFD.shape)}, {len(counts)} "
                         f"counts summing to {sum(counts)} do not fit a layout of {layout.num_tokens} tokens "
                         f"x {layout.top_k} slots")
    if w_gate_up_EDZ.dtype != x_TD.dtype or w_down_EFD.dtype != x_TD.dtype:
        raise ValueError(f"local_experts: x is {x_TD.dtype}, the weights {w_gate_up_EDZ.dtype} and "
                         f"{w_down_EFD.dtype}; cast them first")
    return _LocalExperts.apply(x_TD.contiguous(), probs_TK, w_gate_up_EDZ, w_down_EFD, layout.tok_R,
                               layout.row_src_R, tuple(counts))[0]
