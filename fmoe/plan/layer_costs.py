"""Per-layer sizes of a ModelSpec: parameters, forward FLOPs per token, and activation bytes per token.

Legend: h hidden, H query heads, G kv heads, d head dim, V vocab, E routed experts, K top-k, f expert
ffn, S shared experts, s sequence length, b bytes per element of the compute dtype.

FLOPs count a multiply-add as 2 and are per token of one forward. Attention scores are causal: a token
attends on average to s/2 positions (what a causal flash kernel computes). Backward: the input
gradient of a GEMM costs its forward again, the weight gradient once more (I = W = F for GEMMs); the
attention core's backward costs twice its forward and has no weight gradient.

Activations: what a layer keeps for its backward per token (the tensors the fmoe primitives save), in
bytes; `w_bytes` the part that only the weight gradient still needs after the input gradient (the inputs
of the GEMMs), which zero-bubble schedules keep until W.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fmoe.plan.specs import DTYPE_BYTES, ModelSpec


@dataclass(frozen=True)
class LayerCost:
    """One block (or the embedding / head), per token: `dense_params` (replicated over data-parallel ranks,
    split by TP), `expert_params` (routed experts, split over the expert group), GEMM FLOPs of the
    non-expert part, of the routed experts (counted at top-k), of the attention core, activation bytes
    (`act_bytes`, of which `w_bytes` for W and `expert_act_bytes` what expert recompute frees), and the
    MoE quantities the time model needs (`moe`: does it dispatch)."""

    kind: str
    dense_params: int
    expert_params: int
    dense_flops: float
    expert_flops: float
    attn_flops: float
    act_bytes: float
    w_bytes: float
    expert_act_bytes: float
    moe: bool

    @property
    def fwd_flops(self) -> float:
        """Forward FLOPs per token (all parts)."""
        return self.dense_flops + self.expert_flops + self.attn_flops


def _attention(m: ModelSpec) -> tuple[int, float, float, float]:
    """(params, projection FLOPs, core FLOPs, saved bytes) per token of one attention block."""
    h, H, b = m.hidden, m.heads, DTYPE_BYTES[m.dtype]
    if m.mla:
        qk = m.head_dim + m.qk_rope_dim
        q = (h * m.q_lora_rank + m.q_lora_rank * H * qk + m.q_lora_rank) if m.q_lora_rank else h * H * qk
        kv = (
            h * (m.kv_lora_rank + m.qk_rope_dim)
            + m.kv_lora_rank * H * (m.head_dim + m.v_head_dim)
            + m.kv_lora_rank
        )
        params = q + kv + H * m.v_head_dim * h + h
        proj = 2 * (params - h - m.q_lora_rank - m.kv_lora_rank)
        core = 2 * H * (qk + m.v_head_dim) * m.seq / 2
        # norm input, latents, q, k, v, attention output
        saved = b * (2 * h + m.q_lora_rank + m.kv_lora_rank + H * (2 * qk + 2 * m.v_head_dim)) + 4 * H
    else:
        d, G = m.head_dim, m.kv_heads
        params = h * H * d + 2 * h * G * d + H * d * h + h
        proj = 2 * (params - h)
        core = 2 * H * 2 * d * m.seq / 2
        saved = b * (2 * h + 2 * H * d + 2 * G * d) + 4 * H  # norm in/out, q, k, v, out; fp32 logsumexp
    return params, proj, core, saved


@functools.lru_cache(maxsize=256)
def block_cost(m: ModelSpec, moe: bool) -> LayerCost:
    """Returns the LayerCost of one transformer block (attention + a dense SwiGLU or the MoE)."""
    h, b = m.hidden, DTYPE_BYTES[m.dtype]
    a_params, a_proj, a_core, a_saved = _attention(m)
    a_w = b * (h + m.heads * m.v_head_dim)  # GEMM inputs: normed x, attention output
    if not moe:
        f = m.dense_ffn
        return LayerCost(
            "dense",
            a_params + 3 * h * f + h,
            0,
            a_proj + 6 * h * f,
            0.0,
            a_core,
            a_saved + b * (2 * h + 3 * f),
            a_w + b * (h + f),
            0.0,
            False,
        )
    E, K, f, S = m.routed_experts, m.top_k, m.expert_ffn, m.shared_experts
    dense_params = a_params + E * h + h + S * 3 * h * f  # router, norm, shared experts
    dense_flops = a_proj + 2 * E * h + S * 6 * h * f
    # routed rows: the dispatched input, gate and up outputs, the activation, the combined output
    expert_act = b * K * (2 * h + 3 * f)
    saved = a_saved + b * 2 * h + 4 * E + b * S * 3 * f + expert_act + 4 * K
    w = a_w + b * h + b * S * f + b * K * (h + f)
    return LayerCost(
        "moe", dense_params, E * 3 * h * f, dense_flops, K * 6 * h * f, a_core, saved, w, expert_act, True
    )


@functools.lru_cache(maxsize=256)
def embed_cost(m: ModelSpec) -> LayerCost:
    """The embedding: V x h parameters, no FLOPs, the looked-up rows kept for nothing (index only)."""
    return LayerCost("embed", m.vocab * m.hidden, 0, 0.0, 0.0, 0.0, 8.0, 0.0, 0.0, False)


@functools.lru_cache(maxsize=256)
def head_cost(m: ModelSpec) -> LayerCost:
    """Final norm, output head and loss (plus the MTP modules, each a 2h -> h projection, one MoE block
    and the shared head). The fp32 logits dominate its activations."""
    h, V, b = m.hidden, m.vocab, DTYPE_BYTES[m.dtype]
    head_params = (0 if m.tied_embeddings else V * h) + h
    cost = LayerCost("head", head_params, 0, 2.0 * h * V, 0.0, 0.0, b * h + 4 * V, b * h, 0.0, False)
    if not m.mtp:
        return cost
    blk = block_cost(m, moe=m.moe_layers > 0)
    per = m.mtp
    return LayerCost(
        "head",
        head_params + per * (blk.dense_params + 2 * h * h + 3 * h),
        per * blk.expert_params,
        cost.dense_flops + per * (blk.dense_flops + 4 * h * h + 2 * h * V),
        per * blk.expert_flops,
        per * blk.attn_flops,
        cost.act_bytes + per * (blk.act_bytes + b * 3 * h + 4 * V),
        cost.w_bytes + per * (blk.w_bytes + 2 * b * h),
        per * blk.expert_act_bytes,
        blk.moe,
    )


@dataclass(frozen=True)
class ModelTotals:
    """Whole-model counts: total and active parameters (per token: routed experts at top-k), and model
    FLOPs per token of one training step (forward + backward = 3 x forward; what MFU counts)."""

    params: int
    active_params: int
    train_flops_per_token: float


@functools.lru_cache(maxsize=256)
def totals(m: ModelSpec) -> ModelTotals:
    """Returns the ModelTotals of `m` (embedding and head counted once each unless tied)."""
    dense, moe_blk, emb, head = block_cost(m, False), block_cost(m, True), embed_cost(m), head_cost(m)
    blocks = [(dense, m.dense_layers), (moe_blk, m.moe_layers), (emb, 1), (head, 1)]
    params = sum((c.dense_params + c.expert_params) * n for c, n in blocks)
    e_active = m.top_k / m.routed_experts
    active = sum((c.dense_params + c.expert_params * e_active) * n for c, n in blocks)
    flops = sum(c.fwd_flops * n for c, n in blocks)
    return ModelTotals(int(params), int(active), 3.0 * flops)
