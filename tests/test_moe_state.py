"""MoE state changes once per step: `update_moe_state` with the step's summed load.

Oracle: with one microbatch, `moe` itself reports the next state (aux.new_state); over a pipeline step of
m microbatches the state after `update_gpt_state` equals `update_moe_state` on the loads `gpt_loss`
reports per microbatch, summed (max and any for dynamic capacity), not m per-call updates.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe import GPTConfig, MoEConfig, gpt_loss, init_gpt, init_gpt_state, init_moe, init_moe_state, moe
from fmoe import schedule as S
from fmoe.layer import update_moe_state
from fmoe.pipeline import cut_gpt, gpt_pipeline_step, gpt_program, split_microbatches, update_gpt_state


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@settings(max_examples=15, deadline=None)
@given(E=st.integers(1, 6), k_frac=st.floats(0, 1), T=st.integers(0, 12), dynamic=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
@example(E=1, k_frac=0.0, T=5, dynamic=True, seed=0)  # one expert
@example(E=4, k_frac=1.0, T=3, dynamic=False, seed=1)  # top-k = E
@example(E=3, k_frac=0.5, T=0, dynamic=True, seed=2)  # no tokens
def test_one_microbatch_update_equals_moe_new_state(E, k_frac, T, dynamic, seed) -> None:
    K = 1 + int(k_frac * (E - 1))
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=E, top_k=K, bias_update_rate=0.01,
                    dynamic_capacity_window=3 if dynamic else 0)
    g = torch.Generator().manual_seed(seed)
    params = init_moe(cfg, g)
    state = init_moe_state(cfg)
    state["expert_bias_E"] = torch.randn(E, generator=g)
    _, aux = moe(params, torch.randn(T, 8, generator=g), cfg, state)
    counts = aux.tokens_per_expert_E
    max_load = counts.max() if counts.numel() else 0
    _assert_state_equal(update_moe_state(state, cfg, counts, max_load, aux.capacity_missed), aux.new_state)


def test_pipeline_step_updates_the_state_once_from_summed_loads() -> None:
    moe_cfg = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2, bias_update_rate=0.05,
                        dynamic_capacity_window=2)
    cfg = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, moe=moe_cfg, mtp=True)
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    state = init_gpt_state(cfg)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 32, (2, 7), generator=g) for _ in range(3)]
    batches = [(s_[:, :-1], s_[:, 1:]) for s_ in seqs]
    step = gpt_pipeline_step(gpt_program(cfg, S.one_f_one_b(1, 3), 0), params, state, batches)
    got = update_gpt_state(cfg, state, step.loads)

    auxes = [gpt_loss(params, ids, t, cfg, state)[1] for ids, t in batches]  # every microbatch: same state
    want_layers = []
    for i, layer_state in enumerate(state["layers"]):
        per_mb = [a.layers[i] for a in auxes]
        counts = sum(a.tokens_per_expert_E for a in per_mb)
        max_load = max(int(a.tokens_per_expert_E.max()) for a in per_mb)
        missed = any(a.capacity_missed for a in per_mb)
        want_layers.append(update_moe_state(layer_state, moe_cfg, counts, max_load, missed))
    for a, b in zip(got["layers"], want_layers):
        _assert_state_equal(a, b)
    mtp = [a.layers[-1] for a in auxes]
    want_mtp = update_moe_state(state["mtp"], moe_cfg, sum(a.tokens_per_expert_E for a in mtp),
                                max(int(a.tokens_per_expert_E.max()) for a in mtp),
                                any(a.capacity_missed for a in mtp))
    _assert_state_equal(got["mtp"], want_mtp)
    assert int(got["layers"][0]["capacity_steps"]) == 1  # one step, not one per microbatch
    # and the bias moved once: not what chaining the per-microbatch new_states gives
    chained = state["layers"][0]
    for a in auxes:
        chained = update_moe_state(chained, moe_cfg, a.layers[0].tokens_per_expert_E,
                                   a.layers[0].tokens_per_expert_E.max(), a.layers[0].capacity_missed)
    assert int(chained["capacity_steps"]) == 3


def test_split_microbatches_and_layout_errors() -> None:
    ids = torch.arange(12).reshape(4, 3)
    parts = split_microbatches(ids, ids + 1, 2)
    assert [tuple(i.shape) for i, _ in parts] == [(2, 3), (2, 3)] and torch.equal(parts[1][0], ids[2:])
    for bad in (3, 0, 5):
        with pytest.raises(ValueError, match="do not split a batch of 4"):
            split_microbatches(ids, ids, bad)
    moe_cfg = MoEConfig(d_model=8, d_ff=8, num_experts=2, top_k=1)
    cfg = GPTConfig(vocab_size=8, d_model=8, n_layers=3, n_heads=2, moe=moe_cfg)
    with pytest.raises(S.ScheduleError, match="cannot give 1 to each of 4"):
        cut_gpt(cfg, S.dualpipev(2, 4).placement)  # 4 chunks for 3 layers
    with pytest.raises(S.ScheduleError, match=r"\(1, 1\)"):
        cut_gpt(cfg, S.one_f_one_b(2, 2).placement, layers=(1, 1))
