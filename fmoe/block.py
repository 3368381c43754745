"""A transformer block with an MoE MLP, as the four stage functions of seed 000.

    acts, route = attention(params, x_BSD, cfg, state)   # norm, attention, residual, norm, router, permute
    disp, dmeta = dispatch(params, acts["rows"], probs_N, route, dispatcher)   # tokens to experts
    out = mlp(params, disp["rows"], disp.get("probs"), acts["normed"], route, dmeta, cfg)   # experts
    y_BSD = combine(params, out["rows"], out.get("shared"), acts["residual"], probs_TK, route, dmeta,
                    dispatcher)                                # back to token order, residual

Legend: B sequences, S positions, T = B * S tokens, D model width, H query heads, G kv heads,
d head dim, K experts per token, N expert-sorted (token, slot) rows of this rank (the layout),
M rows this rank's experts receive (N locally).

Each stage is pure, `(params, *activations, *metadata) -> outputs`, so a scheduler can run it under
`split_vjp` on its own: differentiable outputs come back as a dict of tensors (keys present only when
the mode uses them), non-differentiable metadata (`MoERoute`, the dispatcher's meta) separately.
`attention` and `dispatch` return `(acts, meta)` (use `has_aux=True`); `mlp` and `combine` return
activations only. probs are [T, K] gate weights applied at combine, or [N] per row when
cfg.moe.probs_in_expert (then they travel with the rows through dispatch and combine gets None).
The balancing loss is the output acts["loss"] of `attention`: give it a cotangent (e.g. 1.0).

Parameter layout of a block:
{"attn_norm": [D], "wq": [D, H*d], "wk": [D, G*d], "wv": [D, G*d], "wo": [H*d, D], "mlp_norm": [D],
 "moe": fmoe.init_moe params}; a dense block has "mlp": fmoe.dense.init_swiglu_mlp params instead
of "mlp_norm" and "moe".
"""

from __future__ import annotations

from typing import Any

import torch

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
    """Return {"attn_norm": [D], "wq": [D, H*d], "wk": [D, G*d], "wv": [D, G*d], "wo": [H*d, D]}."""
    D, Hd, Gd = cfg.d_model, cfg.n_heads * cfg.hd, cfg.kv_heads * cfg.hd
    return {"attn_norm": torch.ones(D, dtype=dtype),
            "wq": scaled_normal((D, Hd), D, generator, dtype),
            "wk": scaled_normal((D, Gd), D, generator, dtype),
            "wv": scaled_normal((D, Gd), D, generator, dtype),
            "wo": scaled_normal((Hd, D), Hd, generator, dtype)}


def init_block(cfg: GPTConfig, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
               dense: bool = False) -> dict[str, Any]:
    """Return one block's params (see the module docstring); `dense` gives a dense SwiGLU block."""
    p: dict[str, Any] = init_attention(cfg, generator, dtype)
    if dense:
        p["mlp"] = init_swiglu_mlp(cfg.d_model, cfg.dense_ff, generator, dtype)
    else:
        p["mlp_norm"] = torch.ones(cfg.d_model, dtype=dtype)
        p["moe"] = init_moe(cfg.moe, generator, dtype)
    return p


def self_attention(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Return r_BSD = x + wo(attention(rope(q), rope(k), v)) with q, k, v projected from rms_norm(x)."""
    B, S, D = x_BSD.shape
    h_BSD = rms_norm(x_BSD, params["attn_norm"], cfg.norm_eps)
    q_BSHd = linear(h_BSD, params["wq"]).reshape(B, S, cfg.n_heads, cfg.hd)
    k_BSGd = linear(h_BSD, params["wk"]).reshape(B, S, cfg.kv_heads, cfg.hd)
    v_BSGd = linear(h_BSD, params["wv"]).reshape(B, S, cfg.kv_heads, cfg.hd)
    o_BSHd = attention_op(q_BSHd, k_BSGd, v_BSGd, rope_theta=cfg.rope_theta, causal=True)
    return x_BSD + linear(o_BSHd.reshape(B, S, cfg.n_heads * cfg.hd), params["wo"])


def attention(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig,
              state: dict[str, Any] | None = None,
              recompute: bool | None = None) -> tuple[dict[str, torch.Tensor], MoERoute]:
    """Stage 1: return (acts, route).

    acts: {"residual": r_BSD (x + attention), "normed": h_TD (rms_norm(r), the experts' input),
    "rows": xs_ND (h permuted to the expert-sorted layout), "probs": [T, K] or [N], "loss": scalar}.
    route: the `MoERoute` (layout, load, drops, new state, recompute decision).
    """
    B, S, D = x_BSD.shape
    r_BSD = self_attention(params, x_BSD, cfg)
    h_TD = rms_norm(r_BSD, params["mlp_norm"], cfg.norm_eps).reshape(B * S, D)
    xs_ND, probs, loss, route = route_tokens(params["moe"], h_TD, cfg.moe, state, S, recompute)
    return {"residual": r_BSD, "normed": h_TD, "rows": xs_ND, "probs": probs, "loss": loss}, route


def dispatch(params: dict[str, Any], rows_ND: torch.Tensor, probs_N: torch.Tensor | None, route: MoERoute,
             dispatcher: Dispatcher) -> tuple[dict[str, torch.Tensor], Any]:
    """Stage 2: return ({"rows": xe_MD[, "probs": probs_M]}, dmeta); `params` is unused (no weights).

    probs_N: the per-row gate weights when they are applied inside the experts, else None.
    dmeta: (counts per local expert, the dispatcher's meta) for `mlp` and `combine`.
    """
    xe_MD, probs_M, dmeta = dispatch_rows(rows_ND, probs_N, route, dispatcher)
    out = {"rows": xe_MD}
    if probs_M is not None:
        out["probs"] = probs_M
    return out, dmeta


def mlp(params: dict[str, Any], rows_MD: torch.Tensor, probs_M: torch.Tensor | None,
        normed_TD: torch.Tensor | None, route: MoERoute, dmeta: Any,
        cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Stage 3: return {"rows": ye_MD[, "shared": s_TD]}: routed experts (and the shared expert).

    The routed experts run under `fmoe.transforms.remat` when route.recompute (load-aware recompute).
    """
    counts_L, _ = dmeta
    experts = params["moe"]["experts"]
    out = {"rows": expert_rows(experts, rows_MD, probs_M, counts_L, cfg.moe, route.recompute)}
    if "shared" in params["moe"]:
        out["shared"] = shared_experts(params["moe"]["shared"], normed_TD)
    return out


def combine(params: dict[str, Any], rows_MD: torch.Tensor, shared_TD: torch.Tensor | None,
            residual_BSD: torch.Tensor, probs_TK: torch.Tensor | None, route: MoERoute, dmeta: Any,
            dispatcher: Dispatcher) -> torch.Tensor:
    """Stage 4: return y_BSD = residual + unpermute(combine(rows)) (+ shared); `params` is unused."""
    _, meta = dmeta
    y_TD = combine_rows(dispatcher.combine(rows_MD, meta), probs_TK, route)
    if shared_TD is not None:
        y_TD = y_TD + shared_TD
    return residual_BSD + y_TD.reshape(residual_BSD.shape)


def block(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig, state: dict[str, Any] | None = None,
          dispatcher: Dispatcher | None = None, recompute: bool | None = None) -> tuple[torch.Tensor, MoEAux]:
    """Return (y_BSD, aux): the four stages composed (aux.loss is the differentiable balancing loss)."""
    dispatcher = dispatcher or LocalDispatcher(cfg.moe.num_experts)
    in_expert = cfg.moe.probs_in_expert
    acts, route = attention(params, x_BSD, cfg, state, recompute)
    disp, dmeta = dispatch(params, acts["rows"], acts["probs"] if in_expert else None, route, dispatcher)
    out = mlp(params, disp["rows"], disp.get("probs"), acts["normed"], route, dmeta, cfg)
    y_BSD = combine(params, out["rows"], out.get("shared"), acts["residual"],
                    None if in_expert else acts["probs"], route, dmeta, dispatcher)
    return y_BSD, make_aux(acts["loss"], route)


def dense_block(params: dict[str, Any], x_BSD: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Return y_BSD of a dense block: attention sublayer, then x + SwiGLU(rms_norm(x))."""
    r_BSD = self_attention(params, x_BSD, cfg)
    return swiglu_mlp(params["mlp"], r_BSD, cfg.norm_eps)
