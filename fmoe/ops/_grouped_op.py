"""fmoe::grouped_mm and fmoe::grouped_mm_dw: the grouped products as torch.library ops that transforms see.

    y_MF = grouped_mm(x_MD, w_EDF, offs_E, kernel)      # rows offs[e-1]:offs[e] of x times w[e]
    dw_EDF = grouped_mm_dw(x_MD, g_MF, offs_E, kernel)  # per group e: x[rows of e]^T @ g[rows of e]

Legend (the package's, docs/moe.md): M rows grouped by expert, D / F features, E groups (experts),
B a batch that torch.func.vmap maps over.

Why ops and not calls: `torch._grouped_mm` has no vmap batching rule, and its fake-tensor rule (what
torch.compile traces with) accepts bf16 only while the CPU kernel also runs fp32; the "loop" kernel
reads the group ends to the host, which neither vmap nor compile can trace. As library ops they carry
their own rules:
- fake: the output's shape from the inputs' shapes (no data read), so compile traces them with static
  shapes whatever the routing (the rows M = T * K of a dropless layout do not depend on it);
- vmap: the mapped dimension folded into the groups, B x E groups with offsets shifted by b * M, one
  product for the whole batch (an unmapped weight is repeated per batch element);
- autograd: `product` / `product_dw` wrap them in Functions whose backwards are the other products, so
  grad, vjp and grad-of-grad work.
`kernel` names what runs inside: "grouped_mm" (`torch._grouped_mm`, the caller has checked dtype and
alignment) or "loop" (a product per group, any dtype, the ends read to the host inside the op).
"""

from __future__ import annotations

import torch

from fmoe._compat import grouped_mm as _aten_grouped_mm
from fmoe._compat import needs_grad

_KERNELS = ("grouped_mm", "loop")


def _bounds(offs_E: torch.Tensor) -> list[int]:
    return [0, *offs_E.tolist()]


@torch.library.custom_op("fmoe::grouped_mm", mutates_args=())
def grouped_mm(x_MD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, kernel: str) -> torch.Tensor:
    """Return y_MF: rows offs[e-1]:offs[e] of x_MD times w_EDF[e] (int32 cumulative ends offs_E)."""
    if kernel == "grouped_mm":
        return _aten_grouped_mm(x_MD.contiguous(), w_EDF, offs=offs_E)
    b = _bounds(offs_E)
    out_MF = x_MD.new_zeros(x_MD.shape[0], w_EDF.shape[-1])
    for e in range(w_EDF.shape[0]):
        if b[e + 1] > b[e]:
            torch.mm(x_MD[b[e]:b[e + 1]], w_EDF[e], out=out_MF[b[e]:b[e + 1]])
    return out_MF


@torch.library.custom_op("fmoe::grouped_mm_dw", mutates_args=())
def grouped_mm_dw(x_MD: torch.Tensor, g_MF: torch.Tensor, offs_E: torch.Tensor, kernel: str) -> torch.Tensor:
    """Return dw_EDF: per group e, x_MD[rows of e]^T @ g_MF[rows of e] (zero for an empty group)."""
    E = offs_E.shape[0]
    if kernel == "grouped_mm":
        return _aten_grouped_mm(x_MD.contiguous().t(), g_MF.contiguous(), offs=offs_E)
    b = _bounds(offs_E)
    out_EDF = x_MD.new_zeros(E, x_MD.shape[-1], g_MF.shape[-1])
    for e in range(E):
        if b[e + 1] > b[e]:
            torch.mm(x_MD[b[e]:b[e + 1]].t(), g_MF[b[e]:b[e + 1]], out=out_EDF[e])
    return out_EDF


@grouped_mm.register_fake
def _(x_MD, w_EDF, offs_E, kernel):
    return x_MD.new_empty(x_MD.shape[0], w_EDF.shape[-1])


@grouped_mm_dw.register_fake
def _(x_MD, g_MF, offs_E, kernel):
    return x_MD.new_empty(offs_E.shape[0], x_MD.shape[-1], g_MF.shape[-1])


# ---- vmap: B x E groups ------------------------------------------------------------------------------

def _batched(t: torch.Tensor, dim: int | None, B: int) -> torch.Tensor:
    """t with the mapped dim first (expanded to B when t is not mapped)."""
    return t.movedim(dim, 0) if dim is not None else t.unsqueeze(0).expand(B, *t.shape)


def _folded_offsets(offs_BE: torch.Tensor, M: int) -> torch.Tensor:
    """The B x E group ends of B row sets of M rows laid one after another: offs[b, e] + b * M."""
    shift_B1 = torch.arange(offs_BE.shape[0], device=offs_BE.device, dtype=offs_BE.dtype).unsqueeze(1) * M
    return (offs_BE + shift_B1).reshape(-1)


def _operands(info, in_dims, a, b, offs_E) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, a, b, offs_BE): both ops' operands and offsets, the mapped dim first (expanded if unmapped)."""
    B = info.batch_size
    a_dim, b_dim, offs_dim, _ = in_dims
    return B, _batched(a, a_dim, B), _batched(b, b_dim, B), _batched(offs_E, offs_dim, B)


@grouped_mm.register_vmap
def _(info, in_dims, x_MD, w_EDF, offs_E, kernel):
    B, x_BMD, w_BEDF, offs_BE = _operands(info, in_dims, x_MD, w_EDF, offs_E)
    M = x_BMD.shape[1]
    y = grouped_mm(x_BMD.reshape(B * M, -1), w_BEDF.reshape(-1, *w_BEDF.shape[2:]),
                   _folded_offsets(offs_BE, M), kernel)
    return y.view(B, M, -1), 0


@grouped_mm_dw.register_vmap
def _(info, in_dims, x_MD, g_MF, offs_E, kernel):
    B, x_BMD, g_BMF, offs_BE = _operands(info, in_dims, x_MD, g_MF, offs_E)
    M = x_BMD.shape[1]
    dw = grouped_mm_dw(x_BMD.reshape(B * M, -1), g_BMF.reshape(B * M, -1), _folded_offsets(offs_BE, M),
                       kernel)
    return dw.view(B, offs_BE.shape[1], *dw.shape[1:]), 0


# ---- autograd: each backward is the other products ----------------------------------------------------
# A Function (not the ops' register_autograd: torch 2.13 runs a custom op's registered autograd as an
# old-style Function, which torch.func.grad refuses) with the offsets as a tensor argument, so vmap's
# levels see them; its vmap rule is generated from the ops' own. Its forward calls the op on detached inputs:
# a trace of torch.func.grad (torch.compile) hands the forward the grad-tracking tensors, and the op must
# not record anything itself (under no_grad instead, that trace loses the weight's gradient).

def _save_operands(ctx, inputs, output):
    """Both Functions' setup_context: their two operands and the offsets saved, the kernel kept."""
    a, b, offs_E, kernel = inputs
    ctx.save_for_backward(a, b, offs_E)
    ctx.kernel = kernel


class _Product(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_MD, w_EDF, offs_E, kernel):
        return grouped_mm(x_MD.detach(), w_EDF.detach(), offs_E, kernel)  # this Function is its autograd

    setup_context = staticmethod(_save_operands)

    @staticmethod
    def backward(ctx, g_MF):
        x_MD, w_EDF, offs_E = ctx.saved_tensors
        g_MF = g_MF.contiguous()  # a cotangent may be expanded (stride 0); the kernels reject that
        dx = product(g_MF, w_EDF.transpose(-2, -1), offs_E, ctx.kernel) if needs_grad(ctx)[0] else None
        dw = product_dw(x_MD, g_MF, offs_E, ctx.kernel) if needs_grad(ctx)[1] else None
        return dx, dw, None, None


class _ProductDw(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_MD, g_MF, offs_E, kernel):
        return grouped_mm_dw(x_MD.detach(), g_MF.detach(), offs_E, kernel)

    setup_context = staticmethod(_save_operands)

    @staticmethod
    def backward(ctx, gw_EDF):
        x_MD, g_MF, offs_E = ctx.saved_tensors
        gw_EDF = gw_EDF.contiguous()
        dx = product(g_MF, gw_EDF.transpose(-2, -1), offs_E, ctx.kernel) if needs_grad(ctx)[0] else None
        dg = product(x_MD, gw_EDF, offs_E, ctx.kernel) if needs_grad(ctx)[1] else None
        return dx, dg, None, None


def product(x_MD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, kernel: str) -> torch.Tensor:
    """Return y_MF = `grouped_mm` (differentiable in x and w, to any order; vmap and compile see it)."""
    return _Product.apply(x_MD, w_EDF, offs_E, kernel)


def product_dw(x_MD: torch.Tensor, g_MF: torch.Tensor, offs_E: torch.Tensor, kernel: str) -> torch.Tensor:
    """Return dw_EDF = `grouped_mm_dw` (differentiable in x and g; vmap and compile see it)."""
    return _ProductDw.apply(x_MD, g_MF, offs_E, kernel)
