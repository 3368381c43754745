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

import dataclasses
import functools
from dataclasses import dataclass

from fmoe.parallel.counters import all_gather_sent, all_reduce_sent, reduce_scatter_sent
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
def loss_cost(m: ModelSpec) -> LayerCost:
    """Final norm, output head and loss (kind "loss"); the fp32 logits dominate its activations."""
    h, V, b = m.hidden, m.vocab, DTYPE_BYTES[m.dtype]
    head_params = (0 if m.tied_embeddings else V * h) + h
    return LayerCost("loss", head_params, 0, 2.0 * h * V, 0.0, 0.0, b * h + 4 * V, b * h, 0.0, False)


@functools.lru_cache(maxsize=256)
def mtp_cost(m: ModelSpec) -> LayerCost | None:
    """The MTP modules (kind "mtp"): each a 2h -> h projection, one block and a pass through the shared
    head and loss; None without MTP. The runtime may run them on a chunk of their own after the loss."""
    if not m.mtp:
        return None
    h, V, b = m.hidden, m.vocab, DTYPE_BYTES[m.dtype]
    blk, per = block_cost(m, moe=m.moe_layers > 0), m.mtp
    return LayerCost("mtp", per * (blk.dense_params + 2 * h * h + 3 * h), per * blk.expert_params,
                     per * (blk.dense_flops + 4 * h * h + 2 * h * V), per * blk.expert_flops,
                     per * blk.attn_flops, per * (blk.act_bytes + b * 3 * h + 4 * V),
                     per * (blk.w_bytes + 2 * b * h), per * blk.expert_act_bytes, blk.moe)


@functools.lru_cache(maxsize=256)
def head_cost(m: ModelSpec) -> LayerCost:
    """The end of the model on one chunk (kind "head"): `loss_cost` and `mtp_cost` together."""
    loss, mtp = loss_cost(m), mtp_cost(m)
    if mtp is None:
        return dataclasses.replace(loss, kind="head")
    return LayerCost("head", *(getattr(loss, f) + getattr(mtp, f) for f in _SUMMED), mtp.moe)


_SUMMED = ("dense_params", "expert_params", "dense_flops", "expert_flops", "attn_flops", "act_bytes",
           "w_bytes", "expert_act_bytes")


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


# ---- tensor-parallel collectives ---------------------------------------------------------------------

INT64_BYTES = 8  # the router's load counts (fmoe.ops.expert_counts) are int64
FP32_BYTES = 4  # the vocab-parallel cross-entropy reduces in fp32 (or wider)
SEND = {"all_gather": all_gather_sent, "reduce_scatter": reduce_scatter_sent, "all_reduce": all_reduce_sent}


@dataclass(frozen=True)
class Collective:
    """One tensor-parallel collective a layer issues per microbatch: `op` the runtime's name for it (what
    `CommCounters` counts it under), `kind` ("all_gather", "reduce_scatter", "all_reduce"), `phase` "F"
    (forward) or "B" (the backward's dx pass, where the runtime runs every backward collective) and
    `total_bytes` (an all-gather's result, a reduce-scatter's input, an all-reduce's tensor)."""

    op: str
    kind: str
    phase: str
    total_bytes: int

    def sent(self, tp: int) -> int:
        """Returns the bytes one of `tp` ranks sends (fmoe.parallel.counters' formulas)."""
        return SEND[self.kind](self.total_bytes, tp)


def _enter(op: str, nbytes: int, sp: bool) -> tuple[Collective, ...]:
    """A replicated-input TP region entered with `nbytes` of activations: under SP an all-gather (its
    backward a reduce-scatter), else copy_to_tp (its backward an all-reduce)."""
    if sp:
        return (Collective(op, "all_gather", "F", nbytes),
                Collective(op + ".bwd", "reduce_scatter", "B", nbytes))
    return (Collective("tp.copy.bwd", "all_reduce", "B", nbytes),)


def _leave(nbytes: int, sp: bool) -> tuple[Collective, ...]:
    """A TP region's partial sums of `nbytes` leaving it: under SP a reduce-scatter (backward all-gather),
    else reduce_from_tp (an all-reduce; its backward passes the gradient on)."""
    if sp:
        return (Collective("tp.sp_scatter", "reduce_scatter", "F", nbytes),
                Collective("tp.sp_scatter.bwd", "all_gather", "B", nbytes))
    return (Collective("tp.reduce", "all_reduce", "F", nbytes),)


def _grad_sums(op: str, elems: tuple[int, ...], b: int, per_step: bool) -> tuple[Collective, ...]:
    """Replicated weights of these sizes read through `tp_weight` (their gradients partial per rank):
    `per_step` (what `fmoe train` runs) their fp32 gradients summed once per step, phase "S" (one flat
    all-reduce at the step's end: `sum_tp_partials`); else each one's gradient all-reduced in the backward
    of every microbatch, in the compute dtype."""
    if per_step:
        return tuple(Collective("tp.weight_grads", "all_reduce", "S", n * FP32_BYTES) for n in elems if n)
    return tuple(Collective(op, "all_reduce", "B", n * b) for n in elems if n)


def _attention_collectives(m: ModelSpec, T: int, sp: bool, qk_norm: bool,
                           per_step: bool) -> tuple[Collective, ...]:
    """fmoe.block.self_attention's collectives: GQA's, or MLA's (fmoe.mla.mla: the latents, concatenated,
    enter the TP region in one collective; under SP the down projections and latent norms run before it on
    the rank's positions, so their gradients are summed)."""
    h, b = m.hidden, DTYPE_BYTES[m.dtype]
    if not m.mla:
        entry = _enter("tp.sp_gather", T * h * b, sp)
        norms = (h if sp else 0,) + ((m.head_dim, m.head_dim) if qk_norm else ())
    else:
        kv = m.kv_lora_rank + m.qk_rope_dim  # the kv latent and the shared rotary key
        q = m.q_lora_rank or h  # no q bottleneck: the queries project from the normed input itself
        entry = _enter("tp.sp_gather", T * (q + kv) * b, sp)  # concatenated: one collective moves both
        # under SP the replicated down-projections and latent norms see the rank's positions only
        norms = (h, h * m.q_lora_rank, m.q_lora_rank, h * kv, m.kv_lora_rank) if sp else ()
    return entry + _leave(T * h * b, sp) + _grad_sums("tp.weight.bwd", norms, b, per_step)


def _loss_collectives(m: ModelSpec, T: int, sp: bool, per_step: bool) -> tuple[Collective, ...]:
    """fmoe.phases.logits_loss's: the norm, the gather into the vocab-parallel head, the cross-entropy's
    max, normaliser and target logit (fp32 [T] each)."""
    h, b = m.hidden, DTYPE_BYTES[m.dtype]
    out = _grad_sums("tp.weight.bwd", (h,) if sp else (), b, per_step) + _enter("tp.sp_gather", T * h * b, sp)
    return out + (Collective("tp.ce_max", "all_reduce", "F", T * FP32_BYTES),
                  Collective("tp.reduce", "all_reduce", "F", T * FP32_BYTES),
                  Collective("tp.reduce", "all_reduce", "F", T * FP32_BYTES))


@functools.lru_cache(maxsize=1024)
def tp_collectives(m: ModelSpec, kind: str, T: int, *, sequence_parallel: bool = True,
                   qk_norm: bool = False, weight_sums: str = "step") -> tuple[Collective, ...]:
    """Returns the tensor-parallel collectives one layer of `kind` ("dense", "moe", "embed", "head")
    issues for a microbatch of T tokens (the tp group's), forward and backward, as the runtime does
    (fmoe.block, fmoe.dense.swiglu_mlp, fmoe.phases; the MoE block with TP extending EP). `qk_norm`: GQA
    with per-head q / k norms (ModelSpec does not say; the planner passes False). `weight_sums`: "step"
    (`fmoe train`'s) the replicated weights' partial gradients summed once per step (phase "S", fp32),
    "microbatch" in every microbatch's backward (phase "B"; a CommGroup without weight_grads_per_step).

    Not here: the balancing losses' statistics (cfg.moe's aux / seq_aux / z losses each add an
    all-reduce of at most B x E floats, a choice ModelSpec does not carry)."""
    h, b, sp = m.hidden, DTYPE_BYTES[m.dtype], sequence_parallel
    if weight_sums not in ("step", "microbatch"):
        raise ValueError(f"weight_sums must be 'step' or 'microbatch', got {weight_sums!r}")
    per_step = weight_sums == "step"
    if kind == "embed":  # vocab-parallel: the shards' partial rows summed (scattered over positions)
        return _leave(T * h * b, sp)
    if kind == "head":  # the loss, and each MTP module's input, MoE block and loss (all under SP too)
        mtp_in = _leave(T * h * b, sp) + _grad_sums("tp.weight.bwd", (h, h, 2 * h * h) if sp else (), b,
                                                    per_step)
        block = tp_collectives(m, "moe", T, sequence_parallel=sp, qk_norm=qk_norm, weight_sums=weight_sums)
        mtp = mtp_in + block + _loss_collectives(m, T, sp, per_step)
        return _loss_collectives(m, T, sp, per_step) + mtp * m.mtp
    out = _attention_collectives(m, T, sp, qk_norm, per_step)
    if kind == "dense":  # the SwiGLU: its norm, column- then row-parallel
        return out + _grad_sums("tp.weight.bwd", (h if sp else 0,), b, per_step) + _enter(
            "tp.sp_gather", T * h * b, sp) + _leave(T * h * b, sp)
    # MoE, TP extending EP: each rank routes its own tokens (under SP its positions, else split_tokens'
    # share, joined back after the combine), so no collective wraps the experts; the router and the
    # shared expert are replicated and their gradients summed, the load counts are the group's
    out += _grad_sums("tp.weight.bwd", (h if sp else 0,), b, per_step)
    out += (Collective("tp.router_stats", "all_reduce", "F", m.routed_experts * INT64_BYTES),)
    out += _grad_sums("tp.router.bwd", (h * m.routed_experts,), b, per_step)
    out += _grad_sums("tp.shared.bwd", (3 * h * m.shared_experts * m.expert_ffn,), b, per_step)
    if not sp:  # split_tokens' backward and join_tokens' forward: all-gathers of [T, D]
        out += (Collective("tp.tokens", "all_gather", "B", T * h * b),
                Collective("tp.tokens", "all_gather", "F", T * h * b))
    return out


def tp_bytes(colls: tuple[Collective, ...], tp: int) -> dict[str, int]:
    """Returns {op: bytes one of `tp` ranks sends} of `colls`, summed per op (CommCounters' view)."""
    out: dict[str, int] = {}
    for c in colls:
        out[c.op] = out.get(c.op, 0) + c.sent(tp)
    return {op: n for op, n in out.items() if n}


# ---- FP8 GEMMs and recompute parts ---------------------------------------------------------------------


def _mlp_flops(m: ModelSpec, kind: str) -> dict[str, float]:
    """Forward GEMM FLOPs per token of a layer of `kind` per group of specs.FP8_GROUPS (the MTP modules'
    blocks count in the head's)."""
    h, f, S = m.hidden, m.expert_ffn, m.shared_experts
    if kind in ("embed", "loss"):
        return {}
    if kind in ("head", "mtp"):  # the head's: its MTP modules'
        if not m.mtp:
            return {}
        blk = _mlp_flops(m, "moe" if m.moe_layers > 0 else "dense")
        return {**{g: m.mtp * x for g, x in blk.items()}, "mtp_proj": m.mtp * 4.0 * h * h}
    proj = _attention(m)[1]
    if kind == "dense":
        return {"attn_proj": proj, "dense_mlp": 6.0 * h * m.dense_ffn}
    return {"attn_proj": proj, "shared_experts": 6.0 * h * f * S, "experts": 6.0 * h * f * m.top_k}


@functools.lru_cache(maxsize=1024)
def fp8_flops(m: ModelSpec, kind: str) -> tuple[float, float]:
    """Returns (non-expert, routed-expert) forward GEMM FLOPs per token of a layer of `kind` that run in
    FP8 (`m.fp8_gemms`); the backward's GEMMs follow their forward's precision."""
    groups = _mlp_flops(m, kind)
    dense = sum(x for g, x in groups.items() if g != "experts" and m.fp8(g))
    return dense, groups.get("experts", 0.0) if m.fp8("experts") else 0.0


@functools.lru_cache(maxsize=1024)
def fp8_saved_bytes(m: ModelSpec, kind: str) -> tuple[float, float]:
    """Returns the (non-expert, routed-expert) activation bytes per token a layer of `kind` saves by keeping
    the inputs of its FP8 GEMMs for the backward in FP8 (1 byte) instead of the compute dtype, as
    DeepSeek-V3 caches its Linear inputs (report 3.3.2): the normed input, MLA's latents and the attention
    output for the projections, the normed input and the activation for a SwiGLU, the dispatched rows and
    their activation for the routed experts (per routed row), the MTP projection's 2h input."""
    b = DTYPE_BYTES[m.dtype]
    if kind == "embed" or b <= 1:
        return 0.0, 0.0
    if kind == "loss":
        return 0.0, 0.0
    if kind in ("head", "mtp"):  # the head's: its MTP modules'
        if not m.mtp:
            return 0.0, 0.0
        d, e = fp8_saved_bytes(m, "moe" if m.moe_layers > 0 else "dense")
        return m.mtp * (d + (b - 1) * 2 * m.hidden * m.fp8("mtp_proj")), m.mtp * e
    h = m.hidden
    elems = {"attn_proj": h + m.heads * m.v_head_dim + m.q_lora_rank + m.kv_lora_rank}
    if kind == "dense":
        elems["dense_mlp"] = h + m.dense_ffn
    else:
        # the shared expert's activation; its normed input stays wide: the router reads it too
        elems["shared_experts"] = m.shared_experts * m.expert_ffn
        elems["experts"] = m.top_k * (h + m.expert_ffn)
    dense = sum(n for g, n in elems.items() if g != "experts" and m.fp8(g))
    return (b - 1) * dense, (b - 1) * elems.get("experts", 0) * m.fp8("experts")


NORM_FLOPS = 4.0  # per element of an RMSNorm: square, sum, times rstd, times the scale


@functools.lru_cache(maxsize=1024)
def part_costs(m: ModelSpec, kind: str) -> dict[str, tuple[float, float]]:
    """Returns {part: (forward FLOPs, activation bytes it frees)} per token of a layer of `kind` for each
    part the runtime can recompute selectively (fmoe.recompute.MODULES): "core_attn" the attention core
    (it keeps q, k, v, which are its inputs, so it frees only the fp32 softmax statistics), "mlp" a dense
    layer's SwiGLU (gate, up, activation), "moe" the routed experts (what adaptive recompute frees),
    "shared_experts" the shared expert (gate, up, activation), "layernorm" and, with MLA, "mla_up_proj"
    (`norm_parts`). The head's are its MTP blocks'."""
    b, h = DTYPE_BYTES[m.dtype], m.hidden
    if kind in ("embed", "loss"):
        return {}
    if kind in ("head", "mtp"):  # the head's: its MTP modules'
        if not m.mtp:
            return {}
        blk = part_costs(m, "moe" if m.moe_layers > 0 else "dense")
        return {p: (m.mtp * f, m.mtp * n) for p, (f, n) in blk.items()}
    cost = block_cost(m, kind == "moe")
    out = {"core_attn": (cost.attn_flops, 4.0 * m.heads)}
    if kind == "dense":
        out["mlp"] = (6.0 * h * m.dense_ffn, b * 3.0 * m.dense_ffn)
    else:
        f, S = m.expert_ffn, m.shared_experts
        out["moe"] = (cost.expert_flops, cost.expert_act_bytes)
        if S:
            out["shared_experts"] = (6.0 * h * f * S, b * 3.0 * f * S)
    out.update(norm_parts(m, kind))
    return out


def norm_parts(m: ModelSpec, kind: str) -> dict[str, tuple[float, float]]:
    """The "layernorm" and "mla_up_proj" parts of a dense or MoE block (fmoe/recompute.py), as the runtime
    (fmoe/block.py, fmoe/mla.py, fmoe/dense.py; without TP) recomputes them: (forward FLOPs, bytes freed)
    per token.

    remat keeps a region's inputs only (its outputs live as long as their readers keep them); a linear
    saves its input, so a norm's output is freed only when the linears that read it are recomputed with it:
    - "layernorm": every norm of the block again (NORM_FLOPS per element), plus MLA's down projections
      (w_q_a, w_kv_a) with the attention norm and a dense layer's gate and up products with the MLP norm;
      frees those two norms' outputs: MLA's normed input (with a query latent: without one it is the
      queries' input and stays) and the dense MLP's normed input. GQA's attention norm, MLA's latent norms
      and the MoE layer's MLP norm are recomputed alone: their outputs stay (their readers save them). In
      FP8 the linears keep their inputs in FP8 (`fp8_saved_bytes`), so a freed GEMM input counts 1 byte.
      Not counted: what a norm saves besides its input (its fp32 working copies; the planner counts a norm
      as keeping its input only), which the runtime frees too.
    - "mla_up_proj" (MLA only): the latent norms, the up projections (w_q_b or w_q, w_kv_b), RoPE and the
      attention core again (remat cannot drop q, k, v after the core read them, so the core is in the
      region); frees the normed latents, q, k, v [H*e] (its own tensor: the kv up projection's output
      is freed once k and v are cut from it) and the core's fp32 softmax statistics."""
    b, h, H = DTYPE_BYTES[m.dtype], m.hidden, m.heads
    Q, C = (m.q_lora_rank, m.kv_lora_rank) if m.mla else (0, 0)
    gemm_in = {g: 1 if m.fp8(g) else b for g in ("attn_proj", "dense_mlp")}  # a GEMM input's bytes kept
    norms = h + Q + C + h  # attention (and latent) norms, the MLP norm
    flops, freed = NORM_FLOPS * norms, 0.0
    if m.mla and Q:  # the attention norm with the down projections
        flops += 2.0 * h * (Q + C + m.qk_rope_dim)
        freed += gemm_in["attn_proj"] * h
    elif m.mla:  # no query latent: the normed input is w_q's (up projection's) input and stays
        flops += 2.0 * h * (C + m.qk_rope_dim)
    if kind == "dense":  # the MLP norm with the gate and up products
        flops += 2.0 * 2.0 * h * m.dense_ffn
        freed += gemm_in["dense_mlp"] * h
    out = {"layernorm": (flops, freed)}
    if m.mla:
        qk, H_kv = m.head_dim + m.qk_rope_dim, H * (m.head_dim + m.v_head_dim)
        up = 2.0 * (Q or h) * H * qk + 2.0 * C * H_kv + NORM_FLOPS * (Q + C)
        freed_up = gemm_in["attn_proj"] * (Q + C) + b * H * (2 * qk + m.v_head_dim) + 4.0 * H
        out["mla_up_proj"] = (up + block_cost(m, kind == "moe").attn_flops, freed_up)
    return out


# what a recomputed part's forward runs on (estimate prices each part's recompute with these): the FP8 group
# (specs.FP8_GROUPS) of its GEMMs, and its attention-core FLOPs, at the attention kernel's rate, not a GEMM's
PART_GEMM_GROUP = {"mlp": "dense_mlp", "shared_experts": "shared_experts", "layernorm": "attn_proj",
                   "mla_up_proj": "attn_proj", "moe": "experts", "core_attn": "attn_proj"}


def part_attn_flops(m: ModelSpec, kind: str, part: str) -> float:
    """Returns the forward FLOPs per token of the attention core inside recompute part `part` of a layer of
    `kind` (the rest of `part_costs`' FLOPs are GEMMs and norms): all of "core_attn"'s, and of
    "mla_up_proj"'s the core's, which its region includes."""
    if kind == "embed" or part not in part_costs(m, kind) or part not in ("core_attn", "mla_up_proj"):
        return 0.0
    if kind == "head":
        return m.mtp * part_attn_flops(m, "moe" if m.moe_layers > 0 else "dense", part)
    return block_cost(m, kind == "moe").attn_flops
