"""The router against the loop oracle on tie-prone inputs: top-k and group selection break ties the same
way (lowest expert / group index first); bf16 inputs route in fp32.

Legend (docs/moe.md): T tokens, D model width, E experts, K top-k slots, J expert groups.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from moe_oracle import oracle_route

from fmoe.config import MoEConfig
from fmoe.router import route
from fmoe.transforms.testing import assert_close


def test_zero_router_ties_pick_lowest_expert_ids() -> None:
    # Every score equal: the K chosen experts are 0..K-1, best (= lowest index) first, for every E.
    for E, K in [(4, 2), (8, 3), (16, 5), (64, 6)]:
        cfg = MoEConfig(d_model=4, d_ff=4, num_experts=E, top_k=K)
        r = route({"w": torch.zeros(4, E)}, torch.randn(5, 4), cfg)
        assert r.ids_TK.tolist() == [list(range(K))] * 5, (E, K)


def test_partial_ties_and_group_ties_pick_lowest_index() -> None:
    # Scores (a, b, b, b, a, b) with b > a: the K = 2 best are experts 1 and 2.
    cfg = MoEConfig(d_model=2, d_ff=4, num_experts=6, top_k=2)
    w = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, 1.0], [0.0] * 6])
    assert route({"w": w}, torch.ones(3, 2), cfg).ids_TK.tolist() == [[1, 2]] * 3
    # Four groups with equal scores: group 0 is chosen, so experts 0 and 1.
    cfg = MoEConfig(d_model=2, d_ff=4, num_experts=8, top_k=2, num_groups=4, topk_groups=1)
    assert route({"w": torch.zeros(2, 8)}, torch.ones(3, 2), cfg).ids_TK.tolist() == [[0, 1]] * 3


@st.composite
def router_cases(draw):
    J = draw(st.sampled_from([1, 2, 3, 4]))
    per = draw(st.integers(1, 3))
    E = J * per
    topk_groups = draw(st.integers(1, J))
    K = draw(st.integers(1, topk_groups * per))
    cfg = MoEConfig(d_model=4, d_ff=4, num_experts=E, top_k=K, num_groups=J, topk_groups=topk_groups,
                    score_func=draw(st.sampled_from(["softmax", "sigmoid"])),
                    topk_norm=draw(st.sampled_from(["before", "after"])),
                    topk_scale=draw(st.sampled_from([1.0, 2.5])))
    T = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    biased = draw(st.booleans())
    return cfg, T, seed, biased


@settings(max_examples=100, deadline=None)
@example(case=(MoEConfig(d_model=4, d_ff=4, num_experts=8, top_k=3, num_groups=4, topk_groups=2,
                         score_func="sigmoid"), 6, 0, False), dtype=torch.float32)
@given(case=router_cases(),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
def test_route_matches_oracle_on_tie_prone_inputs(case, dtype) -> None:
    """Quantised weights and inputs (logits are multiples of 0.5, biases of 0.25) make exact ties common
    in scores and group scores; selection must equal the oracle's python `sorted` (lowest index first)."""
    cfg, T, seed, biased = case
    g = torch.Generator().manual_seed(seed)
    w_DE = torch.randint(0, 2, (4, cfg.num_experts), generator=g).double() * 0.5
    x_TD = torch.randint(0, 2, (T, 4), generator=g).double()
    state = {}
    if biased:
        # One bias per group when groups are limited: a bias that differs inside a group could cancel in a
        # group score ((s + 0.25) + (s' - 0.25) vs s + s'), a tie in exact math that rounding breaks.
        J = cfg.num_groups if cfg.topk_groups < cfg.num_groups else cfg.num_experts
        bias_J = torch.randint(-1, 2, (J,), generator=g).float() * 0.25
        state["expert_bias_E"] = bias_J.repeat_interleave(cfg.num_experts // J)
    r = route({"w": w_DE.to(dtype)}, x_TD.to(dtype), cfg, state)
    bias = state["expert_bias_E"].tolist() if biased else None
    o = oracle_route(w_DE, x_TD, cfg, bias, None)
    assert r.ids_TK.tolist() == o["ids"]
    assert r.counts_E.tolist() == o["counts"]
    probs_o = torch.stack([torch.stack(p) for p in o["probs"]])
    # Routing math is fp32 (fp64 for fp64) and the quantised inputs are exact in bf16: fp32 tolerance.
    assert_close(r.probs_TK.double(), probs_o, dtype=torch.float32 if dtype != torch.float64 else dtype)


def test_bf16_inputs_route_in_fp32() -> None:
    cfg = MoEConfig(d_model=16, d_ff=4, num_experts=8, top_k=2, score_func="sigmoid", aux_loss_coef=0.1,
                    z_loss_coef=0.01)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g).bfloat16()
    x = torch.randn(64, 16, generator=g).bfloat16()
    r16 = route({"w": w}, x, cfg)
    r32 = route({"w": w.float()}, x.float(), cfg)
    assert r16.probs_TK.dtype == torch.float32 and r16.loss.dtype == torch.float32
    assert r16.ids_TK.tolist() == r32.ids_TK.tolist()
    assert torch.equal(r16.probs_TK, r32.probs_TK)
    assert torch.equal(r16.loss, r32.loss)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_bias_selects_but_gate_weights_are_unbiased_with_groups(score_func) -> None:
    # The bias must steer the group choice and the expert choice, never enter the gate weights.
    cfg = MoEConfig(d_model=4, d_ff=4, num_experts=8, top_k=2, num_groups=4, topk_groups=1,
                    score_func=score_func, topk_norm="before", topk_scale=2.0)
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(4, 8, generator=g), torch.randn(5, 4, generator=g)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 9.0])
    r = route({"w": w}, x, cfg, {"expert_bias_E": bias})
    assert sorted(map(sorted, r.ids_TK.tolist())) == [[6, 7]] * 5
    scores = torch.softmax(x @ w, -1) if score_func == "softmax" else torch.sigmoid(x @ w)
    torch.testing.assert_close(r.probs_TK, 2.0 * scores.gather(1, r.ids_TK))
