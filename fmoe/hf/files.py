"""Hugging Face checkpoint directories: config.json plus safetensors (one file, or shards with an index).

    cfg, params = load_hf("Qwen3-30B-A3B")                         # what from_pretrained reads
    save_hf("out", cfg, params, "qwen3_moe")                       # what from_pretrained loads

`safetensors` is an optional dependency (the `hf` extra); transformers is never imported. A shard index
(model.safetensors.index.json) may name files in its own directory only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fmoe._checks import json_object
from fmoe.config import GPTConfig
from fmoe.hf.config_map import arch_of, config_from_hf, config_to_hf
from fmoe.hf.weight_map import params_from_hf, params_to_hf

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64"}


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as exc:  # the optional dependency: say which extra brings it
        raise ImportError("reading and writing Hugging Face checkpoints needs safetensors: "
                          "pip install 'fmoe[hf]'") from exc
    return safetensors.torch


def read_config(directory: str | Path) -> dict[str, Any]:
    """Return the config.json of an HF checkpoint directory as a dict."""
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a Hugging Face checkpoint (no {CONFIG})")
    return json_object(path)


def _shard_files(root: Path) -> list[Path]:
    """The safetensors files of `root`: its index's shards, or model.safetensors."""
    if (root / INDEX).is_file():
        index = json_object(root / INDEX)
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{root / INDEX} has no \"weight_map\" object (tensor name -> shard file)")
        names = sorted(set(index["weight_map"].values()))
        for name in names:
            if Path(name).name != name or name in ("", ".", ".."):
                raise ValueError(f"{root / INDEX} names a shard outside its directory: {name!r}")
        return [root / n for n in names]
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    raise FileNotFoundError(f"{root} has neither {SINGLE} nor {INDEX}")


def read_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """Return every tensor of an HF checkpoint directory's safetensors (all shards), on the CPU."""
    st = _safetensors()
    out: dict[str, torch.Tensor] = {}
    for path in _shard_files(Path(directory)):
        try:
            out.update(st.load_file(str(path), device="cpu"))
        except Exception as exc:  # safetensors' own error types (SafetensorError: a truncated header)
            if isinstance(exc, ImportError):
                raise
            raise ValueError(f"{path} is not a readable safetensors file (truncated or damaged?): "
                             f"{exc}") from None
    return out


def load_hf(directory: str | Path, *, dtype: torch.dtype | None = None,
            **moe_options: Any) -> tuple[GPTConfig, dict[str, Any]]:
    """Return (cfg, params) of a Qwen3-MoE or Mixtral checkpoint directory (config.json + safetensors),
    weights cast to `dtype` (None: as stored). `moe_options`: MoEConfig training fields
    (config_from_hf). ValueError naming the field or tensor that does not map."""
    hf = read_config(directory)
    cfg = config_from_hf(hf, **moe_options)
    return cfg, params_from_hf(read_state_dict(directory), cfg, arch_of(hf), dtype=dtype)


def _shards(sd: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Splits `sd` (in order) into dicts of at most max_shard_bytes each (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_hf(directory: str | Path, cfg: GPTConfig, params: dict[str, Any], arch: str, *,
            base_config: Mapping[str, Any] | None = None, max_shard_bytes: int = 5 * 2**30,
            overwrite: bool = False) -> Path:
    """Writes `params` as an HF checkpoint of `arch` ("qwen3_moe" or "mixtral") into `directory`:
    config.json (config_to_hf, with `base_config`'s unmapped fields) and model.safetensors, or shards
    of at most max_shard_bytes plus model.safetensors.index.json; returns the directory.
    FileExistsError when it already holds a config.json or safetensors, unless `overwrite` (which
    removes those first). ValueError for a config `arch` cannot express (check_exportable), or for a
    max_shard_bytes below 1 (which wrote one file per tensor)."""
    if not (isinstance(max_shard_bytes, int) and max_shard_bytes >= 1):
        raise ValueError(f"max_shard_bytes (--max-shard-bytes) must be a positive number of bytes, got "
                         f"{max_shard_bytes!r}")
    st = _safetensors()
    root = Path(directory)
    hf = config_to_hf(cfg, arch, base_config)
    sd = params_to_hf(params, cfg, arch)
    dtypes = {t.dtype for t in sd.values()}
    if len(dtypes) == 1 and next(iter(dtypes)) in DTYPE_NAMES:
        hf["dtype"] = DTYPE_NAMES[next(iter(dtypes))]  # from_pretrained's default dtype
    root.mkdir(parents=True, exist_ok=True)
    old = [p for p in (root / CONFIG, root / INDEX, *root.glob("model*.safetensors")) if p.exists()]
    if old and not overwrite:
        raise FileExistsError(f"{root} already holds a checkpoint ({old[0].name}); pass overwrite=True")
    for p in old:
        p.unlink()
    shards = _shards(sd, max_shard_bytes)
    if len(shards) == 1:
        st.save_file(shards[0], str(root / SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            st.save_file(shard, str(root / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in sd.values())
        (root / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2))
    (root / CONFIG).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return root
