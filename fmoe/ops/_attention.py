"""attention: causal grouped-query attention with rotary position embeddings (RoPE), no weights.

    o_BTHd = attention(q_BTHd, k_BTGd, v_BTGd)      # projections are the caller's (`linear`)

Legend: B batch, T sequence positions, H query heads, G key/value heads (G divides H), d head dim
(even, for RoPE), S key positions (= T).
RoPE is the half-split ("rotate_half") form: for i < d/2, the pair (x[i], x[i + d/2]) is rotated by
angle pos * theta^(-2i/d), with angles computed in fp32 (fp64 for fp64 input).
The autograd Function saves only q, k, v and recomputes the forward inside its backward with
`torch.func.vjp` (works under an outer vjp, tape autograd and vmap), so no [T, S] probabilities are
kept between forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _angle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope(x_BTHd: torch.Tensor, positions_T: torch.Tensor | None = None,
         theta: float = 10000.0) -> torch.Tensor:
    """Return x rotated by RoPE (same shape and dtype); x is [..., T, H, d] with d even.

    `positions_T` (integer or float [T], default arange(T)) gives each position's index.
    Differentiable by plain torch ops.
    """
    T, d = x_BTHd.shape[-3], x_BTHd.shape[-1]
    if d % 2:
        raise ValueError(f"rope: head dim must be even, got {d}")
    ct = _angle_dtype(x_BTHd.dtype)
    if positions_T is None:
        positions_T = torch.arange(T, device=x_BTHd.device)
    if positions_T.shape != (T,):
        raise ValueError(f"rope: positions must have shape ({T},), got {tuple(positions_T.shape)}")
    inv_freq_h = theta ** (-torch.arange(0, d // 2, device=x_BTHd.device, dtype=ct) * 2 / d)
    ang_Th = positions_T.to(ct).unsqueeze(-1) * inv_freq_h  # [T, d/2]
    cos_T1h, sin_T1h = ang_Th.cos().unsqueeze(-2), ang_Th.sin().unsqueeze(-2)  # broadcast over heads
    xf = x_BTHd.to(ct)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return torch.cat([x1 * cos_T1h - x2 * sin_T1h, x2 * cos_T1h + x1 * sin_T1h], dim=-1).to(x_BTHd.dtype)


def _attention_math(q_BTHd, k_BTGd, v_BTGd, positions_T, theta: float, causal: bool) -> torch.Tensor:
    H, G = q_BTHd.shape[-2], k_BTGd.shape[-2]
    q_BHTd = rope(q_BTHd, positions_T, theta).transpose(-3, -2)
    k_BGSd = rope(k_BTGd, positions_T, theta).transpose(-3, -2)
    v_BGSd = v_BTGd.transpose(-3, -2)
    if G != H:
        # Explicit repeat (not enable_gqa) so every sdpa backend, and its vjp, sees plain MHA shapes.
        k_BGSd = k_BGSd.repeat_interleave(H // G, dim=-3)
        v_BGSd = v_BGSd.repeat_interleave(H // G, dim=-3)
    o_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BGSd, v_BGSd, is_causal=causal)
    return o_BHTd.transpose(-3, -2)


class _Attention(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(q_BTHd, k_BTGd, v_BTGd, positions_T, theta: float, causal: bool) -> torch.Tensor:
        return _attention_math(q_BTHd, k_BTGd, v_BTGd, positions_T, theta, causal)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q_BTHd, k_BTGd, v_BTGd, positions_T, theta, causal = inputs
        ctx.save_for_backward(q_BTHd, k_BTGd, v_BTGd, positions_T)
        ctx.theta, ctx.causal = theta, causal

    @staticmethod
    def backward(ctx, g_BTHd):
        q_BTHd, k_BTGd, v_BTGd, positions_T = ctx.saved_tensors
        theta, causal = ctx.theta, ctx.causal
        _, vjp_fn = torch.func.vjp(lambda q, k, v: _attention_math(q, k, v, positions_T, theta, causal),
                                   q_BTHd, k_BTGd, v_BTGd)
        dq, dk, dv = vjp_fn(g_BTHd.contiguous())
        return dq, dk, dv, None, None, None


def attention(q_BTHd: torch.Tensor, k_BTGd: torch.Tensor, v_BTGd: torch.Tensor, *,
              rope_theta: float = 10000.0, causal: bool = True,
              positions_T: torch.Tensor | None = None) -> torch.Tensor:
    """Return o_BTHd = softmax(rope(q) rope(k)^T / sqrt(d) + causal mask) v, per head.

    q is [B, T, H, d] (or [T, H, d]); k and v are [B, T, G, d] with G dividing H (grouped-query
    attention: query head h reads kv head h // (H / G)). RoPE (theta `rope_theta`, positions
    `positions_T`, default arange(T)) is applied to q and k. Output has q's shape and dtype.
    """
    if q_BTHd.dim() not in (3, 4) or k_BTGd.dim() != q_BTHd.dim() or v_BTGd.dim() != q_BTHd.dim():
        raise ValueError(f"attention: q, k, v must all be [B, T, heads, d] or [T, heads, d], got "
                         f"{tuple(q_BTHd.shape)}, {tuple(k_BTGd.shape)}, {tuple(v_BTGd.shape)}")
    if k_BTGd.shape != v_BTGd.shape:
        raise ValueError(f"attention: k {tuple(k_BTGd.shape)} and v {tuple(v_BTGd.shape)} "
                         "must have one shape")
    if q_BTHd.shape[:-2] != k_BTGd.shape[:-2] or q_BTHd.shape[-1] != k_BTGd.shape[-1]:
        raise ValueError(f"attention: q {tuple(q_BTHd.shape)} and k {tuple(k_BTGd.shape)} must agree on "
                         "batch, sequence and head dim")
    H, G, d = q_BTHd.shape[-2], k_BTGd.shape[-2], q_BTHd.shape[-1]
    if G == 0 or H % G:
        raise ValueError(f"attention: kv heads G={G} must divide query heads H={H}")
    if d % 2:
        raise ValueError(f"attention: head dim must be even for RoPE, got {d}")
    if not (q_BTHd.dtype == k_BTGd.dtype == v_BTGd.dtype) or not q_BTHd.is_floating_point():
        raise ValueError(f"attention: q, k, v must share one floating dtype, got "
                         f"{q_BTHd.dtype}, {k_BTGd.dtype}, {v_BTGd.dtype}")
    T = q_BTHd.shape[-3]
    if positions_T is None:
        positions_T = torch.arange(T, device=q_BTHd.device)
    elif positions_T.shape != (T,):
        raise ValueError(f"attention: positions must have shape ({T},), got {tuple(positions_T.shape)}")
    return _Attention.apply(q_BTHd, k_BTGd, v_BTGd, positions_T, float(rope_theta), bool(causal))
