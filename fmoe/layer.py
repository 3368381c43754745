"""The MoE layer as a pure function: route -> permute -> dispatch -> experts -> combine -> unpermute.

    params = init_moe(cfg, generator)        # {"router": {"w"}, "experts": {...}, "shared": {...}}
    state = init_moe_state(cfg)              # non-differentiated: expert bias, capacity window
    y_TD, aux = fmoe.moe(params, x_TD, cfg, state)   # fmoe.model.moe

Legend (the package's, docs/moe.md): T tokens, D model width, E experts, L local experts, K top-k slots,
N = T * K (token, slot) pairs, R rows of the expert-sorted layout (N dropless, fewer with drops, E * C
padded), M rows this rank's experts receive after dispatch (M = R on one process), C capacity.

Gate weights have two forms, chosen by cfg.probs_in_expert, and a name each: probs_TK [T, K], applied
at combine (unpermute), or probs_R [R], one per layout row, sent along with the rows (probs_M after
dispatch) and applied inside the expert. `route_tokens` returns both slots, exactly one of them None.

The pieces (`plan_route`, `route_tokens`, `expert_rows`, `combine_rows`) are what the block's phase
functions call one by one; `fmoe.model.moe` runs the layer's phases (fmoe/phases.py) in order. No residual
and no norm here: that is the block's job.
Every function here that takes params or state with a config checks their keys, shapes and dtypes
against it first (fmoe/structure.py) unless given check=False; `moe` checks once and calls the pieces
with check=False.
Host syncs: grouped_linear reads the per-expert counts once; capacity modes and adaptive remat
add the reads listed in fmoe/capacity.py and fmoe/remat_policy.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmoe import transforms
from fmoe.balance import TokenShard, max_over_mean, update_expert_bias
from fmoe.capacity import init_capacity_state, make_layout
from fmoe.config import MoEConfig
from fmoe.dispatch.base import Dispatcher
from fmoe.dispatch.sync import as_exchange
from fmoe.experts import init_experts, init_shared, routed_experts
from fmoe.ops import Counts, Layout, permute, permute_probs, unpermute
from fmoe.parallel.collectives import CommGroup
from fmoe.parallel.tensor import tp_weight
from fmoe.remat_policy import expert_policy, overloaded
from fmoe.router import init_router, route
from fmoe.seams import check_routing, experts_of, router_of
from fmoe.structure import Leaf, check_moe, check_moe_state, check_tree
from fmoe.transforms.pytree import pytree_dataclass


@pytree_dataclass(static=("capacity", "capacity_missed", "remat"))
@dataclass(frozen=True)
class MoERoute:
    """Non-differentiable routing metadata handed from the routing step to the expert and combine steps.

    layout: the expert-sorted row layout (fmoe.ops.Layout); ids_TK: int64 [T, K] chosen experts;
    tokens_per_expert_E: int64 [E] load before drops; dropped: int64 scalar, (token, slot) pairs dropped;
    capacity: C or None (dropless); capacity_missed: dynamic-capacity forecast miss (None if not dynamic);
    remat: whether the expert step runs under remat; losses: the balancing losses, detached, for logging.
    The layer's next state is not routing's to make: fmoe.gpt_state.update_gpt_state (update_moe_state)
    moves it from the step's loads.
    """

    layout: Layout
    ids_TK: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    dropped: torch.Tensor
    capacity: int | None
    capacity_missed: bool | None
    remat: bool
    losses: dict[str, torch.Tensor]


@pytree_dataclass(static=("remat", "capacity", "capacity_missed"))
@dataclass(frozen=True)
class MoEAux:
    """Everything `moe` reports besides y.

    loss: differentiable scalar, the sum of the balancing losses (add it to the training loss);
    losses: {"aux", "seq_aux", "z"} detached scalars (for logging); tokens_per_expert_E: int64 [E] load;
    dropped: int64 scalar; max_over_mean (property): float scalar max load / mean load; new_state: next state;
    remat: whether the expert activations were rematerialised; capacity: C or None;
    capacity_missed: dynamic-capacity miss this step (None if not dynamic).
    """

    loss: torch.Tensor
    losses: dict[str, torch.Tensor]
    tokens_per_expert_E: torch.Tensor
    dropped: torch.Tensor
    new_state: dict[str, torch.Tensor]
    remat: bool
    capacity: int | None
    capacity_missed: bool | None

    @property
    def max_over_mean(self) -> torch.Tensor:
        """Float scalar max load / mean load of tokens_per_expert_E (computed when read: a training step
        sums the loads of its microbatches first, so most layers never need it)."""
        return max_over_mean(self.tokens_per_expert_E)


def _load_spec(cfg: MoEConfig) -> Leaf:
    """The spec of one step's load tokens_per_expert_E: a real [E] tensor."""
    return Leaf((("E", cfg.num_experts),), "number")


def init_moe(cfg: MoEConfig, generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Return the MoE parameter pytree (weights [in, out]):

    {"router": {"w": [D, E]},
     "experts": {"w_gate_up": [E, D, 2F] (gate | up), "w_down": [E, F, D]},
     "shared": {"w_gate": [D, F'], "w_up": [D, F'], "w_down": [F', D], ("w_out_gate": [D, 1])}}  (if shared)
    with F' = num_shared_experts * d_ff. Entries are N(0, 1/fan_in).
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


def update_moe_state(state: dict[str, torch.Tensor], cfg: MoEConfig, tokens_per_expert_E: torch.Tensor,
                     max_load: torch.Tensor | int | None = None,
                     missed: bool | None = None, *, check: bool = True) -> dict[str, torch.Tensor]:
    """Return the layer's next state after one step whose microbatches routed `tokens_per_expert_E`
    ([E], summed over the step's microbatches and, by the caller, over data-parallel ranks).

    The expert bias (aux-loss-free balancing) moves once, by the summed load. With dynamic capacity the
    window takes `max_load`, the step's largest per-expert load of one microbatch (capacity is sized per
    microbatch), and `missed` (did any microbatch exceed its forecast) counts once. With one microbatch
    this is the `new_state` that `moe` reports; a pipeline calls it once per step instead.
    `check`: check `state` and the load's shape ([E]) against `cfg` first (False skips it).
    """
    if check:
        check_moe_state(state, cfg)
        check_tree(tokens_per_expert_E, _load_spec(cfg), "update_moe_state: tokens_per_expert_E")
    new_state = dict(state or {})
    if cfg.bias_update_rate > 0:
        bias_E = state.get("expert_bias_E")
        if bias_E is None:
            bias_E = torch.zeros(cfg.num_experts, dtype=torch.float32, device=tokens_per_expert_E.device)
        new_state["expert_bias_E"] = update_expert_bias(bias_E, tokens_per_expert_E, cfg.bias_update_rate)
    if cfg.dynamic_capacity_window:
        if max_load is None or missed is None:
            raise ValueError("update_moe_state: dynamic capacity needs the step's max_load and missed")
        cap = {k: state[k] for k in ("load_history_W", "capacity_misses", "capacity_steps")} if (
            "load_history_W" in state) else init_capacity_state(cfg, tokens_per_expert_E.device)
        hist_W = cap["load_history_W"]
        load = torch.as_tensor(max_load, dtype=hist_W.dtype, device=hist_W.device).reshape(1)
        new_state["load_history_W"] = torch.cat([hist_W[1:], load])
        new_state["capacity_misses"] = cap["capacity_misses"] + (1 if missed else 0)
        new_state["capacity_steps"] = cap["capacity_steps"] + 1
    return new_state


def plan_route(params: dict[str, Any], x_TD: torch.Tensor, cfg: MoEConfig,
               state: dict[str, Any] | None = None, seq_len: int | None = None,
               remat: bool | None = None, *, check: bool = True, tp: CommGroup | None = None,
               shard: TokenShard | None = None) -> tuple[torch.Tensor, torch.Tensor, MoERoute]:
    """Route without moving rows: return (probs_TK, loss, route), with the router cfg.router carries
    (fmoe/seams.py; default fmoe.router.route).

    probs_TK: fp32 gate weights [T, K]; loss: differentiable balancing loss; route: the `MoERoute`
    metadata (layout, load, remat decision). `remat` overrides the adaptive rule. `check`: check
    params["router"] (the only entry read) and the state against `cfg` first. `tp`, `shard`: x_TD is
    this rank's equal shard of the tokens of the tensor-parallel group `tp` (`shard` says which: the
    block's `token_shard`): the router weight is replicated (its gradient summed over the group), the
    balancing losses, the load (route.tokens_per_expert_E), the bias update and the remat decision are
    the group's; the layout and capacity are this rank's, as under expert parallelism.
    """
    if check:
        check_moe(params, cfg, state, paths=[("router",)])
    if state is None:
        state = init_moe_state(cfg, x_TD.device)
    elif cfg.bias_update_rate > 0 and "expert_bias_E" not in state:
        # A state without the bias (e.g. {}) starts it at zero rather than silently switching balancing off.
        zeros_E = torch.zeros(cfg.num_experts, dtype=torch.float32, device=x_TD.device)
        state = {**state, "expert_bias_E": zeros_E}
    router = router_of(cfg)  # cfg.router (fmoe/seams.py): every caller of the layer routes through here
    router_params = params["router"]
    if tp is not None and shard is None:
        raise ValueError("plan_route: a tensor-parallel group needs this rank's share of its tokens (shard=)")
    if shard is not None:  # tensor or context parallelism: each rank routes its own share of the tokens
        what = "tensor" if tp is not None else "context"
        if cfg.dynamic_capacity_window:
            raise ValueError(f"dynamic capacity under {what} parallelism: its forecast would be per rank; "
                             "use dropless routing or a capacity factor")
        if router is not route:
            raise ValueError(f"router {getattr(router, '__name__', router)!r} under {what} parallelism: each "
                             "rank routes its own tokens and the balancing losses need the group's "
                             "statistics, which only fmoe.router.route reduces (its shard=)")
    if tp is not None:  # the replicated router weight: its gradient summed over the group
        router_params = {k: tp_weight(v, tp, op="tp.router") for k, v in router_params.items()}
    if router is route:
        r = route(router_params, x_TD, cfg, state, seq_len, check=False, shard=shard)
    else:
        r = router(router_params, x_TD, cfg, state, seq_len)
        check_routing(r, x_TD.shape[0], cfg)
    layout, cap = make_layout(r.ids_TK, r.probs_TK, cfg, state, r.counts_E)
    load_E = r.counts_E if shard is None else shard.total(r.counts_E)  # the group's
    if remat is None:
        remat = cfg.adaptive_remat and overloaded(load_E, cfg.remat_load_scale)
    meta = MoERoute(layout=layout, ids_TK=r.ids_TK, tokens_per_expert_E=load_E, dropped=cap.dropped,
                    capacity=cap.capacity, capacity_missed=cap.missed, remat=bool(remat),
                    losses={k: v.detach() for k, v in r.losses.items()})
    return r.probs_TK, r.loss, meta


def route_tokens(params: dict[str, Any], x_TD: torch.Tensor, cfg: MoEConfig,
                 state: dict[str, Any] | None = None, seq_len: int | None = None,
                 remat: bool | None = None, *, check: bool = True, tp: CommGroup | None = None,
                 shard: TokenShard | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, MoERoute]:
    """Route and permute: return (x_RD, probs_TK, probs_R, loss, route).

    x_RD: token rows in the expert-sorted layout; probs_TK: gate weights [T, K] to apply at combine
    (None when cfg.probs_in_expert); probs_R: the gate weight of each layout row [R] when
    cfg.probs_in_expert (else None); loss: differentiable balancing loss; route: the `MoERoute`
    metadata. `remat` overrides the adaptive-remat decision. `check`, `tp`, `shard`: as in `plan_route`.
    """
    probs_TK, loss, meta = plan_route(params, x_TD, cfg, state, seq_len, remat, check=check, tp=tp,
                                      shard=shard)
    x_RD = permute(x_TD, meta.layout)
    if cfg.probs_in_expert:
        return x_RD, None, permute_probs(probs_TK, meta.layout), loss, meta
    return x_RD, probs_TK, None, loss, meta


def uses_token_dispatch(dispatcher: Any, cfg: MoEConfig) -> bool:
    """True when `moe` hands whole tokens to the dispatcher (its token-level Exchange), as the dispatcher
    declares (fmoe.dispatch.exchange.Exchange.token_level).

    A token-level dispatcher does permute-1, unpermute and the gate weighting itself, which lets the
    hierarchical one send a token to a node once however many of its experts live there. It applies to
    dropless routing with gate weights at combine; other modes use the row-level seam.
    """
    return as_exchange(dispatcher).token_level(cfg)


def dispatch_rows(x_RD: torch.Tensor, probs_R: torch.Tensor | None, route: MoERoute,
                  dispatcher: Dispatcher) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Send layout rows (and their gate weights probs_R, if any) to the experts.

    Returns (x_MD, probs_M or None, (counts_L, meta)): rows grouped by local expert, their gate weights,
    the rows per local expert (python ints when known on the host) and the dispatcher's meta.
    """
    x_MD, counts_L, probs_M, meta = dispatcher.dispatch(x_RD, route.layout.counts_E, probs_R)
    # Unchanged counts of a padded layout are known on the host too: hand both forms on (no sync, and no
    # upload of host ints for the grouped GEMM's offsets on a device).
    if counts_L is route.layout.counts_E and route.layout.counts is not None:
        counts_L = Counts(route.layout.counts, route.layout.counts_E)
    return x_MD, probs_M, (counts_L, meta)


def expert_rows(experts: dict[str, torch.Tensor], x_MD: torch.Tensor, probs_M: torch.Tensor | None,
                counts_L: Any, cfg: MoEConfig, remat: bool = False, *, check: bool = True) -> torch.Tensor:
    """Run the routed experts on rows grouped by local expert: return y_MD [M, D].

    Under `fmoe.transforms.remat` with the policy `expert_policy(remat)` (nothing saved when `remat`).
    `check`: check `experts` against `cfg` first ([L, D, F] with L = len(counts_L)).
    """
    if check:
        check_moe({"experts": experts}, cfg, num_local_experts=len(counts_L), paths=[("experts",)])
    fn = experts_of(cfg)  # cfg.experts (fmoe/seams.py)
    # the rows are the dispatcher's, read by nothing after the experts' backward: fmoe's own experts take
    # them over (a user's function is handed nothing it did not ask for); not under remat, whose recompute
    # reads them again in a backward that keeps its graph
    own = {"donate": True} if fn is routed_experts and not remat else {}

    def run(p: dict[str, torch.Tensor], x_MD: torch.Tensor, probs_M: torch.Tensor | None) -> torch.Tensor:
        return fn(p, x_MD, counts_L, probs_M, cfg.backend, **own)

    return transforms.remat(run, policy=expert_policy(remat))(experts, x_MD, probs_M)


def combine_rows(y_RD: torch.Tensor, probs_TK: torch.Tensor | None, route: MoERoute, *,
                 donate: bool = False) -> torch.Tensor:
    """Back to token order: return y_TD [T, D], the sum over the K slots, weighted by probs_TK unless
    it is None (gate weights already applied inside the experts). `donate`: y_RD is handed over
    (`fmoe.ops.unpermute`'s donate: not to be read after the backward)."""
    return unpermute(y_RD, probs_TK, route.layout, donate=donate)


def make_aux(loss: torch.Tensor, route: MoERoute, new_state: dict[str, torch.Tensor]) -> MoEAux:
    """Assemble the `MoEAux` of a layer from its differentiable loss, routing metadata and next state
    (fmoe.gpt_state.update_gpt_state's, or `update_moe_state`'s for one layer)."""
    return MoEAux(loss=loss, losses=dict(route.losses), tokens_per_expert_E=route.tokens_per_expert_E,
                  dropped=route.dropped, new_state=new_state, remat=route.remat,
                  capacity=route.capacity, capacity_missed=route.capacity_missed)
