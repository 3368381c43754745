"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as pure functions: a block's attention sublayer
when cfg.mla (GPTConfig.kv_lora_rank > 0); `fmoe.block.init_attention` and `self_attention` dispatch here.

    p = init_mla(cfg)
    r_BSD = mla(p, x_BSD, cfg)                          # x + attention, as fmoe.block.self_attention

Legend (the package's, docs/moe.md): B sequences, S positions, D model width, H heads, d a head's
non-rotary qk dim (cfg.head_dim), r its rotary qk dim (cfg.qk_rope_head_dim), k = d + r its qk width,
e its value dim (cfg.v_head_dim), Q the query latent width (cfg.q_lora_rank), C the key/value latent
width (cfg.kv_lora_rank), P tensor-parallel ranks.

DeepSeek-V3's formulation, h = rms_norm(x):
    queries    cq = rms_norm(h @ w_q_a [D, Q]) (q_a_norm [Q]); q = cq @ w_q_b [Q, H*k]
               (q_lora_rank 0: q = h @ w_q [D, H*k]); each head's k columns are [nope d, rope r]
    keys/vals  h @ w_kv_a [D, C + r] = [ckv, kr]; ckv = rms_norm(ckv) (kv_a_norm [C]);
               ckv @ w_kv_b [C, H*(d + e)], each head's columns [k_nope d, v e]; kr: one rotary key
               head, shared by all H heads
    attention  RoPE (fmoe.ops.rope's half-split form; DeepSeek's interleaved pairs are a fixed permutation
               of the rotary columns of w_q_b and w_kv_a) on q's rope part and on kr; k = [k_nope, kr];
               causal softmax(q k^T / sqrt(k)) v per head, o [B, S, H*e] @ w_o [H*e, D]; residual.

Tensor parallelism (Megatron-core's MLA; fmoe/tp_layout.py): the down projections w_q_a, w_kv_a and the
latent norms are replicated, the up projections w_q_b (or w_q), w_kv_b column-parallel by heads, w_o
row-parallel by heads. The latents (cq or h, ckv, kr) enter the TP region together (one concatenated
tensor, so one collective each way): `copy_to_tp` on replicated x, so the down weights' gradients are
whole on every rank; `gather_sequence` under sequence parallelism, after the down projections and their
norms ran on this rank's positions only (norms are per position: before the gather they cost 1/P of the
work and the gather carries the same widths either way; after it every rank would normalise every
position again). Those replicated weights then see this rank's positions only, so they enter through
`copy_to_tp(weight)` (their gradient summed over the group), as the block's attn_norm does.
"""

from __future__ import annotations

from typing import Any

import torch

from fmoe.config import GPTConfig
from fmoe.init import ones, scaled_normal
from fmoe.ops import document_mask, linear, rms_norm, rope, sdpa
from fmoe.packing import Packing
from fmoe.parallel.context import LOCAL, ParallelContext
from fmoe.parallel.context_parallel import cp_attention, take_positions
from fmoe.parallel.tensor import copy_to_tp, gather_sequence, reduce_from_tp, scatter_sequence, tp_weight
from fmoe.recompute import part


def mla_paths(cfg: GPTConfig) -> tuple[tuple[str, ...], ...]:
    """Returns the key paths of the MLA weights of a block under `cfg` (w_q_a, q_a_norm and w_q_b with a
    query latent, else w_q)."""
    q = (("w_q_a",), ("q_a_norm",), ("w_q_b",)) if cfg.q_lora_rank else (("w_q",),)
    return (("attn_norm",), *q, ("w_kv_a",), ("kv_a_norm",), ("w_kv_b",), ("w_o",))


def init_mla(cfg: GPTConfig, generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Return {"attn_norm": [D], "w_q_a": [D, Q], "q_a_norm": [Q], "w_q_b": [Q, H*k] (q_lora_rank 0:
    "w_q": [D, H*k] instead), "w_kv_a": [D, C + r], "kv_a_norm": [C], "w_kv_b": [C, H*(d + e)],
    "w_o": [H*e, D]}: projections N(0, 1/fan_in), norms ones."""
    D, H, Q, C = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Hk, He = H * cfg.qk_head_dim, H * cfg.o_head_dim
    p = {"attn_norm": ones(D, generator, dtype)}
    if Q:
        p.update(w_q_a=scaled_normal((D, Q), D, generator, dtype), q_a_norm=ones(Q, generator, dtype),
                 w_q_b=scaled_normal((Q, Hk), Q, generator, dtype))
    else:
        p["w_q"] = scaled_normal((D, Hk), D, generator, dtype)
    p.update(w_kv_a=scaled_normal((D, C + cfg.qk_rope_head_dim), D, generator, dtype),
             kv_a_norm=ones(C, generator, dtype),
             w_kv_b=scaled_normal((C, H * (cfg.head_dim + cfg.o_head_dim)), C, generator, dtype),
             w_o=scaled_normal((He, D), He, generator, dtype))
    return p


def latent_attention(q_BSHk: torch.Tensor, k_BSHk: torch.Tensor, v_BSHe: torch.Tensor,
                     segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Return o_BSHe [B, S, H, e] = causal softmax(q k^T / sqrt(k)) v per head, of queries and keys
    RoPE already applied to (their rotary part only), values of their own width e. `segments_BS`: each
    position's document, attention within one only (fmoe/packing.py; None: one document)."""
    mask = None
    if segments_BS is not None:
        S = q_BSHk.shape[1]
        causal_SS = torch.ones(S, S, dtype=torch.bool, device=q_BSHk.device).tril()
        mask = (document_mask(segments_BS, segments_BS) & causal_SS).unsqueeze(1)
    # sdpa's default scale is 1/sqrt(q's last dim), i.e. 1/sqrt(d + r); it takes e != k
    o_BHSe = sdpa(q_BSHk.transpose(1, 2), k_BSHk.transpose(1, 2), v_BSHe.transpose(1, 2), causal=True,
                  mask=mask)
    return o_BHSe.transpose(1, 2)


def _entered(parts: list[torch.Tensor], parallel: ParallelContext) -> list[torch.Tensor]:
    """Return `parts` ([B, S, *] each) inside the TP region: as they are without `parallel.tp`, else
    concatenated on features so one collective moves them all (`copy_to_tp`, or `gather_sequence` under
    SP) and split back."""
    tp, sequence_parallel = parallel.tp, parallel.sequence_parallel
    if tp is None:
        return parts
    widths = [t.shape[-1] for t in parts]
    joined = torch.cat(parts, -1)
    joined = gather_sequence(joined, tp) if sequence_parallel else copy_to_tp(joined, tp)
    return list(joined.split(widths, -1))


def _down(x_BSD: torch.Tensor, norm_D: torch.Tensor, eps: float, C: int, w_kv_a: torch.Tensor,
          w_q_a: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (ckv_BSC, kr_BSr, q_src) of x: the attention norm and the down projections that read it;
    q_src the query latent before its norm (h @ w_q_a), or h itself without one (w_q_a None)."""
    h_BSD = rms_norm(x_BSD, norm_D, eps)
    ckv_BSC, kr_BSr = linear(h_BSD, w_kv_a).split((C, w_kv_a.shape[-1] - C), -1)
    return ckv_BSC, kr_BSr, h_BSD if w_q_a is None else linear(h_BSD, w_q_a)


def _up(lat: torch.Tensor, norm: torch.Tensor | None, eps: float, w: torch.Tensor) -> torch.Tensor:
    """Returns lat @ w, or rms_norm(lat) @ w when a latent norm's scale `norm` is given."""
    return linear(lat if norm is None else rms_norm(lat, norm, eps), w)


def _qkv(q_lat: torch.Tensor, ckv_BSC: torch.Tensor, kr_BSr: torch.Tensor, w_q: torch.Tensor,
         w_kv_b: torch.Tensor, q_norm: torch.Tensor | None, kv_norm: torch.Tensor | None, eps: float,
         cfg: GPTConfig, positions_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Returns (q_BSHk, k_BSHk, v_BSHe) of the latents: the up projections (w_q_b or w_q, w_kv_b; the
    latent norms first when their scales are given), RoPE on q's rotary part and on the shared key, at
    `positions_BS` ([B, S] or [S]; None: 0 .. S-1; under context parallelism this rank's true positions,
    with documents their restarting ones)."""
    d, r, e = cfg.head_dim, cfg.qk_rope_head_dim, cfg.o_head_dim
    q_BSHk = _up(q_lat, q_norm, eps, w_q).unflatten(-1, (-1, d + r))
    kv_BSHde = _up(ckv_BSC, kv_norm, eps, w_kv_b).unflatten(-1, (-1, d + e))
    k_nope_BSHd, v_BSHe = kv_BSHde.split((d, e), -1)
    # v its own tensor: a view would keep all of kv (k_nope too, which k copies) alive wherever v is kept
    # for the backward, as the attention core's remat region keeps its inputs ("core_attn"): H x d per token
    v_BSHe = v_BSHe.contiguous()
    q_nope_BSHd, q_rope_BSHr = q_BSHk.split((d, r), -1)
    q_BSHk = torch.cat([q_nope_BSHd, rope(q_rope_BSHr, positions_BS, theta=cfg.rope_theta)], -1)
    kr_BS1r = rope(kr_BSr.unsqueeze(-2), positions_BS, theta=cfg.rope_theta)  # one rotary key head for all H
    k_BSHk = torch.cat([k_nope_BSHd, kr_BS1r.expand(*k_nope_BSHd.shape[:-1], r)], -1)
    return q_BSHk, k_BSHk, v_BSHe


def _attend(q_lat: torch.Tensor, ckv_BSC: torch.Tensor, kr_BSr: torch.Tensor, w_q: torch.Tensor,
            w_kv_b: torch.Tensor, q_norm: torch.Tensor | None, kv_norm: torch.Tensor | None, eps: float,
            cfg: GPTConfig, positions_BS: torch.Tensor | None = None,
            segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Returns o_BSHe of the latents: `_qkv` and the attention core (the "mla_up_proj" part's region)."""
    qkv = _qkv(q_lat, ckv_BSC, kr_BSr, w_q, w_kv_b, q_norm, kv_norm, eps, cfg, positions_BS)
    return latent_attention(*qkv, segments_BS)


def mla(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig, *,
        parallel: ParallelContext = LOCAL, packing: Packing | None = None) -> torch.Tensor:
    """Return r_BSD [B, S, D] = x + MLA(rms_norm(x)) (the module docstring; params unchecked: the caller's
    `fmoe.block.self_attention` checks them). `parallel.tp`: the tensor-parallel group, `params` this
    rank's shard (its H/P heads of w_q_b or w_q, w_kv_b and w_o); x and the result replicated on the
    group, or with `parallel.sequence_parallel` this rank's positions [B, S/P, D] (the down projections
    and norms run on them). `packing` (fmoe/packing.py): the whole sequences' documents, RoPE at their
    positions and attention within each (None: one document per sequence).

    Selective recompute (fmoe/recompute.py): "layernorm" runs the attention norm with the down projections
    under remat (`_down`), and each latent norm alone; "mla_up_proj" runs the latents' way to the attention
    output (`_attend`: the latent norms when no TP collective separates them, up projections, RoPE,
    attention core) under remat, so the normed latents and q, k, v are not kept; it includes "core_attn".

    `parallel.cp`: x is this rank's positions of the sequence (fmoe.parallel.context_parallel; under
    sequence parallelism too, 1/P of them); RoPE at their true positions, and the attention core over
    every cp rank's keys and values (`cp_attention`, the rotary parts rotated here). Neither "mla_up_proj"
    nor "core_attn" recompute runs under it: they would replay the ring's messages."""
    C, eps, rc = cfg.kv_lora_rank, cfg.norm_eps, cfg.recompute
    tp, sequence_parallel = parallel.tp, parallel.sequence_parallel
    packing = packing or Packing()
    docs = (packing.positions_BS, packing.segments_BS)
    if parallel.cp is not None and (rc.module("mla_up_proj") or rc.module("core_attn")):
        raise ValueError("context parallelism: recomputing mla_up_proj or core_attn would replay the ring's "
                         "messages; recompute other parts")

    def mine(name: str) -> torch.Tensor:
        # replicated weights used on this rank's positions only (SP): their gradient summed over the group
        return tp_weight(params[name], tp) if sequence_parallel else params[name]

    w_q_a = mine("w_q_a") if cfg.q_lora_rank else None
    ckv_BSC, kr_BSr, q_lat = part(rc, "layernorm", _down)(x_BSD, mine("attn_norm"), eps, C, mine("w_kv_a"),
                                                          w_q_a)
    # "mla_up_proj" starts at the latents before their norms (Megatron-core fuses them into the up
    # projections), where no collective separates the two: then the normed latents are not kept either
    if tp is None and rc.module("mla_up_proj"):
        q_norm, kv_norm = (params["q_a_norm"] if cfg.q_lora_rank else None), params["kv_a_norm"]
    else:  # the latent norms alone; "layernorm" recomputes each (its output stays: the up projection's input)
        q_norm = kv_norm = None
        norm = part(rc, "layernorm", rms_norm)
        ckv_BSC = norm(ckv_BSC, mine("kv_a_norm"), eps)
        if cfg.q_lora_rank:
            q_lat = norm(q_lat, mine("q_a_norm"), eps)  # cq_BSQ
        q_lat, ckv_BSC, kr_BSr = _entered([q_lat, ckv_BSC, kr_BSr], parallel)
    w_q, w_kv_b = params["w_q_b"] if cfg.q_lora_rank else params["w_q"], params["w_kv_b"]
    if rc.module("mla_up_proj"):  # it includes the attention core: "core_attn" adds nothing
        o_BSHe = part(rc, "mla_up_proj", _attend)(q_lat, ckv_BSC, kr_BSr, w_q, w_kv_b, q_norm, kv_norm, eps,
                                                  cfg, *docs)
    elif parallel.cp is not None:  # this rank's positions of the sequence, against every rank's keys
        positions_s = parallel.positions(q_lat.shape[1] * parallel.cp_size, q_lat.device)
        rot = positions_s if docs[0] is None else take_positions(docs[0], positions_s)
        qkv = _qkv(q_lat, ckv_BSC, kr_BSr, w_q, w_kv_b, None, None, eps, cfg, rot)
        o_BSHe = cp_attention(*qkv, positions_s, parallel.cp, kind=parallel.cp_comm_type, rotated=True,
                              segments_BS=docs[1])
    else:
        qkv = _qkv(q_lat, ckv_BSC, kr_BSr, w_q, w_kv_b, None, None, eps, cfg, docs[0])
        o_BSHe = part(rc, "core_attn", latent_attention)(*qkv, docs[1])  # fmoe/recompute.py
    o_BSD = linear(o_BSHe.flatten(-2), params["w_o"])
    if tp is not None:  # the heads' partial sums
        o_BSD = scatter_sequence(o_BSD, tp) if sequence_parallel else reduce_from_tp(o_BSD, tp)
    return x_BSD + o_BSD
