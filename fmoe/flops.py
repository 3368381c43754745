"""Forward FLOPs per token of a GPT's parts: one place for the formulas that the runtime's pipeline cut
(fmoe.pipeline.cut) balances with and the planner (fmoe.plan.layer_costs) prices with.

Legend (docs/moe.md): D model width, F ffn width, E routed experts, K top-k, H query heads, G kv heads,
d head dim, V vocab, s sequence length; with MLA r rotary qk dim, e v head dim, Cq / Ckv latent widths.

A multiply-add counts 2. Attention scores are causal: a token attends on average to s/2 positions.
Plain numbers in, so the planner's ModelSpec and the runtime's GPTConfig both call them.
"""

from __future__ import annotations

from fmoe.config import GPTConfig

CE_FLOPS_PER_LOGIT = 5.0  # max, subtract, exp, sum, and the gradient's softmax - onehot, per logit
GATHER_FLOPS_PER_FEATURE = 2.0  # the embedding does no arithmetic; its row gather + copy, as FLOPs


def attention_flops(D: int, H: int, G: int, d: int, s: int, *, r: int = 0, e: int = 0, Cq: int = 0,
                    Ckv: int = 0) -> tuple[float, float]:
    """Returns (projection GEMM FLOPs, core FLOPs) per token of one attention block: GQA, or MLA when
    Ckv > 0 (queries through Cq when Cq > 0, keys and values from the Ckv latent)."""
    if Ckv:
        e = e or d
        qk = d + r
        q = D * Cq + Cq * H * qk if Cq else D * H * qk
        kv = D * (Ckv + r) + Ckv * H * (d + e)
        return 2.0 * (q + kv + H * e * D), 2.0 * H * (qk + e) * s / 2
    return 2.0 * (D * H * d + 2 * D * G * d + H * d * D), 2.0 * H * 2 * d * s / 2


def swiglu_flops(D: int, F: int) -> float:
    """Returns the FLOPs per token of one SwiGLU of width F (gate, up, down)."""
    return 6.0 * D * F


def moe_flops(D: int, E: int, K: int, F: int, shared: int) -> float:
    """Returns the FLOPs per token of one MoE: the router, K routed experts and the shared experts."""
    return 2.0 * E * D + (K + shared) * swiglu_flops(D, F)


def head_flops(D: int, V: int) -> float:
    """Returns the FLOPs per token of the output head and its cross-entropy."""
    return 2.0 * D * V + CE_FLOPS_PER_LOGIT * V


def gpt_part_flops(cfg: GPTConfig, seq: int = 0) -> tuple[tuple[float, ...], float, float]:
    """Returns (per-layer FLOPs [n_layers], embedding, final norm + head + loss + MTP) per token of one
    forward of `cfg` at sequence length `seq` (0: the attention core left out)."""
    layers, first, (head, mtp) = gpt_tail_part_flops(cfg, seq)
    return layers, first, head + mtp


def gpt_tail_part_flops(cfg: GPTConfig, seq: int = 0) -> tuple[tuple[float, ...], float, tuple[float, float]]:
    """Returns `gpt_part_flops` with the last part in two: (final norm + head + loss, MTP: its input
    projection, block, and pass through the shared head and loss; 0 without MTP). The MTP part can run
    on a stage of its own after the loss (fmoe.pipeline.cut)."""
    D, m = cfg.d_model, cfg.moe
    proj, core = attention_flops(D, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, seq, r=cfg.qk_rope_head_dim,
                                 e=cfg.v_head_dim or 0, Cq=cfg.q_lora_rank, Ckv=cfg.kv_lora_rank)
    dense = proj + core + swiglu_flops(D, cfg.d_ff_dense)
    moe = proj + core + moe_flops(D, m.num_experts, m.top_k, m.d_ff, m.num_shared_experts)
    layers = tuple(dense if i < cfg.num_dense_layers else moe for i in range(cfg.n_layers))
    head = head_flops(D, cfg.vocab_size)
    # one MoE block, its 2D -> D projection, a second pass through the shared head
    mtp = (moe if cfg.n_layers > cfg.num_dense_layers else dense) + 4.0 * D * D + head if cfg.mtp else 0.0
    return layers, GATHER_FLOPS_PER_FEATURE * D, (head, mtp)
