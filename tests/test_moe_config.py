"""MoEConfig / GPTConfig validation: bad combinations fail at construction with a message naming the field."""

from __future__ import annotations

import pytest

from fmoe.config import GPTConfig, MoEConfig

BASE = dict(d_model=8, d_ff=16, num_experts=4, top_k=2)


@pytest.mark.parametrize("changes, match", [
    (dict(top_k=5), "top_k"),
    (dict(d_model=0), "d_model"),
    (dict(d_ff=-1), "d_ff"),
    (dict(num_experts=0), "num_experts"),
    (dict(top_k=0), "top_k"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(capacity_factor=-1.0), "capacity_factor"),
    (dict(pad_to_capacity=True), "pad_to_capacity"),
    (dict(score_func="relu"), "score_func"),
    (dict(topk_norm="never"), "topk_norm"),
    (dict(drop_policy="random"), "drop_policy"),
    (dict(num_groups=3), "num_groups"),
    (dict(num_groups=2, topk_groups=3), "topk_groups"),
    (dict(num_groups=4, topk_groups=1), "top_k"),
    (dict(aux_loss_coef=-0.1), "aux_loss_coef"),
    (dict(bias_update_rate=-1.0), "bias_update_rate"),
    (dict(dynamic_capacity_window=2, capacity_factor=1.0), "dynamic_capacity_window"),
    (dict(dynamic_capacity_window=-1), "dynamic_capacity_window"),
    (dict(dynamic_capacity_margin=0.5), "dynamic_capacity_margin"),
    (dict(shared_expert_gate=True), "shared_expert_gate"),
    (dict(backend="cuda"), "backend"),
    (dict(remat_load_scale=0.0), "remat_load_scale"),
    (dict(topk_scale=0.0), "topk_scale"),
    (dict(d_model=8.0), "d_model"),
    (dict(top_k=True), "top_k"),
    (dict(num_groups=2, topk_groups=0), "topk_groups"),
    (dict(num_experts=8, top_k=3, num_groups=4, topk_groups=1), "top_k .*topk_groups"),
    (dict(capacity_factor=float("nan")), "capacity_factor"),
    (dict(capacity_factor=float("inf")), "capacity_factor"),
    (dict(capacity_factor="1.0"), "capacity_factor"),
    (dict(capacity_factor=True), "capacity_factor"),
    (dict(pad_to_capacity=True, dynamic_capacity_window=2), "pad_to_capacity"),
    (dict(seq_aux_loss_coef=-0.1), "seq_aux_loss_coef"),
    (dict(z_loss_coef=-0.1), "z_loss_coef"),
    (dict(aux_loss_coef=float("nan")), "aux_loss_coef"),
    (dict(bias_update_rate=float("inf")), "bias_update_rate"),
    (dict(dynamic_capacity_margin=float("nan")), "dynamic_capacity_margin"),
    (dict(dynamic_capacity_window=1.5), "dynamic_capacity_window"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(num_shared_experts=1.5), "num_shared_experts"),
    (dict(topk_scale=float("nan")), "topk_scale"),
    (dict(topk_scale=float("inf")), "topk_scale"),
    (dict(backend="GROUPED_MM"), "backend"),
    (dict(remat_load_scale=float("nan")), "remat_load_scale"),
])
def test_invalid_moe_config(changes, match) -> None:
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**BASE, **changes})


def test_valid_and_frozen() -> None:
    cfg = MoEConfig(**BASE, num_groups=2, topk_groups=1, capacity_factor=1.25, pad_to_capacity=True)
    with pytest.raises(AttributeError):
        cfg.top_k = 1  # type: ignore[misc]
    assert cfg.replace(top_k=1).top_k == 1
    with pytest.raises(ValueError, match="top_k"):
        cfg.replace(top_k=9)


@pytest.mark.parametrize("changes, match", [
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(d_model=16), "d_model"),
    (dict(num_dense_layers=3), "num_dense_layers"),
    (dict(head_dim=3), "head_dim"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(mtp_loss_weight=-1.0), "mtp_loss_weight"),
])
def test_invalid_gpt_config(changes, match) -> None:
    kw = dict(vocab_size=16, d_model=8, n_layers=2, n_heads=2, moe=MoEConfig(**BASE))
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**kw, **changes})
