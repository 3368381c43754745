"""A transformer block with an MoE MLP: the compute of seed 000's phases (pure functions over dicts of acts).

    acts, route = attention(params, x_BSD, cfg, state)    # norm, attention, residual, norm, router,
                                                          # permute-1 -> rows_RD
    ...the dispatcher moves acts["rows_RD"] (+ "probs_R") to the experts: acts["rows_MD"] (+ "probs_M")
    acts = experts(params["moe"], acts, counts_L, cfg, route.remat)   # routed + shared experts
    ...the dispatcher moves acts["rows_MD"] back to acts["rows_RD"]
    acts = finish(acts, route)                            # unpermute-1, + shared, + residual -> h_BSD

Legend (the package's, docs/moe.md): B sequences, S positions, T = B * S tokens, D model width,
H query heads, G kv heads, d head dim, K top-k slots, R rows of this rank's expert-sorted layout,
M rows this rank's experts receive (M = R on one process).

Each phase maps a dict of activations (floating tensors, keyed with the legend's shape suffixes) to the
next one; keys it does not use pass through, so a phase run under `split_vjp` takes the cotangent of its
whole output dict and returns that of its whole input dict: a backward chains the phases with no
key-by-key assembly. Non-differentiable metadata (`MoERoute`, split sizes) stays outside the dicts.
The exchanges between the phases are linear maps with no weights: fmoe/phases.py makes them comm phases
between these functions, which `fmoe.model.block` runs in order and a pipeline's executor with
overlap. The gate weights are acts["probs_TK"] [T, K], applied by `finish`, or, when
cfg.moe.probs_in_expert, acts["probs_R"] [R], one per layout row, which travel with the rows ("probs_M")
into `experts`. The balancing loss is
acts["loss"] out of `attention`: give it a cotangent (e.g. 1.0).

Parameter layout of a block:
{"attn_norm": [D], "w_q": [D, H*d], "w_k": [D, G*d], "w_v": [D, G*d], "w_o": [H*d, D], "mlp_norm": [D],
 "moe": fmoe.init_moe params}, plus "q_norm": [d] and "k_norm": [d] with cfg.qk_norm (with cfg.mla the
attention weights are multi-head latent attention's, fmoe/mla.py); a dense block has
"mlp": fmoe.dense.init_swiglu_mlp params instead of "mlp_norm" and "moe". `attention` reads the
attention weights, "mlp_norm" and "moe"/"router" only; `experts` reads "moe"/"experts" (and "moe"/"shared").

Each function that takes params (or state) and the config checks the entries it reads against it first
(keys, shapes, dtypes: fmoe/structure.py) unless given check=False; `block` checks the whole block once
and runs its phases with check=False, and so does a caller that checked the whole model (gpt_loss, the
pipeline's GPTProgram).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fmoe.balance import TokenShard
from fmoe.config import GPTConfig, MoEConfig
from fmoe.dense import init_swiglu_mlp, swiglu_mlp
from fmoe.experts import shared_experts
from fmoe.init import ones, scaled_normal
from fmoe.layer import (
    MoERoute,
    combine_rows,
    expert_rows,
    init_moe,
    plan_route,
    route_tokens,
)
from fmoe.mla import init_mla, mla, mla_paths
from fmoe.ops import linear, rms_norm
from fmoe.packing import Packing
from fmoe.parallel.context import LOCAL, ParallelContext
from fmoe.parallel.context_parallel import cp_attention, cp_token_shard, take_positions
from fmoe.parallel.tensor import (
    copy_to_tp,
    gather_sequence,
    join_tokens,
    reduce_from_tp,
    scatter_sequence,
    split_tokens,
    tp_weight,
)
from fmoe.recompute import Recompute, part
from fmoe.seams import attention_of
from fmoe.structure import check_block, check_moe
from fmoe.tp_layout import SPLITS, check_shard, check_tp

_ATTENTION_PATHS = (("attn_norm",), ("w_q",), ("w_k",), ("w_v",), ("w_o",), ("q_norm",), ("k_norm",))


def attention_paths(cfg: GPTConfig) -> tuple[tuple[str, ...], ...]:
    """Returns the key paths of a block's attention weights under `cfg` (GQA's, or MLA's: fmoe/mla.py)."""
    return mla_paths(cfg) if cfg.mla else _ATTENTION_PATHS


def token_shard(parallel: ParallelContext, B: int, S: int, device: torch.device) -> TokenShard:
    """Returns the `TokenShard` of this rank's tokens of the tp group's B sequences: with sequence
    parallelism its S positions of each (of the group's P*S), else rows p*T/P .. of the T = B*S tokens.
    Under context parallelism the group's sequences are themselves one cp rank's positions: the statistics
    are summed over the cp group too (the whole sequence's; without tp, `cp_token_shard`)."""
    tp, cp, N = parallel.tp, parallel.cp, parallel.cp_size
    if tp is None:
        return cp_token_shard(cp, B, S, device)
    if parallel.sequence_parallel:
        seq_ids_T = torch.arange(B, device=device).repeat_interleave(S)
        B_all, S_all = B, S * tp.size
    else:
        n = B * S // tp.size
        seq_ids_T = torch.arange(tp.rank * n, (tp.rank + 1) * n, device=device) // S
        B_all, S_all = B, S
    over_tp = partial(reduce_from_tp, comm=tp, op="tp.router_stats")
    total = over_tp if cp is None else partial(_over_tp_then_cp, over_tp, cp)
    return TokenShard(total=total, seq_ids_T=seq_ids_T, num_tokens=B_all * S_all * N, num_seqs=B_all,
                      seq_len=S_all * N)


def _over_tp_then_cp(over_tp: Any, cp: Any, x: torch.Tensor) -> torch.Tensor:
    """A statistic summed over the tp group, then over the cp group (each gradient passed back unchanged)."""
    return reduce_from_tp(over_tp(x), cp, op="cp.router_stats")


def init_attention(cfg: GPTConfig, generator: torch.Generator | None = None,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Return {"attn_norm": [D], "w_q": [D, H*d], "w_k": [D, G*d], "w_v": [D, G*d], "w_o": [H*d, D]}
    (+ "q_norm": [d], "k_norm": [d] of ones with cfg.qk_norm); with cfg.mla, MLA's weights instead
    (fmoe.mla.init_mla)."""
    if cfg.mla:
        return init_mla(cfg, generator, dtype)
    D, Hd, Gd = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    p = {"attn_norm": ones(D, generator, dtype),
         "w_q": scaled_normal((D, Hd), D, generator, dtype),
         "w_k": scaled_normal((D, Gd), D, generator, dtype),
         "w_v": scaled_normal((D, Gd), D, generator, dtype),
         "w_o": scaled_normal((Hd, D), Hd, generator, dtype)}
    if cfg.qk_norm:
        for name in ("q_norm", "k_norm"):
            p[name] = ones(cfg.head_dim, generator, dtype)
    return p


def init_block(cfg: GPTConfig, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
               dense: bool = False) -> dict[str, Any]:
    """Return one block's params (see the module docstring); `dense` gives a dense SwiGLU block."""
    p: dict[str, Any] = init_attention(cfg, generator, dtype)
    if dense:
        p["mlp"] = init_swiglu_mlp(cfg.d_model, cfg.d_ff_dense, generator, dtype)
    else:
        p["mlp_norm"] = ones(cfg.d_model, generator, dtype)
        p["moe"] = init_moe(cfg.moe, generator, dtype)
    return p


def self_attention(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig, *,
                   check: bool = True, parallel: ParallelContext = LOCAL,
                   packing: Packing | None = None) -> torch.Tensor:
    """Return r_BSD [B, S, D] = x + w_o(attention(rope(q), rope(k), v)), q, k, v projected from
    rms_norm(x) and split into heads ([B, S, H, d] and [B, S, G, d]); with cfg.qk_norm, q and k are
    RMS-normalised per head before RoPE. `check`: check the attention weights against `cfg` first.
    `parallel.tp`: the tensor-parallel group, `params` this rank's shard (fmoe/tp_layout.py: its H/P query
    and G/P kv heads); x and the result replicated on the group, or with `parallel.sequence_parallel`
    this rank's positions [B, S/P, D] (the norm runs on them; gathered before the projections, the output
    reduce-scattered back). With cfg.mla: multi-head latent attention instead (fmoe.mla.mla), with the
    same `parallel`. `packing` (fmoe/packing.py): the documents of the whole sequences, [B, S] under
    every parallelism: RoPE at their positions, attention within each (None: one document each)."""
    tp, sequence_parallel, P = parallel.tp, parallel.sequence_parallel, parallel.tp_size
    if check:
        if tp is None:
            check_block(params, cfg, dense=True, paths=attention_paths(cfg))  # the same in both kinds
        else:
            check_tp(cfg, P, dense=False)
            check_shard(params, cfg, P, attention_paths(cfg))
    if cfg.mla:
        return mla(params, x_BSD, cfg, parallel=parallel, packing=packing)
    H, G = cfg.n_heads // P, cfg.n_kv_heads // P
    # "layernorm" (fmoe/recompute.py) recomputes the norm alone: the q, k, v projections read its output
    # and keep it for their backward, so only its working copies go (recomputing the projections with it
    # would free the output too, at the projections' cost: not done)
    norm = part(cfg.recompute, "layernorm", rms_norm)
    # under SP the norm sees this rank's positions only: its scale's gradient is summed over the group
    norm_D = tp_weight(params["attn_norm"], tp) if sequence_parallel else params["attn_norm"]
    h_BSD = norm(x_BSD, norm_D, cfg.norm_eps)
    if tp is not None:  # enters the TP region: every head shard reads h (its gradient summed over them)
        h_BSD = gather_sequence(h_BSD, tp) if sequence_parallel else copy_to_tp(h_BSD, tp)
    # Heads split off the feature axis ([B, S, H*d] -> [B, S, H, d]) and merged back after attention.
    q_BSHd = linear(h_BSD, params["w_q"]).unflatten(-1, (H, cfg.head_dim))
    k_BSGd = linear(h_BSD, params["w_k"]).unflatten(-1, (G, cfg.head_dim))
    v_BSGd = linear(h_BSD, params["w_v"]).unflatten(-1, (G, cfg.head_dim))
    if cfg.qk_norm:
        # replicated scales used on this rank's heads only: their gradient is summed over the group
        q_norm, k_norm = (params[k] if tp is None else tp_weight(params[k], tp)
                          for k in ("q_norm", "k_norm"))
        q_BSHd = norm(q_BSHd, q_norm, cfg.norm_eps)  # read by the attention core: alone under "layernorm"
        k_BSGd = norm(k_BSGd, k_norm, cfg.norm_eps)
    if parallel.cp is not None:  # this rank's positions of the sequence, against every rank's keys
        o_BSHd = _cp_core(q_BSHd, k_BSGd, v_BSGd, cfg, parallel, packing)
    else:
        attention_op = attention_of(cfg)  # cfg.attention (fmoe/seams.py; default fmoe.ops.attention)
        documents = document_args(packing, cfg)

        def core(q_BSHd: torch.Tensor, k_BSGd: torch.Tensor, v_BSGd: torch.Tensor) -> torch.Tensor:
            return attention_op(q_BSHd, k_BSGd, v_BSGd, rope_theta=cfg.rope_theta, causal=True, **documents)

        o_BSHd = part(cfg.recompute, "core_attn", core)(q_BSHd, k_BSGd, v_BSGd)  # fmoe/recompute.py
    o_BSD = linear(o_BSHd.flatten(-2), params["w_o"])
    if tp is not None:  # the heads' partial sums
        o_BSD = scatter_sequence(o_BSD, tp) if sequence_parallel else reduce_from_tp(o_BSD, tp)
    return x_BSD + o_BSD


def document_args(packing: Packing | None, cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The attention core's document keywords (positions_S [B, S], segments_BS) of `packing`: none without
    documents, so a custom attention (cfg.attention) is called as its protocol says; ValueError when one
    would be asked to mask documents it is never told of."""
    if packing is None or (packing.positions_BS is None and packing.segments_BS is None):
        return {}
    if cfg.attention is not None:
        raise ValueError(f"documents (--reset-position-ids / --reset-attention-mask) need fmoe's attention: "
                         f"a custom attention ({cfg.attention!r}) takes no positions or document mask")
    return {"positions_S": packing.positions_BS, "segments_BS": packing.segments_BS}


def _cp_core(q_BsHd: torch.Tensor, k_BsGd: torch.Tensor, v_BsGd: torch.Tensor, cfg: GPTConfig,
             parallel: ParallelContext, packing: Packing | None = None) -> torch.Tensor:
    """The attention core over a sequence split by context parallelism (fmoe.parallel.context_parallel).
    Refuses what it cannot run: a custom attention (it would see one rank's positions), and recomputing
    the core (its recompute would replay the ring's messages)."""
    if cfg.attention is not None:
        raise ValueError(f"context parallelism runs fmoe's attention: a custom attention ({cfg.attention!r}) "
                         "would see one rank's positions only")
    if cfg.recompute.module("core_attn"):
        raise ValueError("context parallelism: recomputing core_attn would replay the ring's messages; "
                         "recompute other parts")
    positions_s = parallel.positions(q_BsHd.shape[1] * parallel.cp_size, q_BsHd.device)
    packing = packing or Packing()
    rope_Bs = None if packing.positions_BS is None else take_positions(packing.positions_BS, positions_s)
    return cp_attention(q_BsHd, k_BsGd, v_BsGd, positions_s, parallel.cp, rope_theta=cfg.rope_theta,
                        kind=parallel.cp_comm_type, rope_positions_Bs=rope_Bs,
                        segments_BS=packing.segments_BS)


def attention(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig,
              state: dict[str, Any] | None = None, remat: bool | None = None, *,
              permute_tokens: bool = True, check: bool = True, parallel: ParallelContext = LOCAL,
              packing: Packing | None = None) -> tuple[dict[str, torch.Tensor], MoERoute]:
    """Phase 1: return (acts, route).

    acts: {"residual_BSD": x + attention, "normed_TD": rms_norm(residual) per token (the experts'
    input), "rows_RD": normed_TD permuted to the expert-sorted layout, then "probs_TK": gate weights
    [T, K] (applied by `finish`) or "probs_R": gate weight [R] of each layout row (cfg.moe.probs_in_expert),
    and "loss": the differentiable balancing loss (scalar)}. `permute_tokens` False (a token-level
    dispatcher permutes itself): no "rows_RD", and the gate weights as "probs_TK".
    route: the `MoERoute` (layout, load, drops, remat decision). `check`: check the weights it reads
    (attention, "mlp_norm", "moe"/"router") and the state against `cfg` first.
    `parallel`, `packing`: as in `self_attention` (params this rank's attention shard). Each tp rank
    routes and dispatches its own tokens (TP extends EP): with sequence parallelism its positions, else
    its 1/P of the replicated residual's tokens (`split_tokens`); the router's statistics are the
    group's (`token_shard`, fmoe.layer.plan_route).
    """
    tp, sequence_parallel = parallel.tp, parallel.sequence_parallel
    if check:
        if tp is None:
            check_block(params, cfg, state, paths=(*attention_paths(cfg), ("mlp_norm",), ("moe", "router")))
        else:
            check_tp(cfg, tp.size, dense=False)
            check_shard(params, cfg, tp.size, attention_paths(cfg))
            check_block(params, cfg, state, paths=(("mlp_norm",), ("moe", "router")))
    if remat is None and cfg.recompute.module("moe"):
        remat = True  # selective recompute of the routed experts: every layer, every step
    r_BSD = self_attention(params, x_BSD, cfg, check=False, parallel=parallel, packing=packing)
    # under SP the norm sees this rank's positions only: its scale's gradient is summed over the group
    norm_D = tp_weight(params["mlp_norm"], tp) if sequence_parallel else params["mlp_norm"]
    # the router, the permutation and the shared expert read the normed tokens: "layernorm" recomputes the
    # norm alone (its output stays kept by them)
    h_TD = part(cfg.recompute, "layernorm", rms_norm)(r_BSD, norm_D, cfg.norm_eps).flatten(0, 1)  # t = b*S+s
    seq_len = x_BSD.shape[1] or None  # S = 0: no tokens (T = 0), no sequence to split
    shard = None
    if tp is not None or parallel.cp is not None:  # a share of the tokens: the statistics are the group's
        B, S = r_BSD.shape[:2]
        if tp is not None and not sequence_parallel:
            h_TD = split_tokens(h_TD, tp)  # this rank's tokens
        shard, seq_len = token_shard(parallel, B, S, h_TD.device), None
    acts = {"residual_BSD": r_BSD, "normed_TD": h_TD}
    if permute_tokens:
        x_RD, probs_TK, probs_R, loss, route = route_tokens(params["moe"], h_TD, cfg.moe, state, seq_len,
                                                            remat, check=False, tp=tp, shard=shard)
        acts["rows_RD"] = x_RD
        if probs_R is None:
            acts["probs_TK"] = probs_TK
        else:
            acts["probs_R"] = probs_R
    else:
        acts["probs_TK"], loss, route = plan_route(params["moe"], h_TD, cfg.moe, state, seq_len, remat,
                                                   check=False, tp=tp, shard=shard)
    acts["loss"] = loss
    return acts, route


def experts(params: dict[str, Any], acts: dict[str, torch.Tensor], counts_L: Any, cfg: GPTConfig | MoEConfig,
            remat: bool = False, *, weight_outputs: bool = False,
            check: bool = True) -> dict[str, torch.Tensor]:
    """Phase 3: the routed experts (and the shared expert) of MoE params `params` ({"experts", "shared"?});
    return acts with "rows_MD" [M, D] replaced by the experts' outputs, "probs_M" and "normed_TD"
    consumed, "shared_TD" [T, D] added when there is a shared expert; other keys pass through.

    acts["rows_MD"]: rows grouped by local expert, counts_L[l] for local expert l. acts["probs_M"], if
    present, multiplies each row inside its expert (before w_down), or, with `weight_outputs`, its
    output (as a combine would). The routed experts run under `fmoe.transforms.remat` when `remat`.
    `check`: check "experts" ([L, D, F], L = len(counts_L)) and "shared" against `cfg` first. Raises
    ValueError when the gate weights would be applied twice (probs_M and probs_TK), never (probs_R left
    behind) or to other rows (probs_M not one per row). `cfg`: a block's (its recompute choice applies
    to the shared expert) or a bare MoE layer's.
    """
    moe_cfg, rc = (cfg.moe, cfg.recompute) if isinstance(cfg, GPTConfig) else (cfg, Recompute())
    if check:
        check_moe(params, moe_cfg, num_local_experts=len(counts_L), paths=(("experts",), ("shared",)))
    _check_expert_acts(acts)
    probs_M = acts.get("probs_M")
    if weight_outputs:
        y_MD = expert_rows(params["experts"], acts["rows_MD"], None, counts_L, moe_cfg, remat, check=False)
        y_MD = y_MD * probs_M.unsqueeze(-1).to(y_MD.dtype)
    else:
        y_MD = expert_rows(params["experts"], acts["rows_MD"], probs_M, counts_L, moe_cfg, remat, check=False)
    out = {k: v for k, v in acts.items() if k not in ("rows_MD", "probs_M", "normed_TD")}
    out["rows_MD"] = y_MD
    if "shared" in params:
        out["shared_TD"] = part(rc, "shared_experts", shared_experts)(params["shared"], acts["normed_TD"])
    return out


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _check_expert_acts(acts: dict[str, torch.Tensor]) -> None:
    """Raise ValueError when the gate weights in `acts` would be applied twice, never, or to other rows."""
    if "probs_M" in acts and "probs_TK" in acts:
        raise ValueError("experts: acts hold both probs_M (gate weights the experts apply) and probs_TK "
                         "(gate weights finish applies): the rows would be weighted twice; keep one form "
                         "(cfg.moe.probs_in_expert picks which)")
    if "probs_R" in acts:
        raise ValueError("experts: acts['probs_R'] (the layout rows' gate weights) did not travel with the "
                         "rows to the experts as probs_M: they would be never applied; dispatch them with "
                         "the rows")
    probs_M, rows_MD = acts.get("probs_M"), acts["rows_MD"]
    if probs_M is not None and tuple(probs_M.shape) != (rows_MD.shape[0],):
        raise ValueError(f"experts: acts['probs_M'] has shape {_shape(probs_M)} but acts['rows_MD'] has "
                         f"{rows_MD.shape[0]} rows: gate weights of other rows (another microbatch's?)")


def _check_finish_acts(acts: dict[str, torch.Tensor], route: MoERoute, shards: int = 1) -> None:
    """Raise ValueError when `acts` and `route` are not of one microbatch (token and row counts), or the
    gate weights or the shared output would be dropped or broadcast. `shards`: the route is for one of
    this many equal shards of the residual's tokens."""
    T = route.layout.num_tokens
    r_BSD = acts.get("residual_BSD")
    if r_BSD is not None and r_BSD.shape[0] * r_BSD.shape[1] != T * shards:
        raise ValueError(f"finish: acts hold {r_BSD.shape[0] * r_BSD.shape[1]} tokens (residual_BSD "
                         f"{_shape(r_BSD)}) but the route is for {T} tokens"
                         f"{'' if shards == 1 else f' of one of {shards} shards'}: the route of another "
                         "microbatch?")
    rows = acts["y_TD"] if "y_TD" in acts else acts["rows_RD"]
    want = [T, rows.shape[-1]]
    if "y_TD" in acts:
        if "probs_TK" in acts:
            raise ValueError("finish: acts hold both y_TD (tokens a token-level dispatcher combined, gate "
                             "weights applied at the experts) and probs_TK, which would be ignored: dispatch "
                             "probs_TK with the tokens")
        if _shape(acts["y_TD"]) != want:
            raise ValueError(f"finish: acts['y_TD'] has shape {_shape(acts['y_TD'])}, expected {want}")
    elif acts["rows_RD"].shape[0] != route.layout.num_rows:
        raise ValueError(f"finish: acts['rows_RD'] has {acts['rows_RD'].shape[0]} rows but the route's "
                         f"layout has {route.layout.num_rows}: the route of another microbatch?")
    if "shared_TD" in acts and _shape(acts["shared_TD"]) != want:
        raise ValueError(f"finish: acts['shared_TD'] has shape {_shape(acts['shared_TD'])}, expected {want}")


def shared_expert(params: dict[str, torch.Tensor], acts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Return s_TD [T, D]: the shared expert (params: its weights) on acts["normed_TD"]. It reads the
    tokens only, so a pipeline runs it while the dispatch exchange travels."""
    return shared_experts(params, acts["normed_TD"])


def finish(acts: dict[str, torch.Tensor], route: MoERoute,
           parallel: ParallelContext = LOCAL) -> dict[str, torch.Tensor]:
    """Phase 4's compute: return acts with "h_BSD" = residual + unpermute(rows_RD, probs_TK) (+ shared),
    consuming "rows_RD" (or "y_TD", tokens a token-level dispatcher already combined), "probs_TK",
    "shared_TD" and "residual_BSD"; other keys pass through. Without "residual_BSD" (a bare MoE layer,
    fmoe.model.moe) the layer's output is "out_TD" [T, D] instead. `parallel`: with tensor parallelism
    and no sequence parallelism the residual is replicated on the tp group and the tokens are this rank's
    share of it (`attention`): they are joined first (`join_tokens`). Raises ValueError when acts and
    `route` are not of one microbatch (token or row counts) or the gate weights or shared output would be
    misapplied."""
    tp = parallel.joined_tp
    _check_finish_acts(acts, route, 1 if tp is None else tp.size)
    if "y_TD" in acts:
        y_TD = acts["y_TD"]
    else:
        # the rows are the layer's own (its experts' output, or what its combine received), read nowhere
        # after this: donated
        y_TD = combine_rows(acts["rows_RD"], acts.get("probs_TK"), route, donate=True)
    if "shared_TD" in acts:
        y_TD = y_TD + acts["shared_TD"]
    used = ("rows_RD", "y_TD", "probs_TK", "shared_TD", "residual_BSD")
    out = {k: v for k, v in acts.items() if k not in used}
    r_BSD = acts.get("residual_BSD")
    if r_BSD is None:
        out["out_TD"] = y_TD
    else:
        out["h_BSD"] = r_BSD + (y_TD if tp is None else join_tokens(y_TD, tp)).reshape(r_BSD.shape)
    return out


def dense_block(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig, *,
                check: bool = True, parallel: ParallelContext = LOCAL,
                packing: Packing | None = None) -> torch.Tensor:
    """Return y_BSD of a dense block: attention sublayer, then x + SwiGLU(rms_norm(x)). `check`: check
    the params against `cfg` (a dense block) first; False skips it. `parallel.tp`: the tensor-parallel
    group, `params` this rank's shard (fmoe/tp_layout.py); x and y replicated on the group, or with
    `parallel.sequence_parallel` this rank's positions [B, S/P, D]. `packing`: as in `self_attention`."""
    tp = parallel.tp
    if check:
        if tp is None:
            check_block(params, cfg, dense=True)
        else:
            check_tp(cfg, tp.size, dense=True)
            check_shard(params, cfg, tp.size, tuple(SPLITS))
    r_BSD = self_attention(params, x_BSD, cfg, check=False, parallel=parallel, packing=packing)
    rc = cfg.recompute  # "mlp" recomputes the norm with the rest of the MLP already
    return part(rc, "mlp", swiglu_mlp)(params["mlp"], r_BSD, cfg.norm_eps, parallel,
                                       rc.module("layernorm") and not rc.module("mlp"))
