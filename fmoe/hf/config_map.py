"""Hugging Face config.json (Qwen3-MoE, Mixtral) <-> fmoe's GPTConfig, exactly or not at all.

    cfg = config_from_hf(json.loads(Path("config.json").read_text()))  # or a transformers config object
    d = config_to_hf(cfg, "qwen3_moe")                                  # a config.json dict

Mapping (HF field -> fmoe field; both architectures unless marked):
    vocab_size -> vocab_size              hidden_size -> d_model (= moe.d_model)
    num_hidden_layers -> n_layers         num_attention_heads -> n_heads
    num_key_value_heads -> n_kv_heads     head_dim (None: hidden_size // heads) -> head_dim
    rms_norm_eps -> norm_eps              rope_parameters.rope_theta (or legacy rope_theta) -> rope_theta
    num_experts_per_tok -> moe.top_k      hidden_act "silu" -> SwiGLU experts (the only kind fmoe has)
    qwen3_moe: num_experts -> moe.num_experts, moe_intermediate_size -> moe.d_ff,
      intermediate_size -> d_ff_dense, norm_topk_prob -> moe.topk_norm ("after" / "before"),
      mlp_only_layers + decoder_sparse_step -> num_dense_layers (the dense layers must be the first ones),
      q_norm / k_norm -> qk_norm=True
    mixtral: num_local_experts -> moe.num_experts, intermediate_size -> moe.d_ff, topk_norm "after"
Routers: both HF routers take softmax over all E logits in fp32, then top-k, then (Mixtral always,
Qwen3 with norm_topk_prob) renormalise the K weights: fmoe's score_func "softmax" with topk_norm
"after" / "before" is the same computation (softmax then top-k then renormalise equals a softmax over the
K selected logits, so it also matches Mixtral's original top-k-then-softmax). No shared experts, no
expert bias, dropless, untied head (a tied checkpoint's head is imported as a copy of the embedding;
exports are always untied).
Refused (ValueError naming the field): anything that changes the logits and fmoe cannot express:
sliding windows, RoPE scaling / partial rotary, attention biases, another activation, router jitter,
attention dropout, dense layers that are not the leading ones. Training-only HF fields (router_aux_loss_coef,
output_router_logits, initializer_range, token ids, max_position_embeddings) are not mapped: balancing
losses are set on MoEConfig; `config_to_hf(..., base=original)` carries the unmapped fields through.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from fmoe.config import GPTConfig, MoEConfig

ARCHS = ("qwen3_moe", "mixtral")
CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
# transformers 5's class defaults for the fields read here (a config.json from save_pretrained has all
# of them; hub files may omit some). tests/test_hf.py checks them against the installed classes.
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "attention_bias": False, "use_sliding_window": False, "attention_dropout": 0.0,
                  "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                  "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": [], "rope_theta": 10000.0},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                "sliding_window": None, "attention_dropout": 0.0, "num_experts_per_tok": 2,
                "num_local_experts": 8, "router_jitter_noise": 0.0, "rope_theta": 1e6},
}
# Fields config_to_hf writes itself; a `base` config's legacy spellings of them are dropped.
_LEGACY = ("rope_theta", "rope_scaling", "num_local_experts", "num_experts", "torch_dtype", "dtype",
           "transformers_version")


def as_dict(hf_config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """Return a config.json dict from a dict or a transformers config object (its `to_dict()`)."""
    return dict(hf_config) if isinstance(hf_config, Mapping) else dict(hf_config.to_dict())


def arch_of(hf: Mapping[str, Any]) -> str:
    """Return the model_type of a config.json dict, refusing any but ARCHS."""
    arch = hf.get("model_type")
    if arch not in ARCHS:
        raise ValueError(f"config.json model_type {arch!r} is not supported (supported: {', '.join(ARCHS)})")
    return arch


def _get(hf: Mapping[str, Any], arch: str, name: str) -> Any:
    return hf[name] if name in hf else DEFAULTS[arch][name]


def _refuse(arch: str, name: str, value: Any, why: str) -> None:
    raise ValueError(f"{arch} config field {name}={value!r} cannot be mapped to fmoe: {why}")


def _rope_theta(hf: Mapping[str, Any], arch: str) -> float:
    """The RoPE base; only the default (unscaled, full-width) rotary embedding maps."""
    rope = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling")
    for name, params in (("rope_parameters", rope), ("rope_scaling", legacy or {})):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            _refuse(arch, f"{name}.rope_type", kind, "fmoe has the default RoPE only (no scaling)")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            _refuse(arch, f"{name}.partial_rotary_factor", params["partial_rotary_factor"],
                    "fmoe rotates the whole head dim")
    return float(rope.get("rope_theta", hf.get("rope_theta", DEFAULTS[arch]["rope_theta"])))


def _leading_dense(hf: Mapping[str, Any], n_layers: int, num_experts: int) -> int:
    """Qwen3's dense layers (mlp_only_layers, decoder_sparse_step) as fmoe's first num_dense_layers."""
    only = set(_get(hf, "qwen3_moe", "mlp_only_layers") or [])
    step = _get(hf, "qwen3_moe", "decoder_sparse_step")
    if num_experts <= 0:
        _refuse("qwen3_moe", "num_experts", num_experts, "a model without experts is not an MoE")
    sparse = [i not in only and (i + 1) % step == 0 for i in range(n_layers)]
    k = sparse.index(True) if any(sparse) else n_layers
    if not all(sparse[k:]):
        dense = [i for i, s in enumerate(sparse) if not s]
        field = "decoder_sparse_step" if step != 1 else "mlp_only_layers"
        _refuse("qwen3_moe", field, step if step != 1 else sorted(only),
                f"dense layers {dense}; fmoe's dense layers are the first num_dense_layers only")
    return k


def config_from_hf(hf_config: Mapping[str, Any] | Any, **moe_options: Any) -> GPTConfig:
    """Return the GPTConfig of a Qwen3-MoE or Mixtral config (a config.json dict or a transformers config).

    `moe_options`: further MoEConfig fields for training (aux_loss_coef, capacity_factor, ...); the
    defaults give HF's inference exactly. ValueError naming the HF field for anything fmoe cannot map.
    """
    hf = as_dict(hf_config)
    arch = arch_of(hf)
    get = functools.partial(_get, hf, arch)
    if get("hidden_act") != "silu":
        _refuse(arch, "hidden_act", get("hidden_act"), "fmoe's MLPs are SwiGLU (silu)")
    if get("attention_dropout"):
        _refuse(arch, "attention_dropout", get("attention_dropout"), "fmoe has no attention dropout")
    if arch == "qwen3_moe":
        if get("attention_bias"):
            _refuse(arch, "attention_bias", True, "fmoe's projections have no bias")
        if get("use_sliding_window"):
            _refuse(arch, "use_sliding_window", True, f"sliding_window={hf.get('sliding_window')}: fmoe "
                    "attends to the whole causal prefix")
        num_experts = hf.get("num_experts", hf.get("num_local_experts", DEFAULTS[arch]["num_experts"]))
        d_ff, d_ff_dense = get("moe_intermediate_size"), get("intermediate_size")
        topk_norm = "after" if get("norm_topk_prob") else "before"
    else:
        if get("sliding_window") is not None:
            _refuse(arch, "sliding_window", get("sliding_window"), "fmoe attends to the whole causal prefix")
        if get("router_jitter_noise"):
            _refuse(arch, "router_jitter_noise", get("router_jitter_noise"), "fmoe's router has no noise")
        num_experts, d_ff, topk_norm = get("num_local_experts"), get("intermediate_size"), "after"
        d_ff_dense = None  # no dense layers
    D, n_layers, H = get("hidden_size"), get("num_hidden_layers"), get("num_attention_heads")
    dense = _leading_dense(hf, n_layers, num_experts) if arch == "qwen3_moe" else 0
    moe = MoEConfig(d_model=D, d_ff=d_ff, num_experts=num_experts, top_k=get("num_experts_per_tok"),
                    score_func="softmax", topk_norm=topk_norm, **moe_options)
    return GPTConfig(vocab_size=get("vocab_size"), d_model=D, n_layers=n_layers, n_heads=H,
                     n_kv_heads=get("num_key_value_heads") or H, head_dim=hf.get("head_dim") or D // H,
                     d_ff_dense=d_ff_dense, num_dense_layers=dense, rope_theta=_rope_theta(hf, arch),
                     norm_eps=get("rms_norm_eps"), qk_norm=arch == "qwen3_moe", moe=moe)


def check_exportable(cfg: GPTConfig, arch: str) -> None:
    """Raise ValueError naming the first fmoe config field that `arch` cannot express exactly."""
    if arch not in ARCHS:
        raise ValueError(f"unknown HF architecture {arch!r} (supported: {', '.join(ARCHS)})")
    m = cfg.moe
    problems = [  # (refused, field, value, why)
        (cfg.mtp, "GPTConfig.mtp", cfg.mtp, "has no multi-token-prediction module"),
        (m.num_shared_experts > 0, "MoEConfig.num_shared_experts", m.num_shared_experts,
         "has no shared expert"),
        (m.score_func != "softmax", "MoEConfig.score_func", m.score_func, "routes by softmax"),
        (m.topk_scale != 1.0, "MoEConfig.topk_scale", m.topk_scale, "does not scale the gate weights"),
        (m.num_groups > 1 and m.topk_groups < m.num_groups, "MoEConfig.topk_groups", m.topk_groups,
         "has no group-limited routing"),
        (m.capacity_factor is not None, "MoEConfig.capacity_factor", m.capacity_factor, "is dropless"),
        (m.bias_update_rate > 0, "MoEConfig.bias_update_rate", m.bias_update_rate,
         "has no expert selection bias"),
        (arch == "qwen3_moe" and not cfg.qk_norm, "GPTConfig.qk_norm", cfg.qk_norm,
         "normalises q and k per head"),
        (arch == "mixtral" and cfg.qk_norm, "GPTConfig.qk_norm", cfg.qk_norm, "has no q / k norm"),
        (arch == "mixtral" and cfg.num_dense_layers > 0, "GPTConfig.num_dense_layers", cfg.num_dense_layers,
         "has MoE layers only"),
        (arch == "mixtral" and m.topk_norm != "after", "MoEConfig.topk_norm", m.topk_norm,
         "always renormalises the top-k weights"),
    ]
    for refused, field, value, why in problems:
        if refused:
            raise ValueError(f"{field}={value!r} cannot be exported: {arch} {why}")


def config_to_hf(cfg: GPTConfig, arch: str, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Return the config.json dict of `cfg` as `arch` ("qwen3_moe" or "mixtral"), after
    `check_exportable`. `base`: a config.json of the same architecture whose unmapped fields (token ids,
    max_position_embeddings, ...) are kept; the mapped ones are overwritten."""
    check_exportable(cfg, arch)
    out = {k: v for k, v in (base or {}).items() if k not in _LEGACY} if (
        base or {}).get("model_type") == arch else {}
    m = cfg.moe
    out.update({"architectures": [CLASSES[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
                "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "tie_word_embeddings": False, "num_experts_per_tok": m.top_k, "attention_dropout": 0.0})
    if arch == "qwen3_moe":
        out.update({"num_experts": m.num_experts, "moe_intermediate_size": m.d_ff,
                    "intermediate_size": cfg.d_ff_dense, "norm_topk_prob": m.topk_norm == "after",
                    "mlp_only_layers": list(range(cfg.num_dense_layers)), "decoder_sparse_step": 1,
                    "attention_bias": False, "use_sliding_window": False, "sliding_window": None})
    else:
        out.update({"num_local_experts": m.num_experts, "intermediate_size": m.d_ff, "sliding_window": None,
                    "router_jitter_noise": 0.0})
    return out
