"""Tensor-parallel layout of a transformer block: which weight is split how over the tp ranks (Megatron's).

Legend (the package's, docs/moe.md): D model width, H query heads, G kv heads, d head dim, F the dense
block's ffn width, P tensor-parallel ranks; rank p holds the p-th of P equal parts.

    w_q [D, H*d]                  columns, by query heads        (column-parallel)
    w_k, w_v [D, G*d]             columns, by kv heads           (column-parallel; GQA groups stay whole)
    w_o [H*d, D]                  rows, by query heads           (row-parallel)
    mlp.w_gate, mlp.w_up [D, F]   columns                        (column-parallel)
    mlp.w_down [F, D]             rows                           (row-parallel)
    attn_norm, q_norm, k_norm, mlp.norm, mlp_norm, moe.router: replicated
    GPT: embed.table [V, D] rows and head.w [D, V] columns by vocabulary (vocab-parallel); norm and the
    MTP's norms and w_proj replicated (`shard_gpt`)

One table (`SPLITS`), read by the block's functions to check a shard and by `shard_block` to cut one
(tests now; sharded initialisation and checkpoints across tp layouts next, issue 32). The routed
experts are not here: tensor parallelism extends expert parallelism for them (fmoe/parallel/tp_extends_ep.py).
"""

from __future__ import annotations

from typing import Any

from fmoe.config import GPTConfig

# path in a block's params -> (the axis split, the unit it is split in)
SPLITS: dict[tuple[str, ...], tuple[int, str]] = {
    ("w_q",): (1, "heads"), ("w_k",): (1, "kv_heads"), ("w_v",): (1, "kv_heads"), ("w_o",): (0, "heads"),
    ("mlp", "w_gate"): (1, "ffn"), ("mlp", "w_up"): (1, "ffn"), ("mlp", "w_down"): (0, "ffn"),
}


# the vocabulary-parallel GPT leaves -> the axis of their vocabulary (table rows, head columns)
VOCAB_SPLITS: dict[tuple[str, ...], int] = {("embed", "table"): 0, ("head", "w"): 1}


def _units(cfg: GPTConfig) -> dict[str, tuple[int, int]]:
    """unit -> (how many, width of one): heads of head_dim columns, the dense ffn one column each."""
    return {"heads": (cfg.n_heads, cfg.head_dim), "kv_heads": (cfg.n_kv_heads, cfg.head_dim),
            "ffn": (cfg.d_ff_dense, 1)}


def check_tp(cfg: GPTConfig, size: int, dense: bool) -> None:
    """Raises ValueError naming what `size` tensor-parallel ranks do not split: the query heads, the kv
    heads, or (`dense`) the dense ffn width."""
    for unit, (n, _) in _units(cfg).items():
        if unit == "ffn" and not dense:
            continue
        if n % size:
            what = unit.replace("_", " ")
            raise ValueError(f"tensor parallelism over {size} ranks: {n} {what} do not split evenly")


def _at(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def split_units(cfg: GPTConfig, path: tuple[str, ...]) -> tuple[int, int, int]:
    """Returns (axis, n, width) of the split weight at `path` of a block: it is cut along `axis` into `n`
    units (heads, ffn columns) of `width` entries each, which the tp ranks share out whole."""
    axis, unit = SPLITS[path]
    n, width = _units(cfg)[unit]
    return axis, n, width


def shard_slice(cfg: GPTConfig, path: tuple[str, ...], rank: int, size: int) -> tuple[int, slice]:
    """Returns (axis, slice) of rank `rank`'s part of the split weight at `path` of a block."""
    axis, n, width = split_units(cfg, path)
    per = n // size * width
    return axis, slice(rank * per, (rank + 1) * per)


def shard_block(params: dict[str, Any], cfg: GPTConfig, rank: int, size: int) -> dict[str, Any]:
    """Returns the params tp rank `rank` of `size` holds of a block's `params` (the module docstring's
    table): split weights sliced (contiguous copies), everything else the same tensors."""
    dense = "mlp" in params
    check_tp(cfg, size, dense)
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}
    for path in SPLITS:
        if path[0] == "mlp" and not dense:
            continue
        axis, part = shard_slice(cfg, path, rank, size)
        node = out
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = _at(params, path).narrow(axis, part.start, part.stop - part.start).contiguous()
    return out


def _full_shape(cfg: GPTConfig, path: tuple[str, ...]) -> tuple[int, int]:
    D, Hd, Gd, F = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff_dense
    return {("w_q",): (D, Hd), ("w_k",): (D, Gd), ("w_v",): (D, Gd), ("w_o",): (Hd, D),
            ("mlp", "w_gate"): (D, F), ("mlp", "w_up"): (D, F), ("mlp", "w_down"): (F, D)}[path]


def check_shard(params: dict[str, Any], cfg: GPTConfig, size: int,
                paths: tuple[tuple[str, ...], ...]) -> None:
    """Raises ValueError naming a split weight among `paths` (those of `SPLITS` that `params` holds) whose
    shape is not a 1/`size` shard of its full shape."""
    for path in paths:
        if path not in SPLITS:
            continue
        try:
            w = _at(params, path)
        except (KeyError, TypeError):
            continue
        axis, part = shard_slice(cfg, path, 0, size)
        want = list(_full_shape(cfg, path))
        want[axis] = part.stop - part.start
        if list(w.shape) != want:
            raise ValueError(f"{'.'.join(path)}: the shard of tp rank of {size} is {tuple(want)}, got "
                             f"{tuple(w.shape)}")


def shard_gpt(params: dict[str, Any], cfg: GPTConfig, rank: int, size: int) -> dict[str, Any]:
    """Returns the GPT params tp rank `rank` of `size` holds (init_gpt's layout): every block's
    `shard_block`, the embedding's vocabulary rows and the head's vocabulary columns; the rest replicated
    (the same tensors). The routed experts stay whole: which of them a rank holds is expert parallelism's
    (TP extends EP). ValueError unless `size` splits the heads, kv heads, dense ffn and vocabulary."""
    if cfg.vocab_size % size:
        raise ValueError(f"tensor parallelism over {size} ranks: the vocabulary of {cfg.vocab_size} does not "
                         "split evenly")
    per = cfg.vocab_size // size
    out = dict(params)
    for (top, name), axis in VOCAB_SPLITS.items():
        out[top] = {**params[top], name: params[top][name].narrow(axis, rank * per, per).contiguous()}
    out["layers"] = [shard_block(p, cfg, rank, size) for p in params["layers"]]
    if "mtp" in params:
        out["mtp"] = {**params["mtp"], "block": shard_block(params["mtp"]["block"], cfg, rank, size)}
    return out


def tp_split_axis(where: tuple[str | int, ...]) -> int | None:
    """Returns the axis along which the GPT leaf at `where` (e.g. ("layers", 1, "w_q"), ("embed", "table"))
    is split over the tensor-parallel ranks (`SPLITS`, the vocabulary-parallel embedding and head), or
    None for a replicated leaf."""
    where = tuple(str(k) for k in where)
    if where in VOCAB_SPLITS:
        return VOCAB_SPLITS[where]
    if where[:1] == ("layers",):
        rel = where[2:]
    elif where[:2] == ("mtp", "block"):
        rel = where[2:]
    else:
        return None
    return SPLITS[rel][0] if rel in SPLITS else None
