"""swiglu: silu(gate) * up, the gated activation of a SwiGLU MLP, with a hand-written backward.

Legend (the package's, docs/moe.md): X rows (any leading dims), F hidden features.
Math in the input dtype: aten's silu kernels compute each element in fp32 and round once, the product
rounds once more. (Half-precision inputs upcast to fp32 and back cost 3x on CPU in copies, for under one
bf16 ulp: docs/precision.md.)
Under torch.func transforms an autograd Function with a hand-written backward; under tape autograd the
same math as native ops.
"""

from __future__ import annotations

import torch

from fmoe._compat import Function, functorch_active, needs_grad


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
