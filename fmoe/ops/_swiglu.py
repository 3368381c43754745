"""swiglu: silu(gate) * up, the gated activation of a SwiGLU MLP, with a hand-written backward.

    h_XF = swiglu(gate_XF, up_XF)
    h_XF = swiglu_packed(gate_up_XZ)          # gate and up side by side: one [X, 2F] product's output

Legend (the package's, docs/moe.md): X rows (any leading dims), F hidden features, Z = 2 F (gate's
columns [0, F), up's [F, 2F)).
Math in the input dtype: aten's silu kernels compute each element in fp32 and round once, the product
rounds once more. (Half-precision inputs upcast to fp32 and back cost 3x on CPU in copies, for under one
bf16 ulp: docs/precision.md.)
Under torch.func transforms an autograd Function with a hand-written backward; under tape autograd the
same math as native ops.
"""

from __future__ import annotations

import torch

from fmoe._compat import Function, functorch_active, is_tracing, needs_grad
from fmoe.ops._donate import may_donate
from fmoe.ops._host_bound import host_bound


class _SwiGLU(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(gate_XF: torch.Tensor, up_XF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        silu_XF = torch.nn.functional.silu(gate_XF)
        # silu(gate) is a second, non-differentiable output so that the backward can reuse it (as
        # tape autograd does) instead of recomputing it.
        return silu_XF * up_XF, silu_XF

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        # No zero-filled gradient for the silu output (nor for an unused product): under torch.func
        # autograd would otherwise allocate one [X, F] tensor of zeros per backward.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs, output[1])

    @staticmethod
    def backward(ctx, g_XF, _g_silu):
        gate_XF, up_XF, silu_XF = ctx.saved_tensors
        if g_XF is None:  # the product did not reach the output
            return None, None
        dgate = dup = None
        if needs_grad(ctx)[0]:
            # d silu(a) / da = sig(a) * (1 + a * (1 - sig(a))), as aten's fused silu_backward kernel
            dgate = torch.ops.aten.silu_backward(g_XF * up_XF, gate_XF)
        if needs_grad(ctx)[1]:
            dup = g_XF * silu_XF
        return dgate, dup


def halves(gate_up_XZ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (gate_XF, up_XF): the two column halves of gate_up_XZ (views, no copy)."""
    F = gate_up_XZ.shape[-1] // 2
    return gate_up_XZ[..., :F], gate_up_XZ[..., F:]


def packed_swiglu_grad(g_XF: torch.Tensor, gate_up_XZ: torch.Tensor,
                       silu_XF: torch.Tensor | None = None) -> torch.Tensor:
    """Return d gate_up [X, 2F] of <g_XF, silu(gate) * up>: the gate's gradient in columns [0, F), the up's
    in [F, 2F), each written in place into one buffer (so the fused gate/up product's backward is one
    GEMM over it, with no sum of two input gradients). `silu_XF`: silu(gate) when kept, else recomputed.
    Holds no [X, F] temporary beside the result (in eager runs)."""
    gate_XF, up_XF = halves(gate_up_XZ)
    silu_XF = torch.nn.functional.silu(gate_XF) if silu_XF is None else silu_XF
    if is_tracing():  # a traced graph's cuts follow values, not writes into views: the halves made apart
        dgate_XF = torch.ops.aten.silu_backward(g_XF * up_XF, gate_XF)
        return torch.cat([dgate_XF, g_XF * silu_XF], -1)
    d_XZ = torch.empty_like(gate_up_XZ.detach())  # a fresh buffer: the writes below make its history
    if torch.is_grad_enabled() or functorch_active():
        # out= takes no tensor that autograd or torch.func tracks: in-place ops on the halves instead (no
        # [X, 2F] concatenation, which held both halves twice over). Each half is viewed after the other's
        # write: autograd refuses a view taken before its base joined the graph.
        halves(d_XZ)[1].copy_(g_XF).mul_(silu_XF)
        dgate_XF = halves(d_XZ)[0]
        dgate_XF.copy_(g_XF).mul_(up_XF)
        dgate_XF.copy_(torch.ops.aten.silu_backward(dgate_XF, gate_XF))
        return d_XZ
    dgate_XF, dup_XF = halves(d_XZ)
    torch.mul(g_XF, silu_XF, out=dup_XF)
    torch.mul(g_XF, up_XF, out=dgate_XF)  # g * up, then silu's derivative applied where it lies: no temporary
    # d silu(a) / da = sig(a) * (1 + a * (1 - sig(a))), aten's fused silu_backward kernel, in place
    torch.ops.aten.silu_backward.grad_input(dgate_XF, gate_XF, grad_input=dgate_XF)
    return d_XZ


def packed_swiglu_grad_over(g_XF: torch.Tensor, gate_up_XZ: torch.Tensor,
                            silu_XF: torch.Tensor) -> torch.Tensor:
    """`packed_swiglu_grad`, written over gate_up_XZ itself (a donated buffer) and returned: the same three
    elementwise passes and bit-identical values, with no new [X, 2F] buffer. Each half is overwritten
    once nothing reads it any more: up by g * up, gate by silu's derivative applied to that, up by
    g * silu(gate) (kept from the forward). (On CPU a new buffer of that size costs several times the
    passes: fmoe/ops/_donate.py.)"""
    gate_XF, up_XF = halves(gate_up_XZ)
    up_XF.mul_(g_XF)
    torch.ops.aten.silu_backward.grad_input(up_XF, gate_XF, grad_input=gate_XF)
    torch.mul(g_XF, silu_XF, out=up_XF)
    return gate_up_XZ


class _SwiGLUPacked(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(gate_up_XZ: torch.Tensor, donate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        gate_XF, up_XF = halves(gate_up_XZ)
        silu_XF = torch.nn.functional.silu(gate_XF)
        return silu_XF * up_XF, silu_XF  # silu kept for the backward, as in _SwiGLU

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(inputs[0], output[1])
        ctx.donate = inputs[1]

    @staticmethod
    def backward(ctx, g_XF, _g_silu):
        gate_up_XZ, silu_XF = ctx.saved_tensors
        if g_XF is None:
            return None, None
        if ctx.donate and may_donate():
            return packed_swiglu_grad_over(g_XF, gate_up_XZ, silu_XF), None
        return packed_swiglu_grad(g_XF, gate_up_XZ, silu_XF), None


def swiglu_packed(gate_up_XZ: torch.Tensor, *, donate: bool = False) -> torch.Tensor:
    """Return h_XF = silu(gate) * up for gate, up = the column halves of gate_up_XZ [..., 2F] (one product's
    output); its backward writes both halves' gradients into one [..., 2F] tensor.

    `donate` (as JAX's donate_argnums): the caller hands gate_up_XZ over; under tape autograd the backward
    writes that gradient over gate_up_XZ's own memory instead of a new buffer, so gate_up_XZ must not be
    read after the backward (fmoe's routed experts make it and read it nowhere else). Another autograd
    node that saved it fails loudly at its backward (its saved version changed); under torch.func, while
    tracing and in a backward that keeps its graph (retain_graph, create_graph) nothing is donated, nor
    where aten's ops run small rows on the CPU (fmoe/ops/_host_bound.py)."""
    if gate_up_XZ.shape[-1] % 2 or not gate_up_XZ.is_floating_point():
        raise ValueError(f"swiglu_packed: gate_up must be floating with an even last dim (gate | up), got "
                         f"{tuple(gate_up_XZ.shape)} {gate_up_XZ.dtype}")
    if host_bound(gate_up_XZ, gate_up_XZ.numel()):  # aten's ops: one split node makes the [X, 2F] gradient
        gate_XF, up_XF = gate_up_XZ.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate_XF) * up_XF
    return _SwiGLUPacked.apply(gate_up_XZ, donate)[0]


def swiglu(gate_XF: torch.Tensor, up_XF: torch.Tensor) -> torch.Tensor:
    """Return h_XF = silu(gate_XF) * up_XF (same shape and dtype as the inputs)."""
    if gate_XF.shape != up_XF.shape:
        raise ValueError(f"swiglu: gate {tuple(gate_XF.shape)} and up {tuple(up_XF.shape)} "
                         "must have one shape")
    if gate_XF.dtype != up_XF.dtype or not gate_XF.is_floating_point():
        raise ValueError("swiglu: gate and up must share one floating dtype, "
                         f"got {gate_XF.dtype}, {up_XF.dtype}")
    if not functorch_active():  # tape autograd: native ops, autograd's own backward
        return torch.nn.functional.silu(gate_XF) * up_XF
    return _SwiGLU.apply(gate_XF, up_XF)[0]
