"""The router: scores, group-limited top-k selection, gate weights and balancing losses.

    r = route(router_params, x_TD, cfg, state)      # r.ids_TK, r.probs_TK, r.counts_E, r.losses

Legend (the package's, docs/moe.md): T tokens, D model width, E experts, K top-k slots, J expert groups
(num_groups), e = E / J experts per group, X a generic axis.

Ties (equal selection scores, equal group scores) go to the lowest expert / group index.
Everything is computed in fp32 whatever the input dtype (fp64 stays fp64), so selection does not
depend on bf16 rounding. The expert bias of aux-loss-free balancing (state["expert_bias_E"]) shifts the
scores used for *selection* only; gate weights come from the unbiased scores.
No host sync: shapes are static (T, K, E) and nothing is read back.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch
from einops import rearrange, repeat

from fmoe.balance import TokenShard, aux_loss, graph_zero, seq_aux_loss, z_loss
from fmoe.config import MoEConfig
from fmoe.init import scaled_normal
from fmoe.ops import cast, compute_dtype, expert_counts, linear
from fmoe.structure import check_router
from fmoe.transforms.pytree import pytree_dataclass


@pytree_dataclass
@dataclass(frozen=True)
class Routing:
    """What the router decided for T tokens.

    ids_TK: int64 [T, K] chosen experts per token (best first).
    probs_TK: float [T, K] gate weights (router compute dtype), differentiable w.r.t. the router weight.
    counts_E: int64 [E] (token, slot) pairs per expert, before any capacity drop (the load).
    losses: {"aux", "seq_aux", "z"} -> scalars, differentiable when active (an exact 0 when its
    coefficient is 0).
    loss: scalar, the sum of `losses`.
    """

    ids_TK: torch.Tensor
    probs_TK: torch.Tensor
    counts_E: torch.Tensor
    losses: dict[str, torch.Tensor]
    loss: torch.Tensor


def init_router(cfg: MoEConfig, generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Return the router params {"w": [D, E]} with N(0, 1/D) entries."""
    return {"w": scaled_normal((cfg.d_model, cfg.num_experts), cfg.d_model, generator, dtype)}


def _top_indices(score_TX: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, best first; ties go to the lowest index.

    torch.topk leaves the order of equal values unspecified (on CPU it picks the *highest* indices of a
    tie), so a zero router or a saturated score would route differently from run to run / device to
    device. A stable descending sort makes selection a pure function of the scores.
    """
    return torch.sort(score_TX, dim=-1, descending=True, stable=True).indices[:, :k]


def _group_mask(choice_TE: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Return a bool [T, E] mask of the experts in each token's topk_groups best groups."""
    T, E = choice_TE.shape
    J = cfg.num_groups
    choice_TJe = rearrange(choice_TE, "t (j e) -> t j e", j=J)  # expert-major: group j is e consecutive ids
    top_in_group = min(2, E // J)
    group_score_TJ = choice_TJe.topk(top_in_group, dim=-1).values.sum(-1)
    best_TX = _top_indices(group_score_TJ, cfg.topk_groups)  # X = topk_groups
    mask_TJ = torch.zeros(T, J, dtype=torch.bool, device=choice_TE.device).scatter(1, best_TX, True)
    return repeat(mask_TJ, "t j -> t (j e)", e=E // J)


def check_seq_len(seq_len: int | None, num_tokens: int) -> None:
    """Raise ValueError unless `seq_len` is None (one sequence) or a positive int dividing `num_tokens`
    (T = B * seq_len tokens, sequence-major); returns None."""
    if seq_len is None:
        return
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len <= 0 or (
            num_tokens % seq_len):
        raise ValueError(f"seq_len (tokens per sequence) must be a positive int that divides the "
                         f"{num_tokens} tokens, or None for one sequence; got {seq_len!r}")


def route(params: dict[str, torch.Tensor], x_TD: torch.Tensor, cfg: MoEConfig,
          state: dict[str, Any] | None = None, seq_len: int | None = None, *, check: bool = True,
          shard: TokenShard | None = None) -> Routing:
    """Route T tokens to K of E experts; returns a `Routing` (see its field shapes).

    `params["w"]` is the [D, E] router weight. `state` may hold "expert_bias_E" (selection bias).
    `seq_len` splits the T tokens into sequences for the sequence-wise loss (default: one sequence); it
    must be a positive int dividing T (ValueError otherwise). `check`: check params and state against
    `cfg` first (fmoe/structure.py; False skips it, for trees that already passed).
    A balancing loss whose coefficient is 0 is an exact 0 (not computed from the data, so a NaN token
    does not turn it NaN). `shard`: x_TD is this rank's equal shard of its tensor-parallel group's tokens;
    the losses take the group's statistics (fmoe/balance.py). counts_E stays this rank's (its layout's).
    """
    T, E, K = x_TD.shape[0], cfg.num_experts, cfg.top_k
    check_seq_len(seq_len, T)
    if check:
        check_router(params, cfg, state)
    ct = compute_dtype(x_TD.dtype)
    # The cast of w is the identity (same object, so its dw stays deferrable) when w is already ct.
    logits_TE = linear(cast(x_TD, ct), cast(params["w"], ct))
    if cfg.score_func == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    else:
        scores_TE = torch.sigmoid(logits_TE)
    choice_TE = scores_TE.detach()
    bias_E = (state or {}).get("expert_bias_E")
    if bias_E is not None:
        choice_TE = choice_TE + bias_E.to(ct)
    if cfg.num_groups > 1 and cfg.topk_groups < cfg.num_groups:
        choice_TE = choice_TE.masked_fill(~_group_mask(choice_TE, cfg), float("-inf"))
    ids_TK = _top_indices(choice_TE, K)
    probs_TK = scores_TE.gather(1, ids_TK)
    if cfg.topk_norm == "after":
        probs_TK = probs_TK / probs_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(ct).tiny)
    if cfg.topk_scale != 1.0:
        probs_TK = probs_TK * cfg.topk_scale
    counts_E = expert_counts(ids_TK, E)

    # Balance losses see a distribution over experts per token: sigmoid scores are normalised first.
    dist_TE = scores_TE if cfg.score_func == "softmax" else (
        scores_TE / scores_TE.sum(-1, keepdim=True).clamp(min=torch.finfo(ct).tiny))
    active = {}
    if cfg.aux_loss_coef:
        active["aux"] = aux_loss(dist_TE, counts_E, K, cfg.aux_loss_coef, shard)
    if cfg.seq_aux_loss_coef and T:
        active["seq_aux"] = seq_aux_loss(dist_TE, ids_TK, T if seq_len is None else seq_len,
                                         cfg.seq_aux_loss_coef, shard)
    if cfg.z_loss_coef:
        active["z"] = z_loss(logits_TE, cfg.z_loss_coef, shard)
    # A switched-off loss is an exact zero; the total sums the active ones only (an exact zero on the
    # router's graph when none is: its gradient is zero and it reads no value of the logits).
    zero = logits_TE.new_zeros(())
    losses = {name: active.get(name, zero) for name in ("aux", "seq_aux", "z")}
    parts = list(active.values())
    loss = sum(parts[1:], parts[0]) if parts else graph_zero(logits_TE)
    return Routing(ids_TK=ids_TK, probs_TK=probs_TK, counts_E=counts_E, losses=losses, loss=loss)
