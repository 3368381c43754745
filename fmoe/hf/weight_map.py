"""Hugging Face state dicts (Qwen3-MoE, Mixtral) <-> fmoe's GPT params pytree (fmoe/model.py).

    params = params_from_hf(state_dict, cfg, "qwen3_moe")
    state_dict = params_to_hf(params, cfg, "qwen3_moe")       # the hub's names (per-expert tensors)

Legend (the package's, docs/moe.md): V vocabulary, D model width, H / G query / kv heads, d head dim,
E experts, F expert (or dense) ffn width.

HF's nn.Linear weights are [out, in]; fmoe's are [in, out] (y = x @ w): every matrix is transposed, and
copied (contiguous). Per layer i, with P = "model.layers.{i}":
    P.input_layernorm.weight [D]           -> attn_norm
    P.self_attn.{q,k,v}_proj.weight        -> w_q [D, H*d], w_k, w_v [D, G*d]
    P.self_attn.o_proj.weight [D, H*d]     -> w_o [H*d, D]
    P.self_attn.{q,k}_norm.weight [d]      -> q_norm, k_norm (qwen3_moe)
    P.post_attention_layernorm.weight      -> mlp_norm (MoE layer) or mlp.norm (dense layer)
    P.mlp.{gate,up,down}_proj.weight       -> mlp.w_gate, w_up [D, F], w_down [F, D] (dense, qwen3_moe)
    router  P.mlp.gate.weight [E, D]       -> moe.router.w [D, E]   (mixtral: P.block_sparse_moe.gate)
    expert e P.mlp.experts.{e}.gate_proj / up_proj / down_proj (mixtral: P.block_sparse_moe.experts.{e}.
             w1 / w3 / w2)                 -> moe.experts.w_gate_up[e] [D, 2F] (gate | up), w_down[e] [F, D]
and model.embed_tokens.weight [V, D] -> embed.table, model.norm.weight -> norm, lm_head.weight [V, D]
-> head.w [D, V] (absent when tie_word_embeddings: the embedding's transpose, copied).
Imports also read transformers 5's in-memory fused experts (`model.state_dict()` of a loaded model):
P.mlp.experts.gate_up_proj [E, 2F, D] (gate rows first) and P.mlp.experts.down_proj [E, D, F], with the
router at P.mlp.gate.weight for both architectures. Exports write the hub's per-expert names, which
transformers 4 and 5 both load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fmoe.config import GPTConfig
from fmoe.hf.config_map import check_exportable
from fmoe.ops import halves
from fmoe.outline import outline
from fmoe.structure import check_gpt

# The hub's per-expert names: arch -> (MoE module, its experts' (gate, up, down) projections).
_MOE_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
              "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
_ATTENTION = (("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_o", "o_proj"))
_MLP = (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))


def _t(w: torch.Tensor) -> torch.Tensor:
    """The transpose of the last two dims, as a new contiguous tensor (no storage shared)."""
    return w.transpose(-1, -2).clone(memory_format=torch.contiguous_format)


class _Reader:
    """Takes tensors out of a state dict by name, checking shapes; `rest` names what was never taken."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype | None):
        self.sd, self.dtype, self.taken = state_dict, dtype, set()

    def has(self, name: str) -> bool:
        return name in self.sd

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.sd:
            raise ValueError(f"HF state dict: {name} is missing, config says shape {shape}")
        t = self.sd[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"HF state dict: {name} has shape {tuple(t.shape)}, config says {shape}")
        self.taken.add(name)
        return t.to(self.dtype) if self.dtype is not None else t

    def rest(self) -> list[str]:
        return sorted(set(self.sd) - self.taken)


def _experts_from_hf(get: _Reader, P: str, cfg: GPTConfig, arch: str) -> dict[str, torch.Tensor]:
    E, D, F = cfg.moe.num_experts, cfg.d_model, cfg.moe.d_ff
    if get.has(f"{P}.mlp.experts.gate_up_proj"):  # transformers 5's fused layout, gate rows first as ours
        return {"w_gate_up": _t(get(f"{P}.mlp.experts.gate_up_proj", (E, 2 * F, D))),
                "w_down": _t(get(f"{P}.mlp.experts.down_proj", (E, D, F)))}
    module, (gate, up, down) = _MOE_NAMES[arch]

    def stacked(name: str, shape: tuple[int, int]) -> torch.Tensor:
        return torch.stack([_t(get(f"{P}.{module}.experts.{e}.{name}.weight", shape)) for e in range(E)])

    return {"w_gate_up": torch.cat([stacked(gate, (F, D)), stacked(up, (F, D))], -1),
            "w_down": stacked(down, (D, F))}


def _router_name(get: _Reader, P: str, arch: str) -> str:
    fused = f"{P}.mlp.gate.weight"
    return fused if get.has(fused) else f"{P}.{_MOE_NAMES[arch][0]}.gate.weight"


def params_from_hf(state_dict: Mapping[str, torch.Tensor], cfg: GPTConfig, arch: str, *,
                   dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Return fmoe GPT params (the `init_gpt(cfg)` layout) from an HF `state_dict` of `arch` (names in the
    module docstring; per-expert or fused experts), cast to `dtype` (None: as stored).

    ValueError naming the tensor for a missing one, a wrong shape, or one the mapping does not use
    (e.g. attention biases, or a layer beyond n_layers).
    """
    get = _Reader(state_dict, dtype)
    D, V, d = cfg.d_model, cfg.vocab_size, cfg.head_dim
    Hd, Gd = cfg.n_heads * d, cfg.n_kv_heads * d
    table = get("model.embed_tokens.weight", (V, D))
    head = get("lm_head.weight", (V, D)) if get.has("lm_head.weight") else table  # tied: copy the embedding
    layers = []
    for i in range(cfg.n_layers):
        P = f"model.layers.{i}"
        p: dict[str, Any] = {"attn_norm": get(f"{P}.input_layernorm.weight", (D,)).clone()}
        for ours, theirs in _ATTENTION:
            shape = {"w_q": (Hd, D), "w_o": (D, Hd)}.get(ours, (Gd, D))
            p[ours] = _t(get(f"{P}.self_attn.{theirs}.weight", shape))
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                p[name] = get(f"{P}.self_attn.{name}.weight", (d,)).clone()
        norm = get(f"{P}.post_attention_layernorm.weight", (D,)).clone()
        if not outline(cfg).layer(i).is_moe:
            F = cfg.d_ff_dense
            p["mlp"] = {"norm": norm}
            for ours, theirs in _MLP:
                p["mlp"][ours] = _t(get(f"{P}.mlp.{theirs}.weight", (D, F) if ours == "w_down" else (F, D)))
        else:
            p["mlp_norm"] = norm
            p["moe"] = {"router": {"w": _t(get(_router_name(get, P, arch), (cfg.moe.num_experts, D)))},
                        "experts": _experts_from_hf(get, P, cfg, arch)}
        layers.append(p)
    params = {"embed": {"table": table.clone()}, "layers": layers,
              "norm": get("model.norm.weight", (D,)).clone(), "head": {"w": _t(head)}}
    unused = get.rest()
    if unused:
        raise ValueError(f"HF state dict: {len(unused)} tensor(s) fmoe's {arch} mapping does not use, "
                         f"e.g. {', '.join(unused[:3])}")
    check_gpt(params, cfg)
    return params


def params_to_hf(params: dict[str, Any], cfg: GPTConfig, arch: str) -> dict[str, torch.Tensor]:
    """Return the HF state dict (hub names, per-expert tensors, untied lm_head) of fmoe GPT `params`,
    each tensor a new contiguous one in its fmoe dtype. Check the config first
    (fmoe.hf.config_map.check_exportable) for a model `arch` can express."""
    check_exportable(cfg, arch)
    check_gpt(params, cfg)
    sd = {"model.embed_tokens.weight": params["embed"]["table"].contiguous().clone()}
    module, names = _MOE_NAMES[arch]
    for i, p in enumerate(params["layers"]):
        P = f"model.layers.{i}"
        sd[f"{P}.input_layernorm.weight"] = p["attn_norm"].clone()
        for ours, theirs in _ATTENTION:
            sd[f"{P}.self_attn.{theirs}.weight"] = _t(p[ours])
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                sd[f"{P}.self_attn.{name}.weight"] = p[name].clone()
        if not outline(cfg).layer(i).is_moe:
            sd[f"{P}.post_attention_layernorm.weight"] = p["mlp"]["norm"].clone()
            for ours, theirs in _MLP:
                sd[f"{P}.mlp.{theirs}.weight"] = _t(p["mlp"][ours])
            continue
        sd[f"{P}.post_attention_layernorm.weight"] = p["mlp_norm"].clone()
        sd[f"{P}.{module}.gate.weight"] = _t(p["moe"]["router"]["w"])
        experts = p["moe"]["experts"]
        for e in range(cfg.moe.num_experts):
            for w, theirs in zip((*halves(experts["w_gate_up"][e]), experts["w_down"][e]), names):
                sd[f"{P}.{module}.experts.{e}.{theirs}.weight"] = _t(w)
    sd["model.norm.weight"] = params["norm"].clone()
    sd["lm_head.weight"] = _t(params["head"]["w"])
    return sd
