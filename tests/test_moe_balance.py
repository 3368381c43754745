"""Balancing: aux losses on hand-computable cases; aux-loss-free bias evens a skewed router over steps.

Legend: T tokens, D model width, E experts, K experts per token.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.balance import aux_loss, seq_aux_loss, update_expert_bias, z_loss
from fmoe.config import MoEConfig
from fmoe.layer import init_moe, init_moe_state
from fmoe.model import moe
from fmoe.router import route


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("E", [1, 3, 4])
def test_uniform_routing_gives_exactly_the_coefficient(score_func, E) -> None:
    # A zero router with K = E: every token picks every expert, scores are uniform.
    cfg = MoEConfig(d_model=4, d_ff=4, num_experts=E, top_k=E, score_func=score_func,
                    aux_loss_coef=0.3, seq_aux_loss_coef=0.7, z_loss_coef=0.2)
    x = torch.randn(6, 4)
    r = route({"w": torch.zeros(4, E)}, x, cfg, seq_len=3)
    assert r.counts_E.tolist() == [6] * E
    assert float(r.losses["aux"]) == pytest.approx(0.3, rel=1e-6)
    assert float(r.losses["seq_aux"]) == pytest.approx(0.7, rel=1e-6)
    lse = math.log(E) if score_func == "softmax" else math.log(E)  # logits are 0 either way
    assert float(r.losses["z"]) == pytest.approx(0.2 * lse ** 2, abs=1e-7)


def test_uniform_counts_direct() -> None:
    probs = torch.full((8, 4), 0.25)
    assert float(aux_loss(probs, torch.tensor([4, 4, 4, 4]), 2, 0.01)) == pytest.approx(0.01)


def test_hand_computed_skewed_case() -> None:
    # Both tokens to expert 0 (K = 1), probs rows (0.8, 0.2) and (0.6, 0.4):
    # f = (1, 0), P = (0.7, 0.3) -> aux = coef * 2 * 0.7.
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]])
    assert float(aux_loss(probs, torch.tensor([2, 0]), 1, 0.5)) == pytest.approx(0.5 * 2 * 0.7)
    # Sequence-wise with two sequences of one token: seq 0 f = (2, 0), P = (0.8, 0.2) -> 1.6; seq 1 -> 1.2.
    ids = torch.tensor([[0], [0]])
    assert float(seq_aux_loss(probs, ids, 1, 1.0)) == pytest.approx((1.6 + 1.2) / 2)
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert float(z_loss(logits, 1.0)) == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2, rel=1e-6)


def test_bias_update_rule() -> None:
    new = update_expert_bias(torch.zeros(4), torch.tensor([10, 2, 2, 2]), 0.1)
    assert new.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    same = update_expert_bias(torch.ones(2), torch.tensor([3, 3]), 0.1)
    assert same.tolist() == [1.0, 1.0]


def test_bias_changes_selection_not_gate_weights() -> None:
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, score_func="sigmoid", bias_update_rate=0.1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 4, generator=g)
    x = torch.randn(10, 8, generator=g)
    biased = route({"w": w}, x, cfg, {"expert_bias_E": torch.tensor([5.0, 0.0, 0.0, 0.0])})
    assert (biased.ids_TK[:, 0] == 0).all()  # the bias forces expert 0 in
    scores = torch.sigmoid(x @ w).gather(1, biased.ids_TK)
    torch.testing.assert_close(biased.probs_TK, scores / scores.sum(-1, keepdim=True))


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_aux_loss_free_balancing_evens_a_skewed_router(score_func) -> None:
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=8, top_k=2, score_func=score_func, bias_update_rate=0.01)
    g = torch.Generator().manual_seed(0)
    params = init_moe(cfg, g)
    params["router"]["w"][0, :2] += 1.5  # feature 0 is constant: experts 0 and 1 favoured by all tokens
    state = init_moe_state(cfg)
    ratios = []
    with torch.no_grad():
        for _ in range(60):
            x = torch.randn(256, 8, generator=g)
            x[:, 0] = 1.0
            _, aux = moe(params, x, cfg, state)
            ratios.append(float(aux.max_over_mean))
            state = aux.new_state
    first, last = sum(ratios[:3]) / 3, sum(ratios[-10:]) / 10
    assert first > 2.4
    assert last < 1.5 and last < 0.6 * first
    # The router weight was never touched: only the bias moved, and it favours the starved experts.
    bias = state["expert_bias_E"]
    assert bias[:2].max() < bias[2:].min()


@pytest.mark.parametrize("state", [None, {}])
def test_bias_state_starts_at_zero_when_missing(state) -> None:
    # A caller that passes an empty state must still get the expert bias back (else balancing silently stops).
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=1, bias_update_rate=0.5)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    params["router"]["w"].zero_()
    params["router"]["w"][0, 0] = 5.0  # feature 0 = 1: every token on expert 0
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1.0
    _, aux = moe(params, x, cfg, state)
    assert aux.tokens_per_expert_E.tolist() == [8, 0, 0, 0]
    assert aux.new_state["expert_bias_E"].tolist() == [-0.5, 0.5, 0.5, 0.5]


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 12), where=st.integers(0, 10**6), bad=st.sampled_from(["nan", "inf", "-inf"]),
       coefs=st.tuples(*[st.sampled_from([0.0, 0.1])] * 3),
       score_func=st.sampled_from(["softmax", "sigmoid"]))
@example(T=6, where=0, bad="nan", coefs=(0.0, 0.0, 0.0), score_func="softmax")  # used to give aux.loss NaN
@example(T=6, where=3, bad="nan", coefs=(0.1, 0.0, 0.0), score_func="sigmoid")
def test_a_switched_off_loss_is_exactly_zero_whatever_the_tokens(T, where, bad, coefs, score_func) -> None:
    # One non-finite token: a loss with coefficient 0 is an exact 0, not 0 * (a function of the data).
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, score_func=score_func,
                    aux_loss_coef=coefs[0], seq_aux_loss_coef=coefs[1], z_loss_coef=coefs[2])
    g = torch.Generator().manual_seed(T)
    params = init_moe(cfg, g)
    x = torch.randn(T, 8, generator=g)
    x[where % T, where % 8] = float(bad)
    _, aux = moe(params, x, cfg, seq_len=T)
    for name, coef in zip(("aux", "seq_aux", "z"), coefs):
        if not coef:
            assert aux.losses[name].item() == 0.0, name
    if not any(coefs):
        assert aux.loss.item() == 0.0
        w = params["router"]["w"].clone().requires_grad_()
        loss = route({"w": w}, x, cfg, seq_len=T).loss
        assert loss.requires_grad  # still on the router's graph (differentiable, gradient 0 for finite x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_balance_functions_with_coefficient_zero_do_not_read_the_data(bad) -> None:
    probs = torch.full((4, 4), 0.25)
    probs[1, 2] = bad
    logits = torch.zeros(4, 4)
    logits[0, 0] = bad
    ids = torch.tensor([[0], [1], [2], [3]])
    counts = torch.ones(4, dtype=torch.int64)
    assert aux_loss(probs, counts, 1, 0.0).item() == 0.0
    assert seq_aux_loss(probs, ids, 2, 0.0).item() == 0.0
    assert z_loss(logits, 0.0).item() == 0.0
    assert not math.isfinite(aux_loss(probs, counts, 1, 0.1).item())  # a coefficient > 0 does read it
    with pytest.raises(ValueError, match="seq_aux_loss"):
        seq_aux_loss(probs, ids, 0, 0.1)  # used to raise ZeroDivisionError
