"""The block's phases (fmoe.block: attention, experts, finish) fed inputs that do not belong together fail
in one line instead of returning a silently wrong h_BSD: another microbatch's route, gate weights that
would be applied twice or never, a shared-expert output that would broadcast.

Legend (docs/moe.md): B sequences, S positions, T = B * S tokens, D model width, K top-k slots, R layout
rows, M rows the experts receive.
"""

from __future__ import annotations

import re

import pytest
import torch

from fmoe._compat import tree_map
from fmoe.block import attention, experts, finish, init_block
from fmoe.config import GPTConfig, MoEConfig
from fmoe.dispatch.local import LocalDispatcher
from fmoe.layer import dispatch_rows
from fmoe.ops import permute_probs

D = 8


def _cfg(**kw) -> GPTConfig:
    moe = MoEConfig(d_model=D, d_ff=8, num_experts=4, top_k=2, **kw)
    return GPTConfig(vocab_size=16, d_model=D, n_layers=1, n_heads=2, n_kv_heads=1, moe=moe)


def _params(cfg: GPTConfig) -> dict:
    return tree_map(lambda t: t.to(torch.float64), init_block(cfg, torch.Generator().manual_seed(0)))


def _dispatched(cfg: GPTConfig, params: dict, B: int = 2, S: int = 3, keep_probs_r: bool = False):
    """attention, then the local dispatch, as `block` runs them: returns (acts, route, counts_L, combine)."""
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(B * S), dtype=torch.float64)
    acts, route = attention(params, x, cfg)
    acts.pop("loss")
    d = LocalDispatcher(cfg.moe.num_experts)
    probs_R = acts.get("probs_R") if keep_probs_r else acts.pop("probs_R", None)
    x_MD, probs_M, (counts_L, meta) = dispatch_rows(acts.pop("rows_RD"), None if keep_probs_r else probs_R,
                                                    route, d)
    acts["rows_MD"] = x_MD
    if probs_M is not None:
        acts["probs_M"] = probs_M
    return acts, route, counts_L, lambda y_MD: d.combine(y_MD, meta)


def _through_experts(cfg: GPTConfig, params: dict, B: int = 2, S: int = 3) -> tuple[dict, object]:
    acts, route, counts_L, combine = _dispatched(cfg, params, B, S)
    out = experts(params["moe"], acts, counts_L, cfg)
    out["rows_RD"] = combine(out.pop("rows_MD"))
    return out, route


@pytest.mark.parametrize("in_expert", [False, True])
def test_finish_refuses_the_route_of_a_microbatch_with_other_tokens(in_expert: bool) -> None:
    cfg = _cfg(probs_in_expert=in_expert)
    params = _params(cfg)
    acts, _ = _through_experts(cfg, params, B=2, S=3)
    _, other = _through_experts(cfg, params, B=1, S=3)
    with pytest.raises(ValueError, match=re.escape("finish: acts hold 6 tokens (residual_BSD [2, 3, 8]) but "
                                                   "the route is for 3 tokens")):
        finish(acts, other)


def test_gate_weights_applied_in_the_experts_and_again_at_finish_are_refused() -> None:
    cfg = _cfg()  # gate weights at finish (probs_TK)
    params = _params(cfg)
    acts, route, counts_L, _ = _dispatched(cfg, params)
    acts["probs_M"] = permute_probs(acts["probs_TK"], route.layout)  # as if they also travelled
    with pytest.raises(ValueError, match=r"experts: acts hold both probs_M .* and probs_TK .* twice"):
        experts(params["moe"], acts, counts_L, cfg)


def test_gate_weights_left_behind_at_the_dispatch_are_refused() -> None:
    cfg = _cfg(probs_in_expert=True)
    params = _params(cfg)
    acts, _, counts_L, _ = _dispatched(cfg, params, keep_probs_r=True)  # probs_R never sent with the rows
    with pytest.raises(ValueError, match=r"experts: acts\['probs_R'\] .* never applied"):
        experts(params["moe"], acts, counts_L, cfg)


def test_gate_weights_of_other_rows_are_refused() -> None:
    cfg = _cfg(probs_in_expert=True)
    params = _params(cfg)
    acts, _, counts_L, _ = _dispatched(cfg, params)
    acts["probs_M"] = acts["probs_M"][:1]  # would broadcast over every row
    with pytest.raises(ValueError, match=re.escape("experts: acts['probs_M'] has shape [1] but "
                                                   "acts['rows_MD'] has 12 rows")):
        experts(params["moe"], acts, counts_L, cfg)


def test_finish_refuses_a_shared_output_that_would_broadcast() -> None:
    cfg = _cfg()
    params = _params(cfg)
    acts, route = _through_experts(cfg, params)
    acts["shared_TD"] = torch.ones(1, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape("finish: acts['shared_TD'] has shape [1, 8], expected "
                                                   "[6, 8]")):
        finish(acts, route)


def test_finish_refuses_combined_tokens_with_gate_weights_still_unapplied() -> None:
    cfg = _cfg()
    params = _params(cfg)
    acts, route = _through_experts(cfg, params)
    acts["y_TD"] = torch.zeros(6, D, dtype=torch.float64)  # a token-level combine, but probs_TK stayed
    del acts["rows_RD"]
    with pytest.raises(ValueError, match=r"finish: acts hold both y_TD .* and probs_TK"):
        finish(acts, route)
