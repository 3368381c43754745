"""op_bytes: the bytes each aten op reads and writes while a function runs (its forward and backward).

    counts = op_bytes(lambda: loss_and_grads(...))      # {op name: bytes}, GEMMs and views left out
    glue = sum(counts.values())

What is counted: for every aten op a dispatch mode sees, the bytes of its tensor inputs plus its tensor
outputs, with three rules that keep the count near what the op moves:
- GEMMs (mm, addmm, bmm, baddbmm, _grouped_mm, their out= and in-place forms) are left out: this counts
  the traffic *around* the matrix products;
- views and metadata ops (view, transpose, expand, slice, detach, ...) move nothing and are left out;
- a gather (index_select, gather, embedding) reads only the rows it returns, so its source counts as its
  output's bytes, not the whole source; its index counts in full;
- a bag sum (embedding_bag, and its per-sample-weight backward) reads one table row per index, so its
  table counts as that many rows (all of it once for a permutation, a token row once per slot for a
  gather of K slots); the per-sample-weight backward reads each bag's gradient row for the bag's
  consecutive entries, so that input counts once, in full.
An in-place op counts its destination twice (read and written), as any elementwise op does; an out=
op's destination counts once (written, not read); an allocation (empty, empty_like) moves nothing.
Runs on the meta device too (shapes only): the count of a large layer without its memory or time.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fmoe._compat import tree_flatten

GEMMS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "_grouped_mm", "matmul"})
GATHERS = frozenset({"index_select", "gather", "embedding"})
BAG_TABLES = {"_embedding_bag": 0, "_embedding_bag_forward_only": 0,
              "_embedding_bag_per_sample_weights_backward": 1}  # op -> position of its table
BAG_INDICES = {"_embedding_bag": 1, "_embedding_bag_forward_only": 1,
               "_embedding_bag_per_sample_weights_backward": 2}  # op -> position of its indices


def _moves_nothing(func: Any) -> bool:
    return func.is_view or torch.Tag.view_copy in func.tags or func.overloadpacket.__name__ in (
        "detach", "alias", "lift_fresh", "_to_copy_noop", "empty", "empty_like", "empty_strided", "new_empty")


def _read(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The values an op reads: its arguments but an out= overload's destinations (written only)."""
    outs = {a.name for a in func._schema.arguments if a.is_out}
    return list(args) + [v for k, v in kwargs.items() if k not in outs] if outs else [*args, kwargs]


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class OpBytes(TorchDispatchMode):
    """A dispatch mode summing, per aten op name, the bytes its inputs and outputs move (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in GEMMS or _moves_nothing(func):
            return out
        outputs = sum(_bytes(t) for t in tree_flatten(out)[0])
        read = tree_flatten(_read(func, args, kwargs))[0]
        if name in GATHERS:
            inputs = outputs + sum(_bytes(t) for t in read
                                   if isinstance(t, torch.Tensor) and not t.is_floating_point())
        elif name in BAG_TABLES:
            table, index = args[BAG_TABLES[name]], args[BAG_INDICES[name]]
            rows_read = index.numel() * (_bytes(table) // max(table.shape[0], 1))
            inputs = sum(_bytes(t) for t in read) - _bytes(table) + rows_read
        else:
            inputs = sum(_bytes(t) for t in read)
        self.by_op[name] += inputs + outputs
        return out


def op_bytes(fn: Callable[[], Any]) -> dict[str, int]:
    """Run fn() under `OpBytes`; returns {aten op name: bytes read + written}, GEMMs and views left out."""
    with OpBytes() as mode:
        fn()
    return dict(mode.by_op)
