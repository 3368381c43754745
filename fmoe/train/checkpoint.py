"""Checkpoints of `fmoe train` with torch.distributed.checkpoint, under global names, so that a checkpoint
taken with one layout loads into another.

Keys (each rank writes the ones it holds; DCP stores a key held by several ranks once):
- model/<leaf key>: a weight ("layers.3.w_q"); routed experts one key per global expert,
  model/<leaf key>/expert<e>, so any expert-parallel split can read its rows;
- optim/<leaf key>/{exp_avg, exp_avg_sq, step}: AdamW's state, split like the weight;
- moe_state/<layer>/<name>: the MoE layer states (expert bias, capacity window);
- train/step: steps done (the data position: a step's batch is a function of the step);
- rng/rank<r>: each rank's torch RNG state (restored when the world size is the same).

A save writes DIR/step_<n>.partial, then rank 0 adds meta.json, renames it to DIR/step_<n> and points
DIR/latest at it (os.replace): a crash mid-save leaves the previous checkpoint the latest one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fmoe.train.shards import Leaf

META = "meta.json"
LATEST = "latest"
# The fields a checkpoint's weights depend on: loading into a run that differs in any of them fails.
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "num_experts",
                "moe_router_topk", "num_attention_heads", "num_query_groups", "first_k_dense",
                "moe_shared_experts", "vocab_size", "mtp", "dtype")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run (missing, or a different model)."""


def _expert_rows(lf: Leaf, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(f"{lf.key}/expert{lf.expert_offset + i}", t[i]) for i in range(t.shape[0])]


def _named(leaves: list[Leaf], tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for lf in leaves:
        t = tensors[lf.key]
        out += _expert_rows(lf, t) if lf.expert else [(lf.key, t)]
    return out


def state_items(leaves: list[Leaf], params: dict[str, torch.Tensor], opt: Any,
                moe_state: dict[str, dict[str, torch.Tensor]], step: int, rank: int,
                with_rng: bool) -> dict[str, torch.Tensor]:
    """Returns {checkpoint key: tensor} for this rank: views of the live tensors (weights, the AdamW state
    `opt.state_of` gives for the leaves this rank keeps it for, MoE states), the step, and the RNG state
    when `with_rng`. Loading writes into these same tensors."""
    items: dict[str, torch.Tensor] = {}
    for name, t in _named(leaves, params):
        items[f"model/{name}"] = t
    for lf in leaves:
        st = opt.state_of(lf.key)
        if st is None:  # ZeRO-1: another rank of the group keeps this leaf's AdamW state and writes it
            continue
        for field in ("exp_avg", "exp_avg_sq"):
            for name, t in (_expert_rows(lf, st[field]) if lf.expert else [(lf.key, st[field])]):
                items[f"optim/{name}/{field}"] = t
        items[f"optim/{lf.key}/step"] = st["step"]
    for layer, tensors in moe_state.items():
        for name, t in tensors.items():
            items[f"moe_state/{layer}/{name}"] = t
    items["train/step"] = torch.tensor(step, dtype=torch.int64, device="cpu")  # host-side, as the RNG state
    if with_rng:
        items[f"rng/rank{rank}"] = torch.get_rng_state()
    return items


def save(directory: str | Path, step: int, items: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Writes a checkpoint of step `step` from every rank's `items` (collective: every rank calls it);
    returns its final directory. Tensors are copied to contiguous memory first, so views save only their
    own elements."""
    root = Path(directory)
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}.partial"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # the leftover of a crash during this step's save
    dist.barrier()
    dcp.save({k: v.detach().clone().contiguous() for k, v in items.items()}, checkpoint_id=str(partial))
    dist.barrier()
    if rank == 0:
        (partial / META).write_text(json.dumps({**meta, "step": step}, indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        tmp = root / f".{LATEST}.tmp"
        tmp.write_text(final.name + "\n")
        os.replace(tmp, root / LATEST)
    dist.barrier()
    return final


def latest(directory: str | Path) -> Path | None:
    """Returns the newest complete checkpoint in `directory` (the one `latest` names, else the highest
    step_<n> with its meta.json), or None."""
    root = Path(directory)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / META).is_file():
            return named
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / META).is_file())
    return done[-1] if done else None


def read_meta(checkpoint: str | Path) -> dict[str, Any]:
    """Returns the meta.json of a checkpoint directory; CheckpointError if it is not one."""
    path = Path(checkpoint) / META
    if not path.is_file():
        raise CheckpointError(f"{checkpoint} is not a complete fmoe checkpoint (no {META})")
    return json.loads(path.read_text())


def check_compatible(meta: dict[str, Any], config: dict[str, Any], checkpoint: str | Path) -> None:
    """Raises CheckpointError naming the model fields where the checkpoint's config and this run's differ."""
    saved = meta.get("config", {})
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {config.get(k)!r}" for k in MODEL_FIELDS
            if saved.get(k) != config.get(k)]
    if diff:
        raise CheckpointError(f"{checkpoint} holds another model ({'; '.join(diff)})")


def load(checkpoint: str | Path, items: dict[str, torch.Tensor]) -> None:
    """Reads the checkpoint into `items` (from `state_items`: the live tensors), in place (collective).
    Raises CheckpointError when the checkpoint lacks a key this rank needs."""
    fresh = {k: torch.empty_like(v) for k, v in items.items()}
    try:
        dcp.load(fresh, checkpoint_id=str(checkpoint))
    except Exception as exc:  # DCP wraps per-rank failures; say what was being read
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise CheckpointError(f"loading {checkpoint}: {first}") from exc
    for k, v in items.items():
        if k.startswith("rng/"):
            torch.set_rng_state(fresh[k])
        else:
            v.copy_(fresh[k])
