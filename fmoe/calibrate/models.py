"""`fmoe train`'s presets as the planner's ModelSpecs: what joins the trainer's configs to the planner's
specs, so that neither of them imports the other.

`load_model` is the planner's (fmoe.plan.specs.load_model) with the train presets "tiny" and "small"
among its names (as presets, and as the `base` of a TOML file); `fmoe plan` and the calibration use it.
"""

from __future__ import annotations

import functools
from typing import Any

from fmoe.plan import specs
from fmoe.plan.specs import ModelSpec
from fmoe.train.config import TrainConfig

TRAIN_PRESETS = ("tiny", "small")


@functools.cache
def train_preset_model(name: str) -> ModelSpec:
    """Returns the ModelSpec of `fmoe train`'s preset `name` (tiny, small): fp32, GQA, no MTP."""
    tc = TrainConfig.from_sources(preset=name)
    cfg = tc.model()
    return ModelSpec(
        name=f"train-{name}",
        layers=cfg.n_layers,
        hidden=cfg.d_model,
        heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        vocab=cfg.vocab_size,
        seq=tc.seq_length,
        dense_layers=cfg.num_dense_layers,
        dense_ffn=cfg.d_ff_dense,
        routed_experts=cfg.moe.num_experts,
        shared_experts=cfg.moe.num_shared_experts,
        top_k=cfg.moe.top_k,
        expert_ffn=cfg.moe.d_ff,
        mtp=int(cfg.mtp),
        dtype="fp32",
    )


def model_presets() -> dict[str, ModelSpec]:
    """The planner's model presets and the train presets, by name."""
    return {**specs.MODEL_PRESETS, **{name: train_preset_model(name) for name in TRAIN_PRESETS}}


def model_names() -> tuple[str, ...]:
    """Names `load_model` accepts besides a TOML path."""
    return (*specs.MODEL_PRESETS, *TRAIN_PRESETS)


def load_model(name_or_path: str, overrides: dict[str, Any] | None = None) -> ModelSpec:
    """The planner's `load_model` knowing the train presets too (PlanError on a bad spec)."""
    return specs.load_model(name_or_path, overrides, model_presets())
