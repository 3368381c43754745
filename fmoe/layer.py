"""The MoE layer as a pure function: route -> permute -> dispatch -> experts -> combine -> unpermute.

    params = init_moe(cfg, generator)        # {"router": {"weight"}, "experts": {...}, "shared": {...}}
    state = init_moe_state(cfg)              # non-differentiated: expert bias, capacity window
    y_TD, aux = moe(params, x_TD, cfg, state)

Legend: T tokens, D model width, E experts, K experts per token, N = T * K (token, slot) pairs,
M expert-sorted layout rows (N dropless, fewer with drops, E * C padded).

The pieces (`route_tokens`, `expert_rows`, `combine_rows`) are what the block's stage functions call
one by one; `moe` composes them. No residual and no norm here: that is the block's job.
Host syncs: grouped_linear reads the per-expert counts once; capacity modes and adaptive recompute
add the reads listed in fmoe/capacity.py and fmoe/recompute.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmoe.balance import max_over_mean, update_expert_bias
from fmoe.capacity import init_capacity_state, make_layout
from fmoe.config import MoEConfig
from fmoe.dispatch.base import Dispatcher
from fmoe.dispatch.local import LocalDispatcher
from fmoe.experts import init_experts, init_shared, routed_experts, shared_experts
from fmoe.ops import Layout, permute, permute_probs, unpermute
from fmoe.recompute import maybe_remat, overloaded
from fmoe.router import init_router, route


@dataclass(frozen=True)
class MoERoute:
    """Non-differentiable routing metadata handed from the routing step to the expert and combine steps.

    layout: the expert-sorted row layout (fmoe.ops.Layout); ids_TK: int64 [T, K] chosen experts;
    tokens_per_expert_E: int64 [E] load before drops; dropped: int64 scalar, (token, slot) pairs dropped;
    capacity: C or None (dropless); capacity_missed: dynamic-capacity forecast miss (None if not dynamic);
    recompute: whether the expert step runs under remat; new_state: the layer's next state pytree;
    losses: the balancing losses, detached, for logging.
    """

    layout: Layout
    ids_TK: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    dropped: torch.Tensor
    capacity: int | None
    capacity_missed: bool | None
    recompute: bool
    new_state: dict[str, torch.Tensor]
    losses: dict[str, torch.Tensor]


@dataclass(frozen=True)
class MoEAux:
    """Everything `moe` reports besides y.

    loss: differentiable scalar, the sum of the balancing losses (add it to the training loss);
    losses: {"aux", "seq_aux", "z"} detached scalars (for logging); tokens_per_expert_E: int64 [E] load;
    dropped: int64 scalar; max_over_mean: float scalar max load / mean load; new_state: next state;
    recomputed: whether the expert activations were rematerialised; capacity: C or None;
    capacity_missed: dynamic-capacity miss this step (None if not dynamic).
    """

    loss: torch.Tensor
    losses: dict[str, torch.Tensor]
    tokens_per_expert_E: torch.Tensor
    dropped: torch.Tensor
    max_over_mean: torch.Tensor
    new_state: dict[str, torch.Tensor]
    recomputed: bool
    capacity: int | None
    capacity_missed: bool | None


def init_moe(cfg: MoEConfig, generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Return the MoE parameter pytree (weights [in, out]):

    {"router": {"weight": [D, E]},
     "experts": {"w_gate": [E, D, F], "w_up": [E, D, F], "w_down": [E, F, D]},
     "shared": {"w_gate": [D, S], "w_up": [D, S], "w_down": [S, D], ("gate": [D, 1])}}  (if shared)
    with S = num_shared_experts * d_ff. Entries are N(0, 1/fan_in).
    """
    params: dict[str, Any] = {"router": init_router(cfg, generator, dtype),
                              "experts": init_experts(cfg, generator, dtype)}
    if cfg.num_shared_experts:
        params["shared"] = init_shared(cfg, generator, dtype)
    return params


def init_moe_state(cfg: MoEConfig, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Return the non-differentiated state: {"expert_bias_E": fp32 zeros [E]} when aux-loss-free
    balancing is on, plus the dynamic-capacity entries (fmoe.capacity.init_capacity_state)."""
    state: dict[str, torch.Tensor] = {}
    if cfg.bias_update_rate > 0:
        state["expert_bias_E"] = torch.zeros(cfg.num_experts, dtype=torch.float32, device=device)
    state.update(init_capacity_state(cfg, device))
    return state


def plan_route(params: dict[str, Any], x_TD: torch.Tensor, cfg: MoEConfig,
               state: dict[str, Any] | None = None, seq_len: int | None = None,
               recompute: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, MoERoute]:
    """Route without moving rows: return (probs_TK, loss, route).

    probs_TK: fp32 gate weights [T, K]; loss: differentiable balancing loss; route: the `MoERoute`
    metadata (layout, next state, recompute decision). `recompute` overrides the adaptive rule.
    """
    if state is None:
        state = init_moe_state(cfg, x_TD.device)
    elif cfg.bias_update_rate > 0 and "expert_bias_E" not in state:
        # A state without the bias (e.g. {}) starts it at zero rather than silently switching balancing off.
        zeros_E = torch.zeros(cfg.num_experts, dtype=torch.float32, device=x_TD.device)
        state = {**state, "expert_bias_E": zeros_E}
    r = route(params["router"], x_TD, cfg, state, seq_len)
    layout, cap = make_layout(r.ids_TK, r.probs_TK, cfg, state)
    new_state = dict(cap.new_state)
    if "expert_bias_E" in state:
        new_state["expert_bias_E"] = update_expert_bias(state["expert_bias_E"], r.counts_E,
                                                        cfg.bias_update_rate)
    if recompute is None:
        recompute = cfg.adaptive_recompute and overloaded(r.counts_E, cfg.recompute_load_scale)
    meta = MoERoute(layout=layout, ids_TK=r.ids_TK, tokens_per_expert_E=r.counts_E, dropped=cap.dropped,
                    capacity=cap.capacity, capacity_missed=cap.missed, recompute=bool(recompute),
                    new_state=new_state, losses={k: v.detach() for k, v in r.losses.items()})
    return r.probs_TK, r.loss, meta


def route_tokens(params: dict[str, Any], x_TD: torch.Tensor, cfg: MoEConfig,
                 state: dict[str, Any] | None = None, seq_len: int | None = None,
                 recompute: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, MoERoute]:
    """Route and permute: return (xs_ND, probs, loss, route).

    xs_ND: token rows in the expert-sorted layout [M, D]; probs: gate weights, [T, K] when applied at
    combine, or [M] per layout row when cfg.probs_in_expert; loss: differentiable balancing loss;
    route: the `MoERoute` metadata. `recompute` overrides the adaptive-recompute decision.
    """
    probs_TK, loss, meta = plan_route(params, x_TD, cfg, state, seq_len, recompute)
    xs_ND = permute(x_TD, meta.layout)
    probs = permute_probs(probs_TK, meta.layout) if cfg.probs_in_expert else probs_TK
    return xs_ND, probs, loss, meta


def uses_token_dispatch(dispatcher: Any, cfg: MoEConfig) -> bool:
    """True when `moe` hands whole tokens to the dispatcher (`dispatch_tokens` / `combine_tokens`).

    A token-level dispatcher does permute-1, unpermute and the gate weighting itself, which lets the
    hierarchical one send a token to a node once however many of its experts live there. It applies to
    dropless routing with gate weights at combine; other modes use the row-level seam.
    """
    return (hasattr(dispatcher, "dispatch_tokens") and cfg.capacity_factor is None
            and not cfg.dynamic_capacity_window and not cfg.probs_in_expert)


def dispatch_rows(xs_ND: torch.Tensor, probs: torch.Tensor | None, route: MoERoute,
                  dispatcher: Dispatcher) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Send layout rows to the experts: return (xe_MD, probs_M or None, (counts_L, meta))."""
    probs_N = probs if probs is not None and probs.dim() == 1 else None
    xe_MD, counts_L, probs_M, meta = dispatcher.dispatch(xs_ND, route.layout.counts_E, probs_N)
    # Unchanged counts of a padded layout are known on the host: hand the python ints on (no sync).
    if counts_L is route.layout.counts_E and route.layout.counts is not None:
        counts_L = route.layout.counts
    return xe_MD, probs_M, (counts_L, meta)


def expert_rows(experts: dict[str, torch.Tensor], xe_MD: torch.Tensor, probs_M: torch.Tensor | None,
                counts_L: Any, cfg: MoEConfig, recompute: bool = False) -> torch.Tensor:
    """Run the routed experts on rows grouped by local expert: return ye_MD (remat when `recompute`)."""
    def run(p: dict[str, torch.Tensor], x_MD: torch.Tensor, pr_M: torch.Tensor | None) -> torch.Tensor:
        return routed_experts(p, x_MD, counts_L, pr_M, cfg.backend)

    return maybe_remat(run, recompute)(experts, xe_MD, probs_M)


def combine_rows(ys_ND: torch.Tensor, probs: torch.Tensor | None, route: MoERoute) -> torch.Tensor:
    """Back to token order: return y_TD = sum over the K slots (weighted by probs_TK unless applied)."""
    probs_TK = probs if probs is not None and probs.dim() == 2 else None
    return unpermute(ys_ND, probs_TK, route.layout)


def make_aux(loss: torch.Tensor, route: MoERoute) -> MoEAux:
    """Assemble the `MoEAux` of a layer from its differentiable loss and routing metadata."""
    return MoEAux(loss=loss, losses=dict(route.losses), tokens_per_expert_E=route.tokens_per_expert_E,
                  dropped=route.dropped, max_over_mean=max_over_mean(route.tokens_per_expert_E),
                  new_state=route.new_state, recomputed=route.recompute, capacity=route.capacity,
                  capacity_missed=route.capacity_missed)


def moe(params: dict[str, Any], x_TD: torch.Tensor, cfg: MoEConfig, state: dict[str, Any] | None = None,
        *, seq_len: int | None = None, dispatcher: Dispatcher | None = None,
        recompute: bool | None = None) -> tuple[torch.Tensor, MoEAux]:
    """Return (y_TD, aux): the MoE layer's output [T, D] (x's dtype) and its `MoEAux`.

    `state`: the layer's state pytree (default: init_moe_state); aux.new_state is the next one.
    `seq_len`: tokens per sequence for the sequence-wise loss (T = B * seq_len, sequence-major).
    `dispatcher`: how rows reach the experts (default LocalDispatcher); one with `dispatch_tokens` gets
    whole tokens when `uses_token_dispatch` says so. `recompute`: force (True) or
    forbid (False) rematerialising the expert activations; None = cfg.adaptive_recompute rule.
    aux.loss is differentiable: add it to the loss you differentiate.
    """
    if x_TD.dim() != 2 or x_TD.shape[1] != cfg.d_model:
        raise ValueError(f"moe: x must be [T, {cfg.d_model}], got {tuple(x_TD.shape)}")
    dispatcher = dispatcher or LocalDispatcher(cfg.num_experts)
    if uses_token_dispatch(dispatcher, cfg):
        probs_TK, loss, meta = plan_route(params, x_TD, cfg, state, seq_len, recompute)
        xe_MD, counts_L, dmeta = dispatcher.dispatch_tokens(x_TD, meta.ids_TK, probs_TK)
        ye_MD = expert_rows(params["experts"], xe_MD, None, counts_L, cfg, meta.recompute)
        y_TD = dispatcher.combine_tokens(ye_MD, dmeta).to(x_TD.dtype)
    else:
        xs_ND, probs, loss, meta = route_tokens(params, x_TD, cfg, state, seq_len, recompute)
        xe_MD, probs_M, (counts_L, dmeta) = dispatch_rows(xs_ND, probs, meta, dispatcher)
        ye_MD = expert_rows(params["experts"], xe_MD, probs_M, counts_L, cfg, meta.recompute)
        y_TD = combine_rows(dispatcher.combine(ye_MD, dmeta), probs, meta)
    if "shared" in params:
        y_TD = y_TD + shared_experts(params["shared"], x_TD)
    return y_TD, make_aux(loss, meta)
