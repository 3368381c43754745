"""Gradients of weights that several pipeline ranks hold: summed across the holders, so every copy
takes the same update and the copies stay identical.

Which weights: the embedding table that the MTP module on the last stage reads next to the first stage,
the output head, and with DualPipe every chunk (held once per direction). A `SharedGrads` is built on
every rank from the same global list (path, holder ranks). A set of holders that is the whole pipeline
group sums its leaves in one flat all-reduce over that group. A smaller set exchanges its flat buffer
point to point over the pipeline group (`_sum_among`: in an order NCCL's matching runs) and each holder
adds the copies in rank order, so every holder gets the same bits. Not a process group of its own:
torch names a group created by its members only (`use_local_synchronization`) after how many groups
each member already has (`_hash_ranks_to_str`), so members with different histories (rank 0 holding
the embedding with rank 3, then the head with rank 1) wait forever on names that differ. The sets are
taken in one global order, the same on every rank, so no two holders wait on each other in a cycle.
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
        # (holder ranks in `group`, paths, whether the set is the whole group)
        self.sets: list[tuple[tuple[int, ...], list[Path], bool]] = [
            (ranks, paths, len(ranks) == size) for ranks, paths in sorted(by_set.items()) if self.me in ranks]

    def reduce(self, grads: dict[str, Any]) -> None:
        """Sums, in place, the gradients at the shared paths of `grads` (nested dicts) across their holders;
        returns None. Raises KeyError naming a shared path this rank should hold but has no gradient for."""
        for ranks, paths, whole in self.sets:
            leaves = [g for p in paths for g in _leaves(_node(grads, p))]
            flat = torch.cat([g.reshape(-1) for g in leaves])
            if whole:
                dist.all_reduce(flat, group=self.group)
            else:
                flat = self._sum_among(ranks, flat)
            offset = 0
            for g in leaves:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def _sum_among(self, ranks: tuple[int, ...], flat: torch.Tensor) -> torch.Tensor:
        """Returns the sum of every holder's `flat` [N] (the holders `ranks` in `group`), added in rank order.
        The copies travel point to point, peers in rank order, the lower rank of a pair sending first and
        the higher receiving first: NCCL runs a pair's sends and receives on one stream in issue order, a
        send finishing only with its receive, so two ranks both sending first would wait on each other."""
        copies = {r: flat if r == self.me else torch.empty_like(flat) for r in ranks}
        works = []
        for r in ranks:
            if r == self.me:
                continue
            peer = dist.get_global_rank(self.group, r) if self.group is not None else r
            pair = [(dist.isend, flat), (dist.irecv, copies[r])]
            for issue, buf in pair if self.me < r else pair[::-1]:
                works.append(issue(buf, peer, group=self.group))
        for work in works:
            work.wait()
        total = copies[ranks[0]].clone()
        for r in ranks[1:]:
            total += copies[r]
        return total


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
