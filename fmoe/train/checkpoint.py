"""Checkpoints of `fmoe train` with torch.distributed.checkpoint, under global names, so that a checkpoint
taken with one layout loads into another.

Keys (each rank writes the ones it holds; DCP stores a key held by several ranks once):
- model/<leaf key>: a weight ("layers.3.w_q"); routed experts one key per global expert,
  model/<leaf key>/expert<e>, so any expert-parallel split can read its rows; a weight split over the
  tensor-parallel ranks (fmoe/tp_layout.py) is saved as the DTensor of its shards (Shard(axis) on the tp
  mesh), so DCP writes the whole tensor once and any tp layout (tp 1 included) reads its part;
- optim/<leaf key>/{exp_avg, exp_avg_sq, step}: AdamW's state, split like the weight;
- moe_state/<layer>/<name>: the MoE layer states (expert bias, capacity window);
- train/step: steps done; train/consumed_samples: the samples read (the data position: a step reads the
  stream positions from there on, fmoe/train/data.py; absent from older checkpoints, where it is step x
  the global batch);
- rng/rank<r>: each rank's torch RNG state (restored when the world size is the same).

A save writes DIR/step_<n>.partial, then rank 0 adds meta.json and checksums.json (a sha256 per file,
fmoe/train/checksums.py), renames it to DIR/step_<n> and points DIR/latest at it (os.replace): a crash
mid-save leaves the previous checkpoint the latest one. A symlink where a save would write (step_<n>,
its .partial, the pointer's temporary) is refused, never followed: a save writes inside DIR only.

A load checks the checksums (a checkpoint without them loads with a warning), reads DCP's `.metadata`
through a restricted unpickler (fmoe/train/safe_metadata.py: a shared checkpoint runs no code), and turns
every failure (torch's CheckpointException is a BaseException) into one line of CheckpointError.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fmoe._checks import json_object
from fmoe.tp_layout import tp_split_axis
from fmoe.train import checksums
from fmoe.train.checksums import CHECKSUMS
from fmoe.train.run_errors import CheckpointError as CheckpointError  # where callers have found it
from fmoe.train.shards import Leaf

META = "meta.json"
LATEST = "latest"
# The fields a checkpoint's weights depend on: loading into a run that differs in any of them fails.
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "num_experts",
                "moe_router_topk", "num_attention_heads", "num_query_groups", "first_k_dense",
                "moe_shared_experts", "vocab_size", "mtp", "dtype")
# GPTConfig fields (moe.* of its MoEConfig) beyond MODEL_FIELDS that a checkpoint records under meta
# "model" (fmoe convert's; fmoe train's own): loading it into a run whose model differs in one fails. The
# flags: --kv-channels, --rotary-base, --norm-epsilon, --qk-layernorm, --moe-router-score-function,
# --moe-router-pre-softmax (topk_norm); topk_scale and the groups have defaults in fmoe train.
ARCH_FIELDS = ("head_dim", "rope_theta", "norm_eps", "qk_norm", "moe.score_func", "moe.topk_norm",
               "moe.topk_scale", "moe.num_groups", "moe.topk_groups",
               # MLA: head_dim 4 + rope 2 and head_dim 2 + rope 4 give w_q_b the same shape
               "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
_ADDED = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")  # absent from older checkpoints
# The learning rate of a step depends on the schedule's values (fmoe/train/lr_schedule.py,
# LRSchedule.compared): a resumed run that changes one changes the LR mid-run (a larger --steps, the
# default --lr-decay-iters, restarts the decay), refused as Megatron does.
_STEP_DIR = re.compile(r"step_\d+$")


def _one_line(exc: BaseException) -> str:
    """`Type: first line` of `exc`; for torch's CheckpointException, of the first failed rank's error."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0]
        return f"rank {rank}: {_one_line(inner)}"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _collectively(problem: str | None) -> None:
    """Raises CheckpointError on every rank when any rank has a problem (the first rank's), so no rank goes
    on into a collective that the others left."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
    if problem:
        raise CheckpointError(problem)


def _refuse_symlink(path: Path) -> None:
    if path.is_symlink():
        raise CheckpointError(f"{path} is a symlink: a save writes inside --save only (remove it)")


def _fresh_dir(path: Path) -> None:
    """Creates the empty directory `path`: a real directory there (a crashed save's leftover) is removed
    first; a symlink is refused, never followed."""
    _refuse_symlink(path)
    if path.exists():
        shutil.rmtree(path)
    os.mkdir(path)  # fails rather than reuse anything that appeared there since


def _write_new(path: Path, text: str) -> None:
    """Writes `text` to a new file `path` (whatever was there, a symlink included, is unlinked first; the
    file is created with O_EXCL | O_NOFOLLOW, so a link planted meanwhile makes it fail, not follow)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _expert_rows(lf: Leaf, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(f"{lf.key}/expert{lf.expert_offset + i}", t[i]) for i in range(t.shape[0])]


def _named(leaves: list[Leaf], tensors: dict[str, torch.Tensor],
           tp_mesh: Any = None) -> list[tuple[str, Any]]:
    out = []
    for lf in leaves:
        t = tensors[lf.key]
        out += _expert_rows(lf, t) if lf.expert else [(lf.key, _global(lf, t, tp_mesh))]
    return out


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported on first use: with DTensor it costs every rank 0.7 s of
    start-up, and most runs never save."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _global(lf: Leaf, t: torch.Tensor, tp_mesh: Any) -> Any:
    """`t` itself, or for a leaf split over the tensor-parallel ranks the DTensor of the shards (its local
    tensor `t`, so a load writes into it)."""
    axis = None if tp_mesh is None else tp_split_axis(lf.where)
    if axis is None:
        return t
    # imported here, as DCP (`_dcp`): together they cost every rank 0.7 s of start-up
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t, tp_mesh, [Shard(axis)], run_check=False)


def state_items(leaves: list[Leaf], params: dict[str, torch.Tensor], opt: Any,
                moe_state: dict[str, dict[str, torch.Tensor]], step: int, rank: int,
                with_rng: bool, tp_mesh: Any = None) -> dict[str, torch.Tensor]:
    """Returns {checkpoint key: tensor} for this rank: views of the live tensors (weights, the AdamW state
    `opt.state_of` gives for the leaves this rank keeps it for, MoE states), the step, and the RNG state
    when `with_rng`. Loading writes into these same tensors. `tp_mesh`: the tensor-parallel DeviceMesh
    (None at tp 1): split weights and their AdamW moments become DTensors of their shards."""
    items: dict[str, torch.Tensor] = {}
    for name, t in _named(leaves, params, tp_mesh):
        items[f"model/{name}"] = t
    for lf in leaves:
        st = opt.state_of(lf.key)
        if st is None:  # ZeRO-1: another rank of the group keeps this leaf's AdamW state and writes it
            continue
        for field in ("exp_avg", "exp_avg_sq"):
            for name, t in (_expert_rows(lf, st[field]) if lf.expert else
                            [(lf.key, _global(lf, st[field], tp_mesh))]):
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
    returns its final directory. The live tensors go to DCP as they are: its writer stages them to the
    host one at a time (a device tensor copied to host memory, a host view cloned to its own elements:
    torch/distributed/checkpoint/filesystem.py's loaders), so a save allocates no device copy of the
    weights or the AdamW state (a whole copy was 12 bytes per parameter at the peak). CheckpointError
    on every rank when rank 0 refuses the directory or a write fails."""
    root = Path(directory)
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}.partial"
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _refuse_symlink(final)
            _refuse_symlink(root / f".{LATEST}.tmp")
            _fresh_dir(partial)
        except (CheckpointError, OSError) as exc:
            problem = str(exc)
    _collectively(problem)
    try:
        _dcp().save({k: v.detach() for k, v in items.items()}, checkpoint_id=str(partial))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"saving {partial}: {_one_line(exc)}") from exc
    dist.barrier()
    share = checksums.digest_share(partial, rank, world)
    shares: list[Any] = [None] * world
    dist.all_gather_object(shares, share)
    if rank == 0:
        (partial / META).write_text(json.dumps({**meta, "step": step}, indent=1, sort_keys=True))
        files = {k: v for s in shares for k, v in s.items()}
        files[META] = checksums.digest(partial / META)
        checksums.write(partial, files)  # before the rename: a checkpoint `latest` names has its sums
        if final.exists():  # this run's own earlier save of the step (resumed before it); not a symlink
            shutil.rmtree(final)
        os.replace(partial, final)
        tmp = root / f".{LATEST}.tmp"
        _write_new(tmp, final.name + "\n")
        os.replace(tmp, root / LATEST)
    dist.barrier()
    return final


def latest(directory: str | Path) -> Path | None:
    """Returns the newest complete checkpoint in `directory` (the one `latest` names, else the highest
    step_<n> with its meta.json), or None."""
    root = Path(directory)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        named = root / name
        if _STEP_DIR.match(name) and (named / META).is_file():  # a name in DIR, never a path out of it
            return named
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / META).is_file())
    return done[-1] if done else None


def read_meta(checkpoint: str | Path) -> dict[str, Any]:
    """Returns the meta.json of a checkpoint directory; CheckpointError if it is not one."""
    path = Path(checkpoint) / META
    if not path.is_file():
        raise CheckpointError(f"{checkpoint} is not a complete fmoe checkpoint (no {META})")
    try:
        return json_object(path)
    except ValueError as exc:  # a damaged or edited meta.json: its name, not a JSON or Key error
        raise CheckpointError(f"{exc}: the checkpoint's description is damaged") from None


def architecture_diff(model: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """The ARCH_FIELDS where a recorded GPTConfig (`model`, as dataclasses.asdict) and the one this run's
    TrainConfig fields `config` build differ."""
    from fmoe.config import GPTConfig
    from fmoe.train.config import TrainConfig

    ours = dataclasses.asdict(TrainConfig.build(config).model())
    def at(tree: dict[str, Any], name: str) -> Any:
        for part in name.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree
    # a checkpoint written before a field existed (the MLA sizes) had its default (GQA)
    default = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    recorded = {k: at(model, k) if k not in _ADDED or k in model else default[k] for k in ARCH_FIELDS}
    return [f"{k}: checkpoint {recorded[k]!r}, this run {at(ours, k)!r}" for k in ARCH_FIELDS
            if recorded[k] != at(ours, k)]


def check_compatible(meta: dict[str, Any], config: dict[str, Any], checkpoint: str | Path) -> None:
    """Raises CheckpointError naming the model fields where the checkpoint's config and this run's differ
    (and, for a checkpoint that records its whole GPTConfig under "model", the ARCH_FIELDS)."""
    saved = meta.get("config", {})
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {config.get(k)!r}" for k in MODEL_FIELDS
            if saved.get(k) != config.get(k)]
    if not diff and isinstance(meta.get("model"), dict):
        diff = architecture_diff(meta["model"], config)
    if diff:
        raise CheckpointError(f"{checkpoint} holds another model ({'; '.join(diff)})")


def check_schedule(meta: dict[str, Any], config: dict[str, Any], checkpoint: str | Path) -> None:
    """Raises CheckpointError naming the learning-rate fields where the checkpoint's run and this one
    differ (Megatron asserts the same unless --override-opt_param-scheduler)."""
    from fmoe.train.lr_schedule import LRSchedule

    saved = meta.get("config", {})
    if not {"lr", "min_lr", "steps"} <= saved.keys():  # not written by fmoe train: nothing to compare
        return
    before, now = LRSchedule.of(saved).compared(), LRSchedule.of(config).compared()
    def name(k: str) -> str:
        return f"{k} (--steps unless given)" if k == "lr_decay_iters" else k

    keys = [*before, *(k for k in now if k not in before)]
    diff = [f"{name(k)}: checkpoint {before.get(k)!r}, this run {now.get(k)!r}" for k in keys
            if before.get(k) != now.get(k)]
    if diff:
        raise CheckpointError(f"{checkpoint} was trained with another learning-rate schedule "
                              f"({'; '.join(diff)}): the LR is a function of the step and these, so it "
                              "would jump; give --override-opt-param-scheduler to use this run's values")


def check_data(meta: dict[str, Any], identity: dict[str, Any], checkpoint: str | Path) -> None:
    """Raises CheckpointError naming what differs between the data the checkpoint's run read and this
    run's `identity` (fmoe.train.data_source.data_identity): its stream would not continue."""
    from fmoe.train.data_source import data_diff, saved_identity

    saved = saved_identity(meta)
    diff = data_diff(saved, identity) if saved is not None else []
    if diff:
        raise CheckpointError(f"{checkpoint} was trained on other data ({'; '.join(diff)}): this run would "
                              "not continue its samples; give the same data flags, or --override-data to go "
                              "on with this run's data")


def has_key(checkpoint: str | Path, key: str) -> bool:
    """Whether the checkpoint holds `key` (from its `.metadata`, through the restricted unpickler)."""
    from fmoe.train.safe_metadata import read_metadata

    return key in read_metadata(Path(checkpoint) / ".metadata").state_dict_metadata


FUSED, GATE, UP = ".experts.w_gate_up", ".experts.w_gate", ".experts.w_up"


def read_gate_and_up_apart(checkpoint: str | Path, items: dict[str, torch.Tensor]) -> None:
    """For a checkpoint written before the routed experts' gate and up weights were one tensor (keys
    `...experts.w_gate` and `...experts.w_up`, each [.., D, F]): puts into `items`, in place of each
    `...experts.w_gate_up` key the checkpoint lacks, its two halves under the old keys (views of the same
    tensor, [.., D, 2F]: gate's columns, then up's), so the load writes the old tensors into the fused
    one. The AdamW step counter, one per leaf, is read from w_gate's. Returns None."""
    from fmoe.ops import halves
    from fmoe.train.safe_metadata import read_metadata

    held = read_metadata(Path(checkpoint) / ".metadata").state_dict_metadata
    for key in [k for k in items if FUSED in k and k not in held]:
        gate_key, up_key = key.replace(FUSED, GATE), key.replace(FUSED, UP)
        if gate_key not in held or up_key not in held:
            continue  # neither layout: the load names the missing key
        fused = items.pop(key)
        if fused.dim() == 0:
            items[gate_key] = fused
            continue
        items[gate_key], items[up_key] = halves(fused)


def verify(checkpoint: str | Path) -> None:
    """Checks the checkpoint before anything of it is used (collective: the ranks split the files):
    every file against checksums.json, then `.metadata` through the restricted unpickler, its shards
    plain files of the checkpoint. CheckpointError on every rank naming the first problem; a checkpoint
    without checksums.json (older fmoe) warns once and is read unverified."""
    root = Path(checkpoint)
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = None
    try:
        files = checksums.recorded(root)
        if files is not None:
            problem = checksums.check_share(root, files, rank, world)
        elif rank == 0:
            warnings.warn(f"{root} has no checksums ({CHECKSUMS}; written before fmoe recorded them): "
                          "loading it unverified", stacklevel=2)
        if problem is None:
            from fmoe.train.safe_metadata import read_metadata

            storage = getattr(read_metadata(root / ".metadata"), "storage_data", None)
            if not isinstance(storage, dict):
                raise CheckpointError(f"{root}/.metadata lists no shards")
            for info in storage.values():
                name = getattr(info, "relative_path", None)
                plain = isinstance(name, str) and "/" not in name and os.sep not in name and name not in (
                    "", ".", "..")
                if not plain or (files is not None and name not in files):
                    problem = f"{root}/.metadata names a shard {name!r} outside the checksummed files"
                    break
    except (CheckpointError, ValueError, OSError) as exc:
        problem = str(exc)
    _collectively(problem)


def load(checkpoint: str | Path, items: dict[str, torch.Tensor], verified: bool = False) -> None:
    """Reads the checkpoint into `items` (from `state_items`: the live tensors), in place (collective),
    after `verify` unless the caller did (`verified`). DCP reads each tensor into host memory and copies
    it into its target, one at a time: no device copy of the weights or the AdamW state is made. A load
    that fails may leave `items` partly written; the caller stops on its error. Raises CheckpointError
    (one line) when it is damaged or unsafe, or lacks a key this rank needs."""
    if not verified:
        verify(checkpoint)
    # the RNG state is set through torch, not written in place: read into a host tensor of its own
    fresh = {k: torch.empty_like(v) if k.startswith("rng/") else v for k, v in items.items()}
    try:
        from fmoe.train.safe_metadata import SafeFileSystemReader

        _dcp().load(fresh, storage_reader=SafeFileSystemReader(str(checkpoint)))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # DCP wraps per-rank failures in a BaseException; say what was being read
        raise CheckpointError(f"loading {checkpoint}: {_one_line(exc)}") from exc
    for k in items:
        if k.startswith("rng/"):
            torch.set_rng_state(fresh[k])
