"""fmoe train's checkpoint format (fmoe/train/checkpoint.py) for whole models on one process: what
`fmoe convert` writes from an HF checkpoint and reads to export one.

    path = save_fmoe("ckpt", cfg, params, hf_config=hf)     # ckpt/step_00000000, ckpt/latest
    cfg, params, meta = load_fmoe("ckpt")                   # a checkpoint or a --save directory

A saved checkpoint is step 0 of a run: the weights, AdamW's state as torch creates it (zero moments,
step 0), zero expert biases, no RNG state. Its meta.json holds the TrainConfig model fields
(`train_fields`: MODEL_FIELDS, which `fmoe train --load` compares, and the architecture flags
--kv-channels, --rotary-base, --norm-epsilon, --qk-layernorm, --moe-router-pre-softmax), the whole
GPTConfig under "model" (fmoe train refuses the checkpoint when the model its flags build differs from it
in an architecture field, e.g. qk_norm) and the original config.json under "hf_config" (its unmapped
fields go back into an export; `fmoe train` carries it into the checkpoints of a run that loaded it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fmoe.config import GPTConfig, MoEConfig
from fmoe.gpt_init import gpt_spec
from fmoe.outline import outline, reads_of
from fmoe.train import checkpoint
from fmoe.train.shards import Leaf, get, rank_leaves

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """A one-rank gloo process group for the checkpoint functions (collectives over one rank), unless one
    is already up; torn down on exit."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gpt_config_dict(cfg: GPTConfig) -> dict[str, Any]:
    """Return `cfg` as plain JSON values (moe nested)."""
    return dataclasses.asdict(cfg)


def gpt_config_of(d: dict[str, Any]) -> GPTConfig:
    """Return the GPTConfig of `gpt_config_dict`'s output (every nested config rebuilt: moe, and any field
    whose default is a dataclass)."""
    out = {**d, "moe": MoEConfig(**d["moe"])}
    for f in dataclasses.fields(GPTConfig):
        if isinstance(out.get(f.name), dict) and dataclasses.is_dataclass(f.default):
            out[f.name] = type(f.default)(**out[f.name])
    return GPTConfig(**out)


def train_fields(cfg: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """Return the TrainConfig fields of `cfg`'s model, `fmoe train`'s names: checkpoint.MODEL_FIELDS and
    the flags of the architecture fields (checkpoint.ARCH_FIELDS) a converted model sets: kv_channels,
    rotary_base, norm_epsilon, qk_layernorm, moe_router_score_function, moe_router_pre_softmax."""
    return {"num_layers": cfg.n_layers, "hidden_size": cfg.d_model, "ffn_hidden_size": cfg.d_ff_dense,
            "moe_ffn_hidden_size": cfg.moe.d_ff, "num_experts": cfg.moe.num_experts,
            "moe_router_topk": cfg.moe.top_k, "num_attention_heads": cfg.n_heads,
            "num_query_groups": cfg.n_kv_heads, "first_k_dense": cfg.num_dense_layers,
            "moe_shared_experts": cfg.moe.num_shared_experts, "vocab_size": cfg.vocab_size, "mtp": cfg.mtp,
            "kv_channels": cfg.head_dim, "rotary_base": cfg.rope_theta, "norm_epsilon": cfg.norm_eps,
            "qk_layernorm": cfg.qk_norm, "moe_router_score_function": cfg.moe.score_func,
            "moe_router_pre_softmax": cfg.moe.topk_norm == "before", "dtype": DTYPE_NAMES[dtype]}


def _leaves(params: dict[str, Any], cfg: GPTConfig) -> tuple[list[Leaf], dict[str, torch.Tensor]]:
    """Every leaf of the whole model under its global key (one rank holding all layers and experts)."""
    leaves = rank_leaves(params, cfg, reads_of(outline(cfg).sites), None, pp_rank=0, ep_rank=0,
                         num_local_experts=cfg.moe.num_experts, counts_dense=True, counts_expert=True)
    return leaves, {lf.key: get(params, lf.where) for lf in leaves}


class _FreshAdamW:
    """AdamW's state as a fresh run creates it (zero moments, step 0), for `checkpoint.state_items`."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_of(self, key: str) -> dict[str, torch.Tensor]:
        t = self.tensors[key]
        return {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t),
                "step": torch.zeros((), dtype=torch.float32)}


class _NoOptimizer:
    def state_of(self, key: str) -> None:
        return None


def save_fmoe(directory: str | Path, cfg: GPTConfig, params: dict[str, Any], *,
              hf_config: dict[str, Any] | None = None) -> Path:
    """Writes `params` (one dtype: float32, bfloat16 or float64) as step 0 of an fmoe train run into the
    --save directory `directory` (module docstring); returns the checkpoint's path."""
    leaves, tensors = _leaves(params, cfg)
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
        raise ValueError(f"fmoe train checkpoints hold one dtype of {sorted(DTYPE_NAMES.values())}, "
                         f"got {sorted(map(str, dtypes))}")
    moe_state = {site.key: {"expert_bias_E": torch.zeros(cfg.moe.num_experts)} for site in outline(cfg).moe}
    meta = {"config": train_fields(cfg, next(iter(dtypes))), "model": gpt_config_dict(cfg),
            "hf_config": hf_config, "world_size": 0, "layout": {}}  # no layout: a run never restores RNG
    with one_process():
        items = checkpoint.state_items(leaves, tensors, _FreshAdamW(tensors), moe_state, 0, 0, with_rng=False)
        return checkpoint.save(directory, 0, items, meta)


def load_fmoe(path: str | Path, *, seams: bool = True) -> tuple[GPTConfig, dict[str, Any], dict[str, Any]]:
    """Returns (cfg, params, meta) of an fmoe train checkpoint (a step directory, or a --save directory:
    its latest), verified first (checksums, safe metadata). The config is the recorded GPTConfig
    ("model") when there is one, else the one the run's TrainConfig builds. CheckpointError if damaged.
    `seams` False (the converter): ValueError for a model with a router, experts or attention import path,
    before anything is imported (building the config imports the module a path names)."""
    from fmoe.train.config import DTYPES, TrainConfig

    root = Path(path)
    if not (root / checkpoint.META).is_file():
        found = checkpoint.latest(root)
        if found is None:
            raise checkpoint.CheckpointError(f"{path}: no complete fmoe checkpoint there")
        root = found
    with one_process():
        checkpoint.verify(root)
        meta = checkpoint.read_meta(root)
        saved = meta.get("config", {})
        if not seams:
            _refuse_seams(meta)
        if meta.get("model") is not None:
            cfg = gpt_config_of(meta["model"])
        else:
            known = {f.name for f in dataclasses.fields(TrainConfig)}
            cfg = TrainConfig.build({k: v for k, v in saved.items() if k in known}).model()
        dtype = DTYPES[saved.get("dtype", "float32")]
        shapes = gpt_spec(cfg)
        params = _tree_empty(shapes, dtype)
        leaves, tensors = _leaves(params, cfg)
        items = checkpoint.state_items(leaves, tensors, _NoOptimizer(), {}, 0, 0, with_rng=False)
        checkpoint.read_gate_and_up_apart(root, items)
        checkpoint.load(root, items, verified=True)
    return cfg, params, meta


def _refuse_seams(meta: dict[str, Any]) -> None:
    """Raise ValueError naming the first seam (router, experts, attention) a checkpoint's meta records."""
    model = meta.get("model") or {}
    moe, flags = model.get("moe") or {}, meta.get("config") or {}
    seams = ("router", "experts", "attention")
    recorded = [("router", moe.get("router")), ("experts", moe.get("experts")),
                ("attention", model.get("attention")), *((k, flags.get(k)) for k in seams)]
    found = [(name, value) for name, value in recorded if value is not None]
    if found:
        name, value = found[0]
        raise ValueError(f"the checkpoint's model has --{name} {value!r}: an HF checkpoint holds the default "
                         f"{name} only, and the converter imports nothing a checkpoint names")


def _tree_empty(tree: Any, dtype: torch.dtype) -> Any:
    if isinstance(tree, dict):
        return {k: _tree_empty(v, dtype) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tree_empty(v, dtype) for v in tree]
    return torch.empty(tree.shape, dtype=dtype)
