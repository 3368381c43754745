"""swiglu: silu(gate) * up, the gated activation of a SwiGLU MLP, with a hand-written backward.

Legend: N rows (any leading dims), F hidden features.
Math in fp32 for half-precision inputs (fp64 stays fp64); the output has the input dtype.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _SwiGLU(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(gate_NF: torch.Tensor, up_NF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ct = _compute_dtype(gate_NF.dtype)
        silu_NF = torch.nn.functional.silu(gate_NF.to(ct))
        # silu(gate) is a second, non-differentiable output so that the backward can reuse it (as
        # tape autograd does) instead of recomputing it.
        return (silu_NF * up_NF.to(ct)).to(gate_NF.dtype), silu_NF

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(*inputs, output[1])

    @staticmethod
    def backward(ctx, g_NF, _g_silu):
        gate_NF, up_NF, silu_NF = ctx.saved_tensors
        ct = _compute_dtype(gate_NF.dtype)
        a_NF, u_NF, gf_NF = gate_NF.to(ct), up_NF.to(ct), g_NF.to(ct)
        dgate = dup = None
        if ctx.needs_input_grad[0]:
            # d silu(a) / da = sig(a) * (1 + a * (1 - sig(a))), as aten's fused silu_backward kernel
            dgate = torch.ops.aten.silu_backward(gf_NF * u_NF, a_NF).to(gate_NF.dtype)
        if ctx.needs_input_grad[1]:
            dup = (gf_NF * silu_NF).to(up_NF.dtype)
        return dgate, dup


def swiglu(gate_NF: torch.Tensor, up_NF: torch.Tensor) -> torch.Tensor:
    """Return h_NF = silu(gate_NF) * up_NF (same shape and dtype as the inputs)."""
    if gate_NF.shape != up_NF.shape:
        raise ValueError(f"swiglu: gate {tuple(gate_NF.shape)} and up {tuple(up_NF.shape)} "
                         "must have one shape")
    if gate_NF.dtype != up_NF.dtype or not gate_NF.is_floating_point():
        raise ValueError("swiglu: gate and up must share one floating dtype, "
                         f"got {gate_NF.dtype}, {up_NF.dtype}")
    return _SwiGLU.apply(gate_NF, up_NF)[0]
