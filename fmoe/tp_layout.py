"""Tensor-parallel layout of a transformer block: which weight is split how over the tp ranks (Megatron's).

Legend (the package's, docs/moe.md): D model width, H query heads, G kv heads, d head dim, F the dense
block's ffn width, P tensor-parallel ranks; rank p holds the p-th of P equal parts.

    w_q [D, H*d]                  columns, by query heads        (column-parallel)
    w_k, w_v [D, G*d]             columns, by kv heads           (column-parallel; GQA groups stay whole)
    w_o [H*d, D]                  rows, by query heads           (row-parallel)
    mlp.w_gate, mlp.w_up [D, F]   columns                        (column-parallel)
    mlp.w_down [F, D]             rows                           (row-parallel)
    attn_norm, q_norm, k_norm, mlp.norm, mlp_norm, moe.router: replicated
  multi-head latent attention (cfg.mla, fmoe/mla.py: k = d + r a head's qk width, e its value width):
    w_q_b [Q, H*k], w_q [D, H*k]  columns, by heads of k           (column-parallel)
    w_kv_b [C, H*(d+e)]           columns, by heads of d + e       (column-parallel)
    w_o [H*e, D]                  rows, by heads of e              (row-parallel)
    w_q_a, q_a_norm, w_kv_a, kv_a_norm: replicated (the down projections and their latents' norms)
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
    ("w_q",): (1, "heads"), ("w_k",): (1, "kv_heads"), ("w_v",): (1, "kv_heads"), ("w_o",): (0, "o_heads"),
    ("w_q_b",): (1, "heads"), ("w_kv_b",): (1, "kv_b_heads"),
    ("mlp", "w_gate"): (1, "ffn"), ("mlp", "w_up"): (1, "ffn"), ("mlp", "w_down"): (0, "ffn"),
}
# the split leaves of multi-head latent attention (cfg.mla) and of grouped-query attention
_MLA_ONLY = (("w_q_b",), ("w_kv_b",))
_GQA_ONLY = (("w_k",), ("w_v",))


# the vocabulary-parallel GPT leaves -> the axis of their vocabulary (table rows, head columns)
VOCAB_SPLITS: dict[tuple[str, ...], int] = {("embed", "table"): 0, ("head", "w"): 1}


def _units(cfg: GPTConfig) -> dict[str, tuple[int, int]]:
    """unit -> (how many, width of one): query heads of their qk width (w_q, w_q_b), of their output width
    (w_o), kv heads (GQA) or heads of their key + value width (w_kv_b, MLA), the dense ffn one column
    each. Without MLA every head is head_dim wide."""
    units = {"heads": (cfg.n_heads, cfg.qk_head_dim), "o_heads": (cfg.n_heads, cfg.o_head_dim),
             "ffn": (cfg.d_ff_dense, 1)}
    if cfg.mla:
        units["kv_b_heads"] = (cfg.n_heads, cfg.head_dim + cfg.o_head_dim)
    else:
        units["kv_heads"] = (cfg.n_kv_heads, cfg.head_dim)
    return units


def split_paths(cfg: GPTConfig, dense: bool) -> tuple[tuple[str, ...], ...]:
    """Returns the paths of `SPLITS` that a block under `cfg` holds (`dense`: a dense block, with "mlp")."""
    if cfg.mla:  # w_q_b with a query latent, else w_q
        absent = _GQA_ONLY + ((("w_q",),) if cfg.q_lora_rank else (("w_q_b",),))
    else:
        absent = _MLA_ONLY
    return tuple(p for p in SPLITS if p not in absent and (dense or p[0] != "mlp"))


def check_tp(cfg: GPTConfig, size: int, dense: bool) -> None:
    """Raises ValueError naming what `size` tensor-parallel ranks do not split: the query heads, the kv
    heads, or (`dense`) the dense ffn width."""
    for unit, (n, _) in _units(cfg).items():
        if unit == "ffn" and not dense:
            continue
        if n % size:
            what = {"o_heads": "heads", "kv_b_heads": "heads"}.get(unit, unit).replace("_", " ")
            raise ValueError(f"tensor parallelism over {size} ranks: {n} {what} do not split evenly")


def _at(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def split_units(cfg: GPTConfig, path: tuple[str, ...]) -> tuple[int, int, int]:
    """Returns (axis, n, width) of the split weight at `path` of a block: it is cut along `axis` into `n`
    units (heads, ffn columns) of `width` entries each, which the tp ranks share out whole. ValueError
    for a path that `cfg`'s blocks have no split weight at (w_k under MLA, w_kv_b under GQA, ...)."""
    axis, unit = SPLITS[path]
    units = _units(cfg)
    if path[0] != "mlp" and path not in split_paths(cfg, dense=False):
        raise ValueError(f"{'.'.join(path)}: no split weight of a block of this config "
                         f"({'multi-head latent' if cfg.mla else 'grouped-query'} attention)")
    n, width = units[unit]
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
    for path in split_paths(cfg, dense):
        axis, part = shard_slice(cfg, path, rank, size)
        node = out
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = _at(params, path).narrow(axis, part.start, part.stop - part.start).contiguous()
    return out


def _full_shape(cfg: GPTConfig, path: tuple[str, ...]) -> tuple[int, int]:
    D, F, H = cfg.d_model, cfg.d_ff_dense, cfg.n_heads
    Hk, He, Gd = H * cfg.qk_head_dim, H * cfg.o_head_dim, cfg.n_kv_heads * cfg.head_dim
    return {("w_q",): (D, Hk), ("w_k",): (D, Gd), ("w_v",): (D, Gd), ("w_o",): (He, D),
            ("w_q_b",): (cfg.q_lora_rank, Hk),
            ("w_kv_b",): (cfg.kv_lora_rank, H * (cfg.head_dim + cfg.o_head_dim)),
            ("mlp", "w_gate"): (D, F), ("mlp", "w_up"): (D, F), ("mlp", "w_down"): (F, D)}[path]


def check_shard(params: dict[str, Any], cfg: GPTConfig, size: int,
                paths: tuple[tuple[str, ...], ...]) -> None:
    """Raises ValueError naming a split weight among `paths` (those of `SPLITS` that `params` holds) whose
    shape is not a 1/`size` shard of its full shape."""
    for path in paths:
        if path not in SPLITS or (path[0] != "mlp" and path not in split_paths(cfg, dense=False)):
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


def block_path(where: tuple[str | int, ...]) -> tuple[str, ...] | None:
    """Returns the path inside its block of the GPT leaf at `where` (("layers", 1, "w_q") -> ("w_q",); the
    MTP block's too), or None for a leaf outside the blocks."""
    where = tuple(str(k) for k in where)
    if where[:1] == ("layers",) or where[:2] == ("mtp", "block"):
        return where[2:]
    return None


def tp_split_axis(where: tuple[str | int, ...]) -> int | None:
    """Returns the axis along which the GPT leaf at `where` (e.g. ("layers", 1, "w_q"), ("embed", "table"))
    is split over the tensor-parallel ranks (`SPLITS`, the vocabulary-parallel embedding and head), or
    None for a replicated leaf."""
    names = tuple(str(k) for k in where)
    if names in VOCAB_SPLITS:
        return VOCAB_SPLITS[names]
    rel = block_path(where)
    return SPLITS[rel][0] if rel in SPLITS else None


def tp_partial(where: tuple[str | int, ...], sequence_parallel: bool) -> bool:
    """True when the GPT leaf at `where` is a replicated weight whose use leaves each tensor-parallel rank
    a partial gradient (`fmoe.parallel.tensor.tp_weight`: summed over the group in every backward, or
    once per step): the router and the shared expert of an MoE layer (each rank routes its share of the
    tokens), the q / k norms (each rank's heads), and under sequence parallelism every other replicated
    weight (each rank's positions). Not the routed experts (TP extends EP: each rank's own)."""
    rel = block_path(where)
    if rel is not None:
        if rel[:2] == ("moe", "experts"):
            return False
        if rel[:2] in (("moe", "router"), ("moe", "shared")) or rel in (("q_norm",), ("k_norm",)):
            return True
    return sequence_parallel and tp_split_axis(where) is None
