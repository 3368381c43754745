"""A transformer block with an MoE MLP, as the four stage functions of seed 000.

    acts, route = attention(params, x_BSD, cfg, state)   # norm, attention, residual, norm, router, permute
    disp, dmeta = dispatch(params, acts["rows_RD"], acts.get("probs_R"), route, dispatcher)  # to experts
    out = mlp(params, disp["rows_MD"], disp.get("probs_M"), acts["normed_TD"], route, dmeta, cfg)  # experts
    y_BSD = combine(params, out["rows_MD"], out.get("shared_TD"), acts["residual_BSD"], acts.get("probs_TK"),
                    route, dmeta, dispatcher)              # back to token order, residual

Legend (the package's, docs/moe.md): B sequences, S positions, T = B * S tokens, D model width,
H query heads, G kv heads, d head dim, K top-k slots, R rows of this rank's expert-sorted layout,
M rows this rank's experts receive (M = R on one process).

Each stage is pure, `(params, *activations, *metadata) -> outputs`, so a scheduler can run it under
`split_vjp` on its own: differentiable outputs come back as a dict of tensors (keys present only when
the mode uses them), non-differentiable metadata (`MoERoute`, the dispatcher's meta) separately.
`attention` and `dispatch` return `(acts, meta)` (use `has_aux=True`); `mlp` and `combine` return
activations only. Activation keys carry the legend's shape suffix. The gate weights are
acts["probs_TK"] [T, K], applied at combine, or, when cfg.moe.probs_in_expert, acts["probs_R"] [R],
one per layout row, which travels with the rows through dispatch (disp["probs_M"]) while combine
gets None. The balancing loss is the output acts["loss"] of `attention`: give it a cotangent (e.g. 1.0).

Parameter layout of a block:
{"attn_norm": [D], "w_q": [D, H*d], "w_k": [D, G*d], "w_v": [D, G*d], "w_o": [H*d, D], "mlp_norm": [D],
 "moe": fmoe.init_moe params}; a dense block has "mlp": fmoe.dense.init_swiglu_mlp params instead
of "mlp_norm" and "moe".
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange

from fmoe.config import GPTConfig
from fmoe.dense import init_swiglu_mlp, swiglu_mlp
from fmoe.dispatch.base import Dispatcher
from fmoe.dispatch.local import LocalDispatcher
from fmoe.experts import shared_experts
from fmoe.init import scaled_normal
from fmoe.layer import (
    MoEAux,
    MoERoute,
    combine_rows,
    dispatch_rows,
    expert_rows,
    init_moe,
    make_aux,
    route_tokens,
)
from fmoe.ops import attention as attention_op
from fmoe.ops import linear, rms_norm


def init_attention(cfg: GPTConfig, generator: torch.Generator | None = None,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Return {"attn_norm": [D], "w_q": [D, H*d], "w_k": [D, G*d], "w_v": [D, G*d], "w_o": [H*d, D]}."""
    D, Hd, Gd = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"attn_norm": torch.ones(D, dtype=dtype),
            "w_q": scaled_normal((D, Hd), D, generator, dtype),
            "w_k": scaled_normal((D, Gd), D, generator, dtype),
            "w_v": scaled_normal((D, Gd), D, generator, dtype),
            "w_o": scaled_normal((Hd, D), Hd, generator, dtype)}


def init_block(cfg: GPTConfig, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
               dense: bool = False) -> dict[str, Any]:
    """Return one block's params (see the module docstring); `dense` gives a dense SwiGLU block."""
    p: dict[str, Any] = init_attention(cfg, generator, dtype)
    if dense:
        p["mlp"] = init_swiglu_mlp(cfg.d_model, cfg.d_ff_dense, generator, dtype)
    else:
        p["mlp_norm"] = torch.ones(cfg.d_model, dtype=dtype)
        p["moe"] = init_moe(cfg.moe, generator, dtype)
    return p


def self_attention(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Return r_BSD [B, S, D] = x + w_o(attention(rope(q), rope(k), v)), q, k, v projected from
    rms_norm(x) and split into heads ([B, S, H, d] and [B, S, G, d])."""
    H, G = cfg.n_heads, cfg.n_kv_heads
    h_BSD = rms_norm(x_BSD, params["attn_norm"], cfg.norm_eps)
    q_BSHd = rearrange(linear(h_BSD, params["w_q"]), "b s (h d) -> b s h d", h=H)
    k_BSGd = rearrange(linear(h_BSD, params["w_k"]), "b s (g d) -> b s g d", g=G)
    v_BSGd = rearrange(linear(h_BSD, params["w_v"]), "b s (g d) -> b s g d", g=G)
    o_BSHd = attention_op(q_BSHd, k_BSGd, v_BSGd, rope_theta=cfg.rope_theta, causal=True)
    return x_BSD + linear(rearrange(o_BSHd, "b s h d -> b s (h d)"), params["w_o"])


def attention(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig,
              state: dict[str, Any] | None = None,
              remat: bool | None = None) -> tuple[dict[str, torch.Tensor], MoERoute]:
    """Stage 1: return (acts, route).

    acts: {"residual_BSD": x + attention, "normed_TD": rms_norm(residual) per token (the experts'
    input), "rows_RD": normed_TD permuted to the expert-sorted layout, then "probs_TK": gate weights
    [T, K] (applied at combine) or "probs_R": gate weight [R] of each layout row (cfg.moe.probs_in_expert),
    and "loss": the differentiable balancing loss (scalar)}.
    route: the `MoERoute` (layout, load, drops, new state, remat decision).
    """
    S = x_BSD.shape[1]
    r_BSD = self_attention(params, x_BSD, cfg)
    h_TD = rearrange(rms_norm(r_BSD, params["mlp_norm"], cfg.norm_eps), "b s d -> (b s) d")
    x_RD, probs_TK, probs_R, loss, route = route_tokens(params["moe"], h_TD, cfg.moe, state, S, remat)
    acts = {"residual_BSD": r_BSD, "normed_TD": h_TD, "rows_RD": x_RD}
    if probs_R is None:
        acts["probs_TK"] = probs_TK
    else:
        acts["probs_R"] = probs_R
    acts["loss"] = loss
    return acts, route


def dispatch(params: dict[str, Any], rows_RD: torch.Tensor, probs_R: torch.Tensor | None, route: MoERoute,
             dispatcher: Dispatcher) -> tuple[dict[str, torch.Tensor], Any]:
    """Stage 2: return ({"rows_MD": x_MD[, "probs_M": probs_M]}, dmeta); `params` is unused (no weights).

    probs_R: the per-row gate weights when they are applied inside the experts, else None.
    dmeta: (counts per local expert, the dispatcher's meta) for `mlp` and `combine`.
    """
    x_MD, probs_M, dmeta = dispatch_rows(rows_RD, probs_R, route, dispatcher)
    out = {"rows_MD": x_MD}
    if probs_M is not None:
        out["probs_M"] = probs_M
    return out, dmeta


def mlp(params: dict[str, Any], rows_MD: torch.Tensor, probs_M: torch.Tensor | None,
        normed_TD: torch.Tensor | None, route: MoERoute, dmeta: Any,
        cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Stage 3: return {"rows_MD": y_MD[, "shared_TD": s_TD]}: routed experts (and the shared expert).

    The routed experts run under `fmoe.transforms.remat` when route.remat (load-aware remat).
    """
    counts_L, _ = dmeta
    experts = params["moe"]["experts"]
    out = {"rows_MD": expert_rows(experts, rows_MD, probs_M, counts_L, cfg.moe, route.remat)}
    if "shared" in params["moe"]:
        out["shared_TD"] = shared_experts(params["moe"]["shared"], normed_TD)
    return out


def combine(params: dict[str, Any], rows_MD: torch.Tensor, shared_TD: torch.Tensor | None,
            residual_BSD: torch.Tensor, probs_TK: torch.Tensor | None, route: MoERoute, dmeta: Any,
            dispatcher: Dispatcher) -> torch.Tensor:
    """Stage 4: return y_BSD = residual + unpermute(combine(rows), probs_TK) (+ shared); `params` is unused.

    probs_TK: gate weights [T, K] applied here, or None when they were applied inside the experts.
    """
    _, meta = dmeta
    y_TD = combine_rows(dispatcher.combine(rows_MD, meta), probs_TK, route)
    if shared_TD is not None:
        y_TD = y_TD + shared_TD
    return residual_BSD + y_TD.reshape(residual_BSD.shape)


def block(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig, state: dict[str, Any] | None = None,
          dispatcher: Dispatcher | None = None, remat: bool | None = None) -> tuple[torch.Tensor, MoEAux]:
    """Return (y_BSD, aux): the four stages composed (aux.loss is the differentiable balancing loss)."""
    dispatcher = dispatcher or LocalDispatcher(cfg.moe.num_experts)
    acts, route = attention(params, x_BSD, cfg, state, remat)
    disp, dmeta = dispatch(params, acts["rows_RD"], acts.get("probs_R"), route, dispatcher)
    out = mlp(params, disp["rows_MD"], disp.get("probs_M"), acts["normed_TD"], route, dmeta, cfg)
    y_BSD = combine(params, out["rows_MD"], out.get("shared_TD"), acts["residual_BSD"], acts.get("probs_TK"),
                    route, dmeta, dispatcher)
    return y_BSD, make_aux(acts["loss"], route)


def dense_block(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Return y_BSD of a dense block: attention sublayer, then x + SwiGLU(rms_norm(x))."""
    r_BSD = self_attention(params, x_BSD, cfg)
    return swiglu_mlp(params["mlp"], r_BSD, cfg.norm_eps)
