"""The model's replaceable functions: the router, the routed experts and the core attention.

    cfg = MoEConfig(..., router=my_router)                   # a function...
    cfg = MoEConfig(..., router="mypkg.routers:expert_choice")  # ...or its import path (serialisable)
    r = router_of(cfg)(params["router"], x_TD, cfg, state, seq_len)

Legend (the package's, docs/moe.md): T tokens, D model width, E experts, L local experts, K top-k slots,
M rows grouped by local expert, B sequences, S positions, H query heads, G kv heads, d head dim.

Each seam is a field of the config (MoEConfig.router, MoEConfig.experts, GPTConfig.attention) holding
None (today's function), a callable, or a "module:attribute" import path. The model reads them through
`router_of` / `experts_of` / `attention_of` only, so `moe`, `block`, `gpt_loss` and the pipeline phases
all call the one the config carries, on every rank that builds the config, with no global to patch.
An import path keeps the config plain data: checkpoints record it, `fmoe train --router` passes it,
and the ranks compare it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fmoe.experts import routed_experts
from fmoe.import_path import load
from fmoe.ops import attention, expert_counts
from fmoe.router import Routing, route

if TYPE_CHECKING:
    from fmoe.config import GPTConfig, MoEConfig


class Router(Protocol):
    """Route T tokens to K of E experts (default: `fmoe.router.route`).

    params: the layer's router params {"w": [D, E]} (fmoe.router.init_router; the structure checks hold
    a custom router to that layout). x_TD: the normed tokens [T, D] (any float dtype). cfg: the layer's
    MoEConfig (K = cfg.top_k, E = cfg.num_experts, the loss coefficients). state: the layer's state,
    read only (e.g. "expert_bias_E"; the layer computes the next state from the returned load).
    seq_len: tokens per sequence (T = B * seq_len) for sequence-wise losses, None = one sequence.
    Returns a `fmoe.router.Routing`: ids_TK int64 [T, K] (each token's experts; a slot whose gate weight
    is 0 still costs a row), probs_TK float [T, K] gate weights (differentiable), counts_E int64 [E] the
    (token, slot) pairs per expert (fmoe.ops.expert_counts(ids_TK, E)), losses {"aux", "seq_aux", "z"} and
    loss, their differentiable sum (an exact 0 on the graph, fmoe.balance.graph_zero, when none).
    Must not sync with the host or change shapes with the data beyond [T, K], so a pipeline can run it.
    """

    def __call__(self, params: dict[str, torch.Tensor], x_TD: torch.Tensor, cfg: MoEConfig,
                 state: dict[str, Any] | None = None, seq_len: int | None = None) -> Routing: ...


class Experts(Protocol):
    """The routed experts on rows grouped by local expert (default: `fmoe.experts.routed_experts`).

    p: {"w_gate_up": [L, D, 2F] (gate | up), "w_down": [L, F, D]} (fmoe.experts.init_experts's layout);
    x_MD: rows [M, D], counts_L[l] consecutive rows for local expert l (a tensor, host ints or
    fmoe.ops.Counts); probs_M: gate weight [M] per row to apply inside the expert, or None (applied at
    combine); backend: cfg.backend for grouped_linear. Returns y_MD [M, D].
    """

    def __call__(self, p: dict[str, torch.Tensor], x_MD: torch.Tensor, counts_L: Any,
                 probs_M: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor: ...


class Attention(Protocol):
    """The core attention of a block (default: `fmoe.ops.attention`).

    q_BSHd [B, S, H, d], k_BSGd and v_BSGd [B, S, G, d] (G divides H; before RoPE: the function applies
    it with `rope_theta`); `causal`: mask future keys. Returns o_BSHd [B, S, H, d]. The projections, norms
    and residual around it stay the block's.
    """

    def __call__(self, q_BSHd: torch.Tensor, k_BSGd: torch.Tensor, v_BSGd: torch.Tensor, *,
                 rope_theta: float, causal: bool) -> torch.Tensor: ...


def _resolve(value: Callable[..., Any] | str | None, default: Callable[..., Any]) -> Callable[..., Any]:
    # The one place a seam becomes a function: None is today's, a path is imported once (cached).
    if value is None:
        return default
    return load(value) if isinstance(value, str) else value


def router_of(cfg: MoEConfig) -> Router:
    """The router `cfg` carries (MoEConfig.router; default fmoe.router.route)."""
    return _resolve(cfg.router, route)


def experts_of(cfg: MoEConfig) -> Experts:
    """The routed-experts function `cfg` carries (MoEConfig.experts; default fmoe.experts.routed_experts);
    a user's is wrapped so that an output other than y_MD [M, D] in the rows' dtype is named
    (`check_output`), not met later in the shared expert's sum or `linear`."""
    fn = _resolve(cfg.experts, routed_experts)
    if fn is routed_experts:
        return fn
    name = f"experts {_seam_name(cfg.experts)}"

    def checked(p: dict[str, torch.Tensor], x_MD: torch.Tensor, counts_L: Any, probs_M: torch.Tensor | None,
                backend: str) -> torch.Tensor:
        return check_output(name, "y_MD", fn(p, x_MD, counts_L, probs_M, backend), x_MD.shape, x_MD.dtype)

    return checked


def attention_of(cfg: GPTConfig) -> Attention:
    """The core attention `cfg` carries (GPTConfig.attention; default fmoe.ops.attention); a user's is
    wrapped so that an output other than o_BSHd [B, S, H, d] in q's dtype is named (`check_output`)."""
    fn = _resolve(cfg.attention, attention)
    if fn is attention:
        return fn
    name = f"attention {_seam_name(cfg.attention)}"

    def checked(q_BSHd: torch.Tensor, k_BSGd: torch.Tensor, v_BSGd: torch.Tensor, *, rope_theta: float,
                causal: bool) -> torch.Tensor:
        o = fn(q_BSHd, k_BSGd, v_BSGd, rope_theta=rope_theta, causal=causal)
        return check_output(name, "o_BSHd", o, (*q_BSHd.shape[:3], v_BSGd.shape[-1]), q_BSHd.dtype)

    return checked


def check_output(name: str, what: str, out: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`out` of a user's seam function `name`; TypeError unless a tensor, ValueError naming the shape or
    dtype it should have (structure only: no value is read, so no host sync)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} returned a {type(out).__name__}; it must return {what}, a tensor of shape "
                        f"{list(shape)} and dtype {dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} returned {what} of shape {list(out.shape)}; it must be {list(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"{name} returned {what} of dtype {out.dtype}; it must keep its input's {dtype}")
    return out


def _seam_name(value: Any) -> str:
    """A seam as a user names it: its import path, or the function's qualified name."""
    return repr(value) if isinstance(value, str) else repr(getattr(value, "__qualname__",
                                                                   getattr(value, "__name__", value)))


def _router_name(cfg: MoEConfig) -> str:
    """The router as a user names it: its import path, or the function's qualified name."""
    return _seam_name(cfg.router)


_ROUTING_FIELDS = ("ids_TK", "probs_TK", "counts_E", "losses", "loss")


def check_routing(r: Routing, num_tokens: int, cfg: MoEConfig) -> None:
    """Raise, naming the router, when its `Routing` is not what the layer reads: TypeError for another
    type (a tuple), ValueError for shapes and dtypes other than ids_TK int64 [T, K], probs_TK floating
    [T, K], counts_E [E], or expert ids outside [0, E).

    No host sync on a device: the id range is checked there by a device-side assert
    (`torch._assert_async`, which fails the next synchronising call); on CPU, where a read costs nothing,
    by a plain check that names a wrong id.
    """
    T, K, E = num_tokens, cfg.top_k, cfg.num_experts
    if not all(hasattr(r, f) for f in _ROUTING_FIELDS):  # a tuple in Routing's field order, say
        raise TypeError(f"router {_router_name(cfg)} returned a {type(r).__name__}; it must return a "
                        f"fmoe.router.Routing({', '.join(_ROUTING_FIELDS)})")
    wrong = []
    if r.ids_TK.dtype != torch.int64 or tuple(r.ids_TK.shape) != (T, K):
        wrong.append(f"ids_TK {r.ids_TK.dtype} {list(r.ids_TK.shape)} (want int64 [{T}, {K}])")
    if not r.probs_TK.is_floating_point() or tuple(r.probs_TK.shape) != (T, K):
        wrong.append(f"probs_TK {r.probs_TK.dtype} {list(r.probs_TK.shape)} (want floating [{T}, {K}])")
    if tuple(r.counts_E.shape) != (E,) or r.counts_E.is_floating_point() or r.counts_E.dtype == torch.bool:
        wrong.append(f"counts_E {r.counts_E.dtype} {list(r.counts_E.shape)} (want integer [{E}])")
    if wrong:
        raise ValueError(f"router {_router_name(cfg)} returned {'; '.join(wrong)}")
    ids_TK = r.ids_TK
    if ids_TK.device.type == "meta" or ids_TK.numel() == 0:
        return
    outside = f"router {_router_name(cfg)} returned expert ids outside [0, {E}) (num_experts {E})"
    # what the layer reads besides the ids: the gate weights (NaN spread into every row it scales) and the
    # counts (the rows are grouped by them: counts that disagree with the ids mis-group or index past)
    nan = f"router {_router_name(cfg)} returned gate weights (probs_TK) that are not finite (NaN or inf)"
    miscount = (f"router {_router_name(cfg)} returned counts_E that disagree with its ids_TK: counts_E must "
                "be fmoe.ops.expert_counts(ids_TK, E)")
    if ids_TK.device.type == "cpu":
        bad = (ids_TK < 0) | (ids_TK >= E)
        if bool(bad.any()):
            raise ValueError(f"{outside}: {int(ids_TK[bad][0])} at token {int(bad.nonzero()[0, 0])}")
        if not bool(torch.isfinite(r.probs_TK.detach()).all()):
            raise ValueError(nan)
        if not torch.equal(r.counts_E.long(), expert_counts(ids_TK, E)):
            raise ValueError(f"{miscount}; got {r.counts_E.tolist()}, the ids give "
                             f"{expert_counts(ids_TK, E).tolist()}")
    else:
        torch._assert_async(((ids_TK >= 0) & (ids_TK < E)).all(), outside)
        torch._assert_async(torch.isfinite(r.probs_TK.detach()).all(), nan)
        torch._assert_async((r.counts_E.long() == expert_counts(ids_TK, E)).all(), miscount)
