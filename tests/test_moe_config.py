"""MoEConfig / GPTConfig validation: bad combinations fail at construction with a message naming the field;
numeric fields are normalised to Python numbers (numpy scalars included), bool fields must be bools."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.capacity import capacity_for
from fmoe.config import GPTConfig, MoEConfig
from fmoe.layer import init_moe
from fmoe.model import moe

BASE = dict(d_model=8, d_ff=16, num_experts=4, top_k=2)
GPT_BASE = dict(vocab_size=16, d_model=8, n_layers=2, n_heads=2)

# Every numeric and bool field, with a valid value that is not its default (for the type tests below).
MOE_INTS = {"d_model": 8, "d_ff": 16, "num_experts": 4, "top_k": 2, "num_groups": 2, "topk_groups": 2,
            "dynamic_capacity_window": 3, "num_shared_experts": 1}
MOE_REALS = {"topk_scale": 2.5, "aux_loss_coef": 0.01, "seq_aux_loss_coef": 0.02, "z_loss_coef": 0.001,
             "bias_update_rate": 0.1, "capacity_factor": 1.1, "dynamic_capacity_margin": 1.5,
             "remat_load_scale": 3.0}
MOE_FLAGS = ("pad_to_capacity", "shared_expert_gate", "probs_in_expert", "adaptive_remat")
GPT_INTS = {"vocab_size": 16, "d_model": 8, "n_layers": 3, "n_heads": 2, "n_kv_heads": 1, "head_dim": 4,
            "d_ff_dense": 24, "num_dense_layers": 1}
GPT_REALS = {"rope_theta": 500.0, "norm_eps": 1e-5, "mtp_loss_weight": 0.5}
GPT_FLAGS = ("mtp",)


def _moe_kw(name: str, value) -> dict:
    """BASE with field `name` = value, plus what the field needs to be legal."""
    kw = {**BASE, name: value}
    if name == "pad_to_capacity":
        kw["capacity_factor"] = 1.0
    if name == "shared_expert_gate":
        kw["num_shared_experts"] = 1
    if name == "topk_groups":
        kw["num_groups"] = 2
    return kw


def _gpt(name: str, value) -> GPTConfig:
    return GPTConfig(**{**GPT_BASE, "moe": MoEConfig(**BASE), name: value})


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


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(MOE_INTS) + sorted(MOE_REALS)), wrap=st.sampled_from(
    ["np.float64", "np.float32", "np.int", "fraction", "int"]))
@example(name="capacity_factor", wrap="np.float64")  # used to crash in capacity: Fraction('np.float64(1.1)')
@example(name="top_k", wrap="np.int")
def test_moe_numbers_of_any_real_type_become_python_numbers(name: str, wrap: str) -> None:
    value = MOE_INTS.get(name, MOE_REALS.get(name))
    if name in MOE_INTS:
        wrapped = {"np.int": np.int64(value), "int": value}.get(wrap)
        if wrapped is None:  # a float for an int field is refused, whatever its type
            with pytest.raises(ValueError, match=f"MoEConfig.{name} must be an int"):
                MoEConfig(**_moe_kw(name, np.float64(value) if wrap.startswith("np.f") else float(value)))
            return
        cfg = MoEConfig(**_moe_kw(name, wrapped))
        assert type(getattr(cfg, name)) is int and getattr(cfg, name) == value
        assert cfg == MoEConfig(**_moe_kw(name, value))
        return
    wrapped = {"np.float64": np.float64(value), "np.float32": np.float32(value),
               "fraction": Fraction(str(value)), "np.int": np.int64(math.ceil(value)),
               "int": math.ceil(value)}[wrap]
    cfg = MoEConfig(**_moe_kw(name, wrapped))
    assert type(getattr(cfg, name)) is float and getattr(cfg, name) == float(wrapped)
    if wrap in ("np.float64", "fraction"):
        assert cfg == MoEConfig(**_moe_kw(name, value))
    # and the layer runs with it (capacity sizing included)
    y, _ = moe(init_moe(cfg, torch.Generator().manual_seed(0)), torch.randn(6, 8), cfg)
    assert y.shape == (6, 8)
    if name == "capacity_factor":
        assert capacity_for(cfg, 100) == math.ceil(Fraction(repr(float(wrapped))) * 100 * 2 / 4)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(MOE_FLAGS)),
       bad=st.sampled_from(["False", "True", "", 0, 1, None, np.bool_(False), np.bool_(True), 0.0]))
@example(name="pad_to_capacity", bad="False")  # "False" is truthy: this used to turn padding on
def test_moe_flags_must_be_bools(name: str, bad) -> None:
    with pytest.raises(ValueError, match=f"MoEConfig.{name} must be a bool"):
        MoEConfig(**_moe_kw(name, bad))
    for ok in (True, False):
        assert getattr(MoEConfig(**_moe_kw(name, ok)), name) is ok


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(MOE_INTS) + sorted(MOE_REALS)),
       bad=st.sampled_from([True, False, "1", None, float("nan"), float("inf"), -float("inf"), np.nan,
                            np.bool_(True), [1], 1 + 0j]))
@example(name="aux_loss_coef", bad=float("nan"))
def test_moe_numbers_refuse_bools_strings_and_non_finite(name: str, bad) -> None:
    if bad is None and name == "capacity_factor":
        return  # None = dropless: valid
    with pytest.raises(ValueError, match=f"MoEConfig.{name}"):
        MoEConfig(**_moe_kw(name, bad))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(GPT_INTS) + sorted(GPT_REALS)), wrap=st.sampled_from(["np", "py"]))
def test_gpt_numbers_of_any_real_type_become_python_numbers(name: str, wrap: str) -> None:
    value = GPT_INTS.get(name, GPT_REALS.get(name))
    kind = int if name in GPT_INTS else float
    wrapped = (np.int64(value) if kind is int else np.float64(value)) if wrap == "np" else value
    cfg = _gpt(name, wrapped)
    assert type(getattr(cfg, name)) is kind and cfg == _gpt(name, value)


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(sorted(GPT_INTS) + sorted(GPT_REALS)),
       bad=st.sampled_from([True, False, "1", float("nan"), float("inf"), -float("inf"), -1, np.bool_(True)]))
@example(name="rope_theta", bad=float("nan"))  # turned RoPE into NaN (and its gradients) silently
@example(name="mtp_loss_weight", bad=float("nan"))
def test_gpt_numbers_refuse_bools_strings_negatives_and_non_finite(name: str, bad) -> None:
    with pytest.raises(ValueError, match=f"GPTConfig.{name}"):
        _gpt(name, bad)


@pytest.mark.parametrize("name", sorted(GPT_INTS))
@pytest.mark.parametrize("bad", [2.0, 16.0, np.float64(2.0)])
def test_gpt_int_fields_refuse_floats(name: str, bad) -> None:
    # n_layers=2.0 and vocab_size=16.0 used to pass (range(2.0) then fails deep in init)
    with pytest.raises(ValueError, match=f"GPTConfig.{name} must be an int"):
        _gpt(name, bad)


@pytest.mark.parametrize("bad", [0, 0.0, -1e-9])
def test_gpt_rope_theta_must_be_positive(bad) -> None:  # 0 made every RoPE angle NaN or 0
    with pytest.raises(ValueError, match="GPTConfig.rope_theta must be > 0"):
        _gpt("rope_theta", bad)


@pytest.mark.parametrize("bad", ["False", "", 0, 1, None, np.bool_(True)])
def test_gpt_mtp_must_be_a_bool(bad) -> None:
    with pytest.raises(ValueError, match="GPTConfig.mtp must be a bool"):
        _gpt("mtp", bad)


def test_gpt_moe_must_be_a_moe_config() -> None:
    with pytest.raises(ValueError, match="GPTConfig.moe must be a MoEConfig"):
        GPTConfig(**GPT_BASE, moe=BASE)
