"""The GPT's parameters, whole (`init_gpt`) or one rank's share of them (`init_gpt_shard`), drawn from
keyed seeds so that every layout gets the one-process run's weights and no rank holds more than its own.

    params = init_gpt(cfg, generator)                                   # the whole tree
    mine = init_gpt_shard(cfg, seed, tp=(1, 2), experts=(3, 4),         # tp rank 1 of 2, expert rank 3
                          holds=[("embed",), ("layers", "0")])          # of 4, the first layer only

The tree's shapes and how each tensor is drawn come from the model's init functions run on the meta
device (`gpt_spec`: no memory). Each tensor is then drawn in units (fmoe.init.draw_units): a tensor that
tensor parallelism splits in units of its table (fmoe/tp_layout.py: heads, ffn columns, vocabulary rows),
the routed experts one expert at a time, every other tensor whole; unit u of the tensor at "layers.3.w_q"
comes from the seed (seed, "layers.3.w_q", u) whoever draws it. So tp rank p draws the units of its part,
an expert rank its experts, a pipeline rank only the subtrees it `holds` (the others stay meta tensors:
shapes for the checks, no memory), and the share equals the same part of `init_gpt`'s tree.

Legend (the package's, docs/moe.md): D model width, V vocabulary, E routed experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fmoe.block import init_block
from fmoe.config import GPTConfig
from fmoe.init import Units, draw_units, init_seed, normal, ones, param_device, scaled_normal
from fmoe.outline import outline
from fmoe.tp_layout import SPLITS, VOCAB_SPLITS, block_path, split_units

Where = tuple[str | int, ...]


def _init_tree(cfg: GPTConfig, generator: torch.Generator | None, dtype: torch.dtype) -> dict[str, Any]:
    """The GPT tree of fmoe/model.py's docstring, made by the block and layer init functions."""
    D, V = cfg.d_model, cfg.vocab_size
    params: dict[str, Any] = {
        "embed": {"table": normal((V, D), 0.02, generator, dtype)},
        "layers": [init_block(cfg, generator, dtype, dense=not outline(cfg).layer(i).is_moe)
                   for i in range(cfg.n_layers)],
        "norm": ones(D, generator, dtype),
        "head": {"w": scaled_normal((D, V), D, generator, dtype)},
    }
    if cfg.mtp:
        params["mtp"] = {"hidden_norm": ones(D, generator, dtype), "embed_norm": ones(D, generator, dtype),
                         "w_proj": scaled_normal((2 * D, D), 2 * D, generator, dtype),
                         "block": init_block(cfg, generator, dtype), "norm": ones(D, generator, dtype)}
    return params


def gpt_spec(cfg: GPTConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Returns the GPT's parameter tree as meta tensors (shapes and dtypes, no memory), each tagged with
    how it is drawn (fmoe.init.init_of)."""
    with torch.device("meta"):
        return _init_tree(cfg, None, dtype)


def leaf_units(cfg: GPTConfig, where: Where) -> tuple[Units, str] | None:
    """Returns (units, group) of the GPT leaf at `where`: how its keyed draws cut it and which group
    shares the units out ("tp": tensor parallelism's table; "expert": the ep x tp expert group, one expert
    a unit), or None for a leaf drawn whole."""
    if tuple(where) in VOCAB_SPLITS:
        return Units(VOCAB_SPLITS[tuple(where)], cfg.vocab_size, 1), "tp"
    rel = block_path(where)
    if rel is None:
        return None
    if rel in SPLITS:
        return Units(*split_units(cfg, rel)), "tp"
    if rel[:2] == ("moe", "experts"):
        return Units(0, cfg.moe.num_experts, 1), "expert"
    return None


def _held(where: Where, holds: set[tuple[str, ...]] | None) -> bool:
    if holds is None:
        return True
    names = tuple(str(k) for k in where)
    return any(names[:len(h)] == h for h in holds)


def init_gpt_shard(cfg: GPTConfig, seed: int, dtype: torch.dtype = torch.float32, *,
                   tp: tuple[int, int] = (0, 1), experts: tuple[int, int] = (0, 1),
                   holds: Iterable[tuple[str, ...]] | None = None, device: torch.device | str | None = None,
                   draw_device: torch.device | str = "cpu") -> dict[str, Any]:
    """Returns the GPT tree of one rank: `tp` = (rank, size) takes the rank's part of each split tensor
    (fmoe.tp_layout.shard_gpt's cut), `experts` = (rank, size) its E / size routed experts (rows
    rank * E / size ..), `holds` (parameter paths such as ("layers", "3"), ("embed",); None: all) the
    subtrees it materialises, the rest left as meta tensors. Drawn on `draw_device` and placed on `device`
    (default: `draw_device`); the values equal the same part of `init_gpt` given `init_seed`'s seed.
    ValueError when a size does not split its units (heads, ffn, vocabulary, experts)."""
    wanted = None if holds is None else {tuple(str(k) for k in h) for h in holds}
    for name, share in (("tp", tp), ("experts", experts)):
        if not (isinstance(share, tuple) and len(share) == 2 and share[1] >= 1 and 0 <= share[0] < share[1]):
            raise ValueError(f"init_gpt_shard: {name} must be (rank, size) with size >= 1 and 0 <= rank < "
                             f"size, got {share!r}")
    spec = gpt_spec(cfg, dtype)
    shares = {"tp": tp, "expert": experts}
    if wanted is not None:
        paths: list[tuple[str, ...]] = []
        _rebuild(spec, (), lambda where, t: paths.append(tuple(str(k) for k in where)))
        missing = sorted(h for h in wanted if not any(p[:len(h)] == h for p in paths))
        if missing:  # a typo would leave every parameter a meta tensor, silently
            raise ValueError(f"init_gpt_shard: holds {missing} match no parameter path (they start with "
                             f"{sorted({p[0] for p in paths})}, e.g. ('layers', '0'))")

    def make(where: Where, t: torch.Tensor) -> torch.Tensor:
        if not _held(where, wanted):
            return t
        cut = leaf_units(cfg, where)
        key = ".".join(str(k) for k in where)
        if cut is None:
            return draw_units(t, key, seed, None, device=device, draw_device=draw_device)
        units, group = cut
        rank, size = shares[group]
        if units.n % size or not 0 <= rank < size:
            raise ValueError(f"{key}: its {units.n} units (heads, ffn columns, vocabulary rows or experts) "
                             f"do not split over {size} {group} ranks (rank {rank})")
        per = units.n // size
        return draw_units(t, key, seed, units, rank * per, per, device=device, draw_device=draw_device)

    return _rebuild(spec, (), make)


def _rebuild(node: Any, where: Where, make: Any) -> Any:
    if isinstance(node, dict):
        return {k: _rebuild(v, (*where, k), make) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, (*where, i), make) for i, v in enumerate(node)]
    return make(where, node)


def init_gpt(cfg: GPTConfig, generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Return the GPT parameter pytree (layout in fmoe/model.py's docstring), on the generator's device
    (fmoe/init.py): `init_gpt_shard` of everything, from a seed the generator draws (`init_seed`)."""
    device = param_device(generator) or torch.get_default_device()
    if device.type == "meta":  # shapes only (under `with torch.device("meta")`): nothing to draw
        return gpt_spec(cfg, dtype)
    return init_gpt_shard(cfg, init_seed(generator), dtype, device=device, draw_device=device)
