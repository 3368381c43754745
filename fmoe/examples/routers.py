"""Two routers written against the `fmoe.seams.Router` signature (docs/research.md).

    cfg = MoEConfig(..., router=temperature)                      # or "fmoe.examples.routers:temperature"
    fmoe train --router fmoe.examples.routers:expert_choice

- `make_temperature(t)`: token choice over softmax(logits / t), top-k, renormalised as cfg.topk_norm says;
  t > 1 flattens the gate weights, t < 1 sharpens them. `temperature` is t = 2.
- `make_expert_choice(c)`: expert choice (Zhou et al., 2022): each expert picks its ceil(c * T / E) best
  tokens by softmax score (c: experts per token on average; default cfg.top_k, the compute of top-k
  token choice). The layer's layout is [T, K] slots per token, so a token keeps its K best picks, and a
  token picked by fewer than K experts fills its other slots with gate weight 0 (they still cost a row
  each). With top_k = E every pick fits: exact expert choice. `expert_choice` is c = cfg.top_k.

Legend (the package's, docs/moe.md): T tokens, D model width, E experts, K top-k slots, C tokens an
expert picks.

Both read the router weight params["w"] [D, E] (fmoe.router.init_router's layout), compute in fp32 (fp64
stays fp64) and select on detached scores, so gradients reach the gate weights only; neither syncs with
the host. Balancing losses: `temperature` has the router's aux and z losses; expert choice is balanced by
construction and has only the z loss (cfg.z_loss_coef).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fmoe.balance import aux_loss, graph_zero, z_loss
from fmoe.config import MoEConfig
from fmoe.ops import compute_dtype, expert_counts, linear
from fmoe.router import Routing
from fmoe.seams import Router


def _logits(params: dict[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    ct = compute_dtype(x_TD.dtype)
    return linear(x_TD.to(ct), params["w"].to(ct))


def _routing(ids_TK: torch.Tensor, probs_TK: torch.Tensor, logits_TE: torch.Tensor,
             active: dict[str, torch.Tensor], E: int) -> Routing:
    """Assemble a Routing: the losses not in `active` are exact zeros, `loss` their sum (on the graph)."""
    zero = logits_TE.new_zeros(())
    losses = {name: active.get(name, zero) for name in ("aux", "seq_aux", "z")}
    parts = list(active.values())
    loss = sum(parts[1:], parts[0]) if parts else graph_zero(logits_TE)
    return Routing(ids_TK=ids_TK, probs_TK=probs_TK, counts_E=expert_counts(ids_TK, E), losses=losses,
                   loss=loss)


def make_temperature(t: float) -> Router:
    """Return a top-k router over softmax(logits / t) (t > 0)."""
    if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {t!r}")

    def temperature(params: dict[str, torch.Tensor], x_TD: torch.Tensor, cfg: MoEConfig,
                    state: dict[str, Any] | None = None, seq_len: int | None = None) -> Routing:
        """Token choice over softmax(logits / t): the K best experts per token (ties: lowest id)."""
        logits_TE = _logits(params, x_TD)
        scores_TE = torch.softmax(logits_TE / t, dim=-1)
        # stable: equal scores go to the lowest expert id, as fmoe.router.route does
        ids_TK = torch.sort(scores_TE.detach(), dim=-1, descending=True, stable=True).indices[:, :cfg.top_k]
        probs_TK = scores_TE.gather(1, ids_TK)
        if cfg.topk_norm == "after":
            probs_TK = probs_TK / probs_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(probs_TK.dtype).tiny)
        probs_TK = probs_TK * cfg.topk_scale
        active = {}
        if cfg.aux_loss_coef:
            active["aux"] = aux_loss(scores_TE, expert_counts(ids_TK, cfg.num_experts), cfg.top_k,
                                     cfg.aux_loss_coef)
        if cfg.z_loss_coef:
            active["z"] = z_loss(logits_TE, cfg.z_loss_coef)
        return _routing(ids_TK, probs_TK, logits_TE, active, cfg.num_experts)

    return temperature


def make_expert_choice(experts_per_token: float | None = None) -> Router:
    """Return an expert-choice router: each expert picks ceil(c * T / E) tokens, c = `experts_per_token`
    (default cfg.top_k); see the module docstring for how the picks fill the [T, K] slots."""
    if experts_per_token is not None and not (
            isinstance(experts_per_token, (int, float)) and math.isfinite(experts_per_token)
            and experts_per_token > 0):
        raise ValueError(f"experts_per_token must be a finite number > 0, got {experts_per_token!r}")

    def expert_choice(params: dict[str, torch.Tensor], x_TD: torch.Tensor, cfg: MoEConfig,
                      state: dict[str, Any] | None = None, seq_len: int | None = None) -> Routing:
        """Each expert picks its best tokens; each token keeps its K best picks (gate 0 for empty slots)."""
        T, E, K = x_TD.shape[0], cfg.num_experts, cfg.top_k
        logits_TE = _logits(params, x_TD)
        scores_TE = torch.softmax(logits_TE, dim=-1)
        choice_TE = scores_TE.detach()
        C = min(T, math.ceil((experts_per_token or K) * T / E))  # static: T and E are shapes
        # expert e picks the C largest scores of its column; stable: ties go to the earliest token
        picks_CE = torch.sort(choice_TE, dim=0, descending=True, stable=True).indices[:C]
        picked_TE = torch.zeros(T, E, dtype=torch.bool, device=x_TD.device).scatter_(0, picks_CE, True)
        # a token's slots: the experts that picked it first (scores lie in [0, 1], so + 2 ranks them above
        # every other), best first; the rest fill the slots left over and get gate weight 0
        ids_TK = torch.sort(choice_TE + 2 * picked_TE, dim=-1, descending=True, stable=True).indices[:, :K]
        probs_TK = (scores_TE * picked_TE).gather(1, ids_TK) * cfg.topk_scale
        active = {"z": z_loss(logits_TE, cfg.z_loss_coef)} if cfg.z_loss_coef else {}
        return _routing(ids_TK, probs_TK, logits_TE, active, E)

    return expert_choice


temperature = make_temperature(2.0)
expert_choice = make_expert_choice()
