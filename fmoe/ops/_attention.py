"""attention: causal grouped-query attention with rotary position embeddings (RoPE), no weights.

    o_BSHd = attention(q_BSHd, k_BSGd, v_BSGd)      # projections are the caller's (`linear`)
    o_BSHd = attention(q_BSHd, k_BSGd, v_BSGd, positions_S=positions_BS, segments_BS=segments_BS)
                                                    # documents packed in a sequence (fmoe/packing.py)

Legend (the package's, docs/moe.md): B sequences, S positions (queries and keys alike), H query heads,
G key/value heads (G divides H), d head dim (even, for RoPE), h = d / 2 rotation pairs; X, Y any length.
Documents: with `segments_BS` (each position's document) a query attends to the earlier keys of its own
document only, sdpa taking a boolean [B, 1, S, S] mask instead of its causal flag; `positions_S` may then
be per sequence [B, S] (positions restarting at each document).
RoPE is the half-split ("rotate_half") form: for i < d/2, the pair (x[i], x[i + d/2]) is rotated by
angle pos * theta^(-2i/d), with angles computed in fp32 (fp64 for fp64 input).
Under torch.func transforms an autograd Function saves only q, k, v and recomputes the forward inside its
backward with `torch.func.vjp` (works under an outer vjp and vmap), so no [S, S] probabilities are kept
between forward and backward. Under tape autograd alone (no transform active) the same math runs as
plain ops and sdpa's own backward applies: flash attention keeps its output and log-sum-exp, and
nothing is recomputed. The RoPE tables of the default positions are built once per shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fmoe._compat import Function, functorch_active, trace_safe_cache, under_vmap
from fmoe.ops._dtypes import cast, compute_dtype


def rope(x_BSHd: torch.Tensor, positions_S: torch.Tensor | None = None,
         theta: float = 10000.0) -> torch.Tensor:
    """Return x rotated by RoPE (same shape and dtype); x is [..., S, H, d] with d even.

    `positions_S` (integer or float [S], default arange(S)) gives each position's index; [B, S] (x's
    leading dims) gives each sequence its own (documents' positions restarting, fmoe/packing.py).
    Differentiable by plain torch ops.
    """
    S, d = x_BSHd.shape[-3], x_BSHd.shape[-1]
    if d % 2:
        raise ValueError(f"rope: head dim must be even, got {d}")
    ct = compute_dtype(x_BSHd.dtype)
    if positions_S is None:
        cos_S1d, signed_sin_S1d = _default_tables(S, d, float(theta), ct, x_BSHd.device)
    else:
        lead = tuple(x_BSHd.shape[:-2])
        if tuple(positions_S.shape) not in ((S,), lead):
            raise ValueError(f"rope: positions must have shape ({S},) or {lead}, got "
                             f"{tuple(positions_S.shape)}")
        cos_S1d, signed_sin_S1d = _tables(positions_S, d, theta, ct)  # [S, 1, d] or [B, S, 1, d]
    xf = cast(x_BSHd, ct)
    # x * [cos, cos] + [x2, x1] * [-sin, sin]: three full-width kernels on contiguous rows where rotating
    # each half apart takes six on strided halves; the halves swap by a roll, whose backward is a roll
    # (slices' would zero-fill a full-size gradient each). Forward and backward 1.4x faster at d = 64.
    return cast(torch.addcmul(xf * cos_S1d, xf.roll(d // 2, dims=-1), signed_sin_S1d), x_BSHd.dtype)


def _tables(positions_S: torch.Tensor, d: int, theta: float, ct: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Returns (cos, signed sin) [..., S, 1, d] of the rotation angles a = pos * theta^(-2i/d) of positions
    [..., S], in dtype ct:
    [cos a, cos a] and [-sin a, sin a] along the head dim (broadcast over heads)."""
    inv_freq_h = theta ** (-torch.arange(0, d // 2, device=positions_S.device, dtype=ct) * 2 / d)
    ang_Sh = positions_S.to(ct).unsqueeze(-1) * inv_freq_h  # [S, h]
    cos_Sh, sin_Sh = ang_Sh.cos(), ang_Sh.sin()
    return (torch.cat([cos_Sh, cos_Sh], -1).unsqueeze(-2), torch.cat([-sin_Sh, sin_Sh], -1).unsqueeze(-2))


@trace_safe_cache(maxsize=16)
def _default_tables(S: int, d: int, theta: float, ct: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, ...]:
    # Positions arange(S): the same tables for every call of a model, so they are built once.
    return _tables(torch.arange(S, device=device), d, theta, ct)


def sdpa(q_BHSd: torch.Tensor, k_BHSd: torch.Tensor, v_BHSe: torch.Tensor, *, causal: bool,
         mask: torch.Tensor | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Return o_BHSe = softmax(q k^T / sqrt(q's last dim) + mask) v: F.scaled_dot_product_attention, or
    under torch.func.vmap the same products written out (sdpa's CPU kernels have no batching rule, and
    vmap would run them once per batch element). `mask`: bool, broadcasting to [B, H, S, Sk], True where a
    query attends; given, it replaces `causal` (it holds causality itself, as `_mask` makes it)."""
    if not under_vmap():
        flags = {"is_causal": causal} if mask is None else {"attn_mask": mask}
        return F.scaled_dot_product_attention(q_BHSd, k_BHSd, v_BHSe, enable_gqa=enable_gqa, **flags)
    H, G = q_BHSd.shape[-3], k_BHSd.shape[-3]
    if G != H:
        k_BHSd, v_BHSe = (t.repeat_interleave(H // G, dim=-3) for t in (k_BHSd, v_BHSe))
    score_BHSS = (q_BHSd @ k_BHSd.transpose(-2, -1)) * q_BHSd.shape[-1] ** -0.5
    if mask is not None:
        score_BHSS = score_BHSS.masked_fill(~mask, float("-inf"))
    elif causal:
        S, Sk = score_BHSS.shape[-2:]
        above_SS = torch.ones(S, Sk, dtype=torch.bool, device=q_BHSd.device).triu(Sk - S + 1)
        score_BHSS = score_BHSS.masked_fill(above_SS, float("-inf"))
    return torch.softmax(score_BHSS, -1) @ v_BHSe


def document_mask(segments_X: torch.Tensor, segments_Y: torch.Tensor) -> torch.Tensor:
    """Returns bool [..., X, Y]: True where query x and key y lie in one document, from the document index
    of each query [..., X] and each key [..., Y] (fmoe/packing.py; causality is the caller's)."""
    return segments_X.unsqueeze(-1) == segments_Y.unsqueeze(-2)


def _mask(segments_BS: torch.Tensor | None, S: int, causal: bool,
          device: torch.device) -> torch.Tensor | None:
    """sdpa's boolean mask [B, 1, S, S] (True: attend) of documents `segments_BS`, causal or not; None
    without documents (sdpa's own causal flag then)."""
    if segments_BS is None:
        return None
    mask_BSS = document_mask(segments_BS, segments_BS)
    if causal:
        mask_BSS = mask_BSS & torch.ones(S, S, dtype=torch.bool, device=device).tril()
    return mask_BSS.unsqueeze(-3)  # one mask for every head


def _attention_math(q_BSHd, k_BSGd, v_BSGd, positions_S, theta: float, causal: bool,
                    native_gqa: bool = False, segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    H, G = q_BSHd.shape[-2], k_BSGd.shape[-2]
    # Heads before positions ([..., S, H, d] -> [..., H, S, d]); native transposes, no einops parsing on
    # this per-layer path.
    q_BHSd = rope(q_BSHd, positions_S, theta).transpose(-3, -2)
    k_BGSd = rope(k_BSGd, positions_S, theta).transpose(-3, -2)
    v_BGSd = v_BSGd.transpose(-3, -2)
    mask = _mask(segments_BS, q_BSHd.shape[-3], causal, q_BSHd.device)
    if G != H and native_gqa:
        # Tape autograd: sdpa reads each kv head for its H / G query heads itself (no repeated copies of
        # k and v, saved for the backward, and no repeat in the graph).
        o_BHSd = sdpa(q_BHSd, k_BGSd, v_BGSd, causal=causal, mask=mask, enable_gqa=True)
        return o_BHSd.transpose(-3, -2)
    if G != H:
        # Explicit repeat (not enable_gqa) so every sdpa backend, and its vjp, sees plain MHA shapes.
        k_BGSd = k_BGSd.repeat_interleave(H // G, dim=-3)
        v_BGSd = v_BGSd.repeat_interleave(H // G, dim=-3)
    o_BHSd = sdpa(q_BHSd, k_BGSd, v_BGSd, causal=causal, mask=mask)
    return o_BHSd.transpose(-3, -2)


class _Attention(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(q_BSHd, k_BSGd, v_BSGd, positions_S, theta: float, causal: bool, segments_BS) -> torch.Tensor:
        return _attention_math(q_BSHd, k_BSGd, v_BSGd, positions_S, theta, causal, segments_BS=segments_BS)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q_BSHd, k_BSGd, v_BSGd, positions_S, theta, causal, segments_BS = inputs
        ctx.save_for_backward(q_BSHd, k_BSGd, v_BSGd, positions_S, segments_BS)
        ctx.theta, ctx.causal = theta, causal

    @staticmethod
    def backward(ctx, g_BSHd):
        q_BSHd, k_BSGd, v_BSGd, positions_S, segments_BS = ctx.saved_tensors
        theta, causal = ctx.theta, ctx.causal
        _, vjp_fn = torch.func.vjp(lambda q, k, v: _attention_math(q, k, v, positions_S, theta, causal,
                                                                   segments_BS=segments_BS),
                                   q_BSHd, k_BSGd, v_BSGd)
        dq, dk, dv = vjp_fn(g_BSHd.contiguous(), retain_graph=False)  # free its activations as it goes
        return dq, dk, dv, None, None, None, None


def attention(q_BSHd: torch.Tensor, k_BSGd: torch.Tensor, v_BSGd: torch.Tensor, *,
              rope_theta: float = 10000.0, causal: bool = True,
              positions_S: torch.Tensor | None = None,
              segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Return o_BSHd = softmax(rope(q) rope(k)^T / sqrt(d) + causal mask) v, per head.

    q is [B, S, H, d] (or [S, H, d]); k and v are [B, S, G, d] with G dividing H (grouped-query
    attention: query head h reads kv head h // (H / G)). RoPE (theta `rope_theta`, positions
    `positions_S`, [S] or per sequence [B, S], default arange(S)) is applied to q and k.
    `segments_BS` (integer [B, S], q's leading dims): each position's document; a query then attends to
    the keys of its own document only (fmoe/packing.py). Output has q's shape and dtype.
    """
    if q_BSHd.dim() not in (3, 4) or k_BSGd.dim() != q_BSHd.dim() or v_BSGd.dim() != q_BSHd.dim():
        raise ValueError(f"attention: q, k, v must all be [B, S, heads, d] or [S, heads, d], got "
                         f"{tuple(q_BSHd.shape)}, {tuple(k_BSGd.shape)}, {tuple(v_BSGd.shape)}")
    if k_BSGd.shape != v_BSGd.shape:
        raise ValueError(f"attention: k {tuple(k_BSGd.shape)} and v {tuple(v_BSGd.shape)} "
                         "must have one shape")
    if q_BSHd.shape[:-2] != k_BSGd.shape[:-2] or q_BSHd.shape[-1] != k_BSGd.shape[-1]:
        raise ValueError(f"attention: q {tuple(q_BSHd.shape)} and k {tuple(k_BSGd.shape)} must agree on "
                         "batch, sequence and head dim")
    H, G, d = q_BSHd.shape[-2], k_BSGd.shape[-2], q_BSHd.shape[-1]
    if G == 0 or H % G:
        raise ValueError(f"attention: kv heads G={G} must divide query heads H={H}")
    if d % 2:
        raise ValueError(f"attention: head dim must be even for RoPE, got {d}")
    if not (q_BSHd.dtype == k_BSGd.dtype == v_BSGd.dtype) or not q_BSHd.is_floating_point():
        raise ValueError(f"attention: q, k, v must share one floating dtype, got "
                         f"{q_BSHd.dtype}, {k_BSGd.dtype}, {v_BSGd.dtype}")
    S, lead = q_BSHd.shape[-3], tuple(q_BSHd.shape[:-2])
    if positions_S is not None and tuple(positions_S.shape) not in ((S,), lead):
        raise ValueError(f"attention: positions must have shape ({S},) or {lead}, got "
                         f"{tuple(positions_S.shape)}")
    if segments_BS is not None and tuple(segments_BS.shape) != lead:
        raise ValueError(f"attention: segments must have shape {lead} (q's batch and positions), got "
                         f"{tuple(segments_BS.shape)}")
    if not functorch_active():
        # Tape autograd: sdpa's own backward (flash on CPU keeps the output and log-sum-exp, not the
        # [S, S] probabilities), no recompute. Under torch.func the Function below recomputes instead.
        return _attention_math(q_BSHd, k_BSGd, v_BSGd, positions_S, float(rope_theta), bool(causal),
                               native_gqa=q_BSHd.device.type in ("cpu", "cuda"), segments_BS=segments_BS)
    if positions_S is None:
        positions_S = torch.arange(S, device=q_BSHd.device)
    return _Attention.apply(q_BSHd, k_BSGd, v_BSGd, positions_S, float(rope_theta), bool(causal), segments_BS)
