"""Gradients of weights that several pipeline ranks hold: summed across the holders, so every copy
takes the same update and the copies stay identical.

Which weights: the embedding table that the MTP module on the last stage reads next to the first stage,
the output head, and with DualPipe every chunk (held once per direction). A `SharedGrads` is built on
every rank from the same global list (path, holder ranks). A set of holders that is the whole pipeline
group reduces over that group; a smaller set gets its own process group, created by its members only
(local synchronisation), in the same order on each. Each set sums its leaves in one flat all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

Path = tuple[str, ...]


class SharedGrads:
    """Sums gradients of shared weights across the pipeline ranks that hold them.

    `holders[path]`: the pipeline ranks (in `group`) whose stages hold the weights at `path` (a key path
    into the nested parameter dicts: a leaf or a subtree, whose leaves every holder has); paths held by
    one rank are ignored."""

    def __init__(self, holders: Mapping[Path, Sequence[int]], group: dist.ProcessGroup | None = None):
        self.group = group
        by_set: dict[tuple[int, ...], list[Path]] = {}
        for path in sorted(holders):
            ranks = tuple(sorted(set(holders[path])))
            if len(ranks) > 1:
                by_set.setdefault(ranks, []).append(path)
        self.me = dist.get_rank(group)
        size = dist.get_world_size(group)
        self.sets: list[tuple[tuple[int, ...], list[Path], dist.ProcessGroup | None]] = []
        for ranks, paths in sorted(by_set.items()):
            if self.me not in ranks:
                continue
            if len(ranks) == size:  # every pipeline rank holds it: the pipeline group itself
                sub = group
            else:
                # Only the holders create it (local synchronisation): several pipeline groups (one per
                # data- / expert-parallel position) build theirs at once without a world-wide barrier.
                members = [dist.get_global_rank(group, r) if group is not None else r for r in ranks]
                sub = dist.new_group(members, use_local_synchronization=True)
            self.sets.append((ranks, paths, sub))

    def reduce(self, grads: dict[str, Any]) -> None:
        """Sums, in place, the gradients at the shared paths of `grads` (nested dicts) across their holders;
        returns None. Raises KeyError naming a shared path this rank should hold but has no gradient for."""
        for _ranks, paths, sub in self.sets:
            leaves = [g for p in paths for g in _leaves(_node(grads, p))]
            flat = torch.cat([g.reshape(-1) for g in leaves])
            dist.all_reduce(flat, group=sub)
            offset = 0
            for g in leaves:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _node(tree: Mapping[str, Any], path: Path) -> Any:
    node: Any = tree
    for k in path:
        if not isinstance(node, Mapping) or k not in node:
            raise KeyError(f"shared weight {'.'.join(path)!r} has no gradient on this rank")
        node = node[k]
    return node


def _leaves(node: Any) -> list[torch.Tensor]:
    """The tensors of a gradient subtree, in sorted-key order (the same on every holder)."""
    if isinstance(node, Mapping):
        return [g for k in sorted(node) for g in _leaves(node[k])]
    return [node]
