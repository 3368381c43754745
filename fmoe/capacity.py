"""Expert capacity: dropless, capacity-factor drop (policy probs / position), drop-and-pad, and dynamic
capacity from a sliding-window forecast.

    layout, info = make_layout(ids_TK, probs_TK, cfg, state)

Legend (the package's, docs/moe.md): T tokens, K top-k slots, N = T * K (token, slot) pairs, E experts,
C capacity (rows per expert), R layout rows, W forecast window (steps).

Host syncs, by mode: dropless none here (grouped_linear reads counts once); capacity drop without
padding reads the number of kept pairs (it sizes the layout); drop-and-pad none (static shapes
R = E * C, counts known on the host); dynamic capacity reads one "fits" flag per step and the true
maximum load only on a miss, plus the forecast from the window.

Dynamic capacity across ranks (seed 002): inside `capacity_agreement(agree)` every dynamic layout asks
`agree(max_load, forecast) -> (capacity, missed)` instead of deciding alone, so the ranks that exchange
tokens pad to one capacity: each checks its own load against the forecast, they agree on that flag (one
small all-reduce), and only on a miss all-reduce the maximum load
(fmoe.parallel.capacity_agreement.CapacityAgreement). The forecast is the same on those ranks because
the window is updated with the step's load reduced over them. A context rather than an argument because
the layout is made deep inside the router's phase (fmoe/block.py, fmoe/phases.py), which does
not see the process groups; outside one, each process decides alone as before.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from einops import rearrange

from fmoe._compat import assume_constant
from fmoe._index import exclusive_cumsum
from fmoe.config import MoEConfig
from fmoe.ops import Layout, expert_counts, sort_layout, traced


@dataclass(frozen=True)
class CapacityInfo:
    """What the capacity step did.

    capacity: C (None when dropless without padding); dropped: int64 scalar tensor, pairs dropped;
    missed: for dynamic capacity, whether the forecast was too small this step (else None). The window
    moves once per step, from the step's loads (fmoe.layer.update_moe_state), not here.
    """

    capacity: int | None
    dropped: torch.Tensor
    missed: bool | None


def _decimal(factor: float) -> Fraction:
    # The factor as written (1.1 is 11/10), not its binary double (1.1000000000000000888...): in float,
    # ceil(1.1 * 100) is 111, one row more than the documented capacity.
    return Fraction(repr(factor))


@assume_constant  # Fraction arithmetic: compile takes the int, it cannot trace it
def capacity_for(cfg: MoEConfig, num_tokens: int) -> int:
    """Return C = ceil(capacity_factor * T * K / E) for a capacity-factor config (exact rational math)."""
    if cfg.capacity_factor is None:
        raise ValueError("capacity_for: the config is dropless (capacity_factor is None)")
    return math.ceil(_decimal(cfg.capacity_factor) * num_tokens * cfg.top_k / cfg.num_experts)


def drop_layout(ids_TK: torch.Tensor, probs_TK: torch.Tensor, num_experts: int, capacity: int,
                policy: str = "probs", pad: bool = False) -> tuple[Layout, torch.Tensor]:
    """Return (layout, dropped): each expert keeps at most `capacity` pairs; dropped is an int64 scalar.

    policy "probs" keeps an expert's pairs with the highest gate weights, "position" its earliest
    pairs (token order). Kept rows are in token order within each expert. `pad` gives every expert
    exactly `capacity` rows (R = E * C, padding rows at the end of each expert's block).
    """
    T, K = ids_TK.shape
    N, E, C = T * K, num_experts, capacity
    dev = ids_TK.device
    ids_N = rearrange(ids_TK, "t k -> (t k)")  # pair n = t * K + k
    if policy == "probs":
        by_prob_N = torch.sort(-rearrange(probs_TK.detach(), "t k -> (t k)"), stable=True).indices
        order_N = by_prob_N[torch.sort(ids_N[by_prob_N], stable=True).indices]
    elif policy == "position":
        order_N = torch.sort(ids_N, stable=True).indices
    else:
        raise ValueError(f"drop_layout: policy must be 'probs' or 'position', got {policy!r}")
    counts_E = expert_counts(ids_N, E)
    starts_E = exclusive_cumsum(counts_E)
    rank_N = torch.arange(N, device=dev) - starts_E[ids_N[order_N]]
    # Scatters out of place (here and below): torch.func.vmap batches them, not index_put_ into an
    # unbatched buffer.
    keep_N = torch.empty(N, dtype=torch.bool, device=dev).scatter(0, order_N, rank_N < C)
    dropped = N - keep_N.sum()

    # Kept pairs sorted by expert in token order; dropped pairs get key E and go last.
    key_N = torch.where(keep_N, ids_N, torch.full_like(ids_N, E))
    order2_N = torch.sort(key_N, stable=True).indices
    kept_E1 = expert_counts(key_N, E + 1)
    kept_E = kept_E1[:E]
    arange_N = torch.arange(N, device=dev)
    if pad:
        R = E * C
        key_sorted_N = key_N[order2_N]
        starts_E1 = exclusive_cumsum(kept_E1)
        pos_N = arange_N - starts_E1[key_sorted_N]
        dst_sorted_N = torch.where(key_sorted_N < E, key_sorted_N * C + pos_N, torch.full_like(pos_N, R))
        rows_E = torch.full((E,), C, dtype=torch.int64, device=dev)
        counts = (C,) * E
    elif traced():
        # Under vmap / compile the layout keeps a static size, R = N: the dropped pairs' rows stay at the
        # end as zero rows (source: the zero row) in the last expert's block, whose outputs no token reads
        # (their pairs point at the zero row R); their dw terms are 0 (zero input, zero cotangent).
        R = N
        kept = kept_E.sum()
        dst_sorted_N = torch.where(arange_N < kept, arange_N, torch.full_like(arange_N, R))
        rows_E = kept_E + torch.nn.functional.pad((N - kept).reshape(1), (E - 1, 0))
        counts = None
    else:
        R = int(kept_E.sum())  # host sync: the layout's size depends on the data
        dst_sorted_N = torch.where(arange_N < R, arange_N, torch.full_like(arange_N, R))
        rows_E, counts = kept_E, None
    row_dst_N = torch.empty_like(ids_N).scatter(0, order2_N, dst_sorted_N)
    # Padding rows read pair N (the zero row); the extra slot R absorbs the writes of dropped pairs.
    row_src_R1 = torch.full((R + 1,), N, dtype=torch.int64, device=dev).scatter(0, dst_sorted_N, order2_N)
    row_src_R = row_src_R1[:R]
    layout = Layout(row_src_R=row_src_R, row_dst_N=row_dst_N, tok_R=row_src_R // K, counts_E=rows_E,
                    counts=counts, num_tokens=T, top_k=K)
    return layout, dropped


def init_capacity_state(cfg: MoEConfig, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Return the dynamic-capacity state: {"load_history_W": zeros [W], "capacity_misses": 0,
    "capacity_steps": 0} (int64), or {} when dynamic capacity is off."""
    W = cfg.dynamic_capacity_window
    if not W:
        return {}
    z = torch.zeros((), dtype=torch.int64, device=device)
    return {"load_history_W": torch.zeros(W, dtype=torch.int64, device=device), "capacity_misses": z,
            "capacity_steps": z.clone()}


def forecast_capacity(history_W: torch.Tensor, margin: float = 1.0) -> int:
    """Return ceil(margin * max(history_W)): the capacity predicted for the next step (one host read)."""
    return math.ceil(_decimal(margin) * int(history_W.max())) if history_W.numel() else 0


Agree = Callable[[torch.Tensor, int], tuple[int, bool]]  # (max_load, forecast) -> (capacity, missed)
_AGREE: ContextVar[Agree | None] = ContextVar("fmoe_capacity_agreement", default=None)


@contextlib.contextmanager
def capacity_agreement(agree: Agree | None) -> Iterator[None]:
    """Within the block, dynamic-capacity layouts take their capacity from `agree(max_load, forecast)`
    (None: each process decides alone). Returns a context manager."""
    token = _AGREE.set(agree)
    try:
        yield
    finally:
        _AGREE.reset(token)


def _decide(max_load: torch.Tensor, forecast: int) -> tuple[int, bool]:
    """(capacity, missed) of one process alone: the forecast if it fits, else the true maximum."""
    fits = bool(max_load <= forecast)  # the cheap flag; the true maximum is read only on a miss
    return (forecast, False) if fits else (int(max_load), True)


def make_layout(ids_TK: torch.Tensor, probs_TK: torch.Tensor, cfg: MoEConfig,
                state: dict[str, Any] | None = None,
                counts_E: torch.Tensor | None = None) -> tuple[Layout, CapacityInfo]:
    """Return (layout, info) for the capacity mode of `cfg` (see the module docstring for host syncs).
    `counts_E`: the router's pairs per expert (bincount of ids_TK), reused by the dropless layout."""
    T, K = ids_TK.shape
    E = cfg.num_experts
    zero = torch.zeros((), dtype=torch.int64, device=ids_TK.device)
    if cfg.dynamic_capacity_window:
        cap_state = {k: v for k, v in (state or {}).items() if k in ("load_history_W", "capacity_misses",
                                                                      "capacity_steps")}
        if not cap_state:
            cap_state = init_capacity_state(cfg, ids_TK.device)
        if set(cap_state) != {"load_history_W", "capacity_misses", "capacity_steps"} or (
                cap_state["load_history_W"].shape != (cfg.dynamic_capacity_window,)):
            raise ValueError("make_layout: dynamic-capacity state must hold load_history_W "
                             f"[{cfg.dynamic_capacity_window}], capacity_misses and capacity_steps "
                             f"(fmoe.init_moe_state), got {sorted(cap_state)}")
        counts_E = expert_counts(ids_TK, E)
        max_load = counts_E.max() if counts_E.numel() else zero
        forecast = forecast_capacity(cap_state["load_history_W"], cfg.dynamic_capacity_margin)
        C, missed = (_AGREE.get() or _decide)(max_load, forecast)
        layout, dropped = drop_layout(ids_TK, probs_TK, E, C, "position", pad=True)
        return layout, CapacityInfo(capacity=C, dropped=dropped, missed=missed)
    if cfg.capacity_factor is None:
        return sort_layout(ids_TK, E, counts_E), CapacityInfo(capacity=None, dropped=zero, missed=None)
    C = capacity_for(cfg, T)
    layout, dropped = drop_layout(ids_TK, probs_TK, E, C, cfg.drop_policy, cfg.pad_to_capacity)
    return layout, CapacityInfo(capacity=C, dropped=dropped, missed=None)
