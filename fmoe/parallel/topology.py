"""Where ranks sit: the link classes, which consecutive global ranks share a node (`Topology`), and the
layout rules that need no process group (`check_layout`). Plain values: the layout (fmoe.parallel.mesh), the
collectives, the counters, the link model and the planner (fmoe.plan.layout) all read them from here.

Legend (the package's, docs/moe.md): P ranks in a group, A nodes a group spans, I ranks of that group per
node.

`Topology` says how many consecutive global ranks share a node, so 4 local processes can play
2 nodes x 2 ranks: the link class of a transfer (intra-node / inter-node) comes from it, and so do the
node-level groups of the hierarchical dispatcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

INTRA = "intra"  # link class: both ranks on one node
INTER = "inter"  # link class: ranks on different nodes
LINK_CLASSES = (INTRA, INTER)


@dataclass(frozen=True)
class Topology:
    """`ranks_per_node` consecutive global ranks share a node (real or simulated)."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"Topology: world size {self.world_size} is not a multiple of "
                             f"ranks_per_node {self.ranks_per_node}")

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """Return the node that global `rank` lives on."""
        return rank // self.ranks_per_node

    def link_class(self, src: int, dst: int) -> str:
        """Return INTRA or INTER for a transfer between global ranks `src` and `dst`."""
        return INTRA if self.node_of(src) == self.node_of(dst) else INTER

    @classmethod
    def from_env(cls, world_size: int) -> Topology:
        """The real topology of `world_size` ranks: LOCAL_WORLD_SIZE (set by torchrun) ranks per node, else
        one node."""
        return cls(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def check_layout(world_size: int, *, tp: int, ep: int, pp: int, dp: int, ranks_per_node: int,
                 cp: int = 1, ep_over_cp: bool = False) -> int:
    """Returns ep_intra, the expert-parallel ranks inside one node, after checking the layout rules that
    need no process group: tp x ep x pp x dp x cp == world size (`ep_over_cp`: tp x pp x dp x cp, with ep
    dividing dp x cp, Megatron's expert group carved from the data x context ranks), and the expert group
    (ep x tp consecutive ranks) either fits a node evenly or spans whole nodes with tp inside a node.
    Raises ValueError."""
    if min(tp, ep, pp, dp, cp, ranks_per_node) < 1:
        raise ValueError(f"ParallelLayout: sizes must be positive, got tp {tp} ep {ep} pp {pp} dp {dp} "
                         f"cp {cp} ranks_per_node {ranks_per_node}")
    if ep_over_cp:
        if (dp * cp) % ep:
            raise ValueError(f"ParallelLayout: ep {ep} must divide dp {dp} x cp {cp} = {dp * cp} (the expert "
                             f"group is carved from the data x context ranks)")
        if tp * pp * dp * cp != world_size:
            raise ValueError(f"ParallelLayout: tp {tp} x pp {pp} x dp {dp} x cp {cp} != world size "
                             f"{world_size} (ep {ep} is carved from dp x cp)")
    elif tp * ep * pp * dp * cp != world_size:
        raise ValueError(f"ParallelLayout: tp {tp} x ep {ep} x pp {pp} x dp {dp} x cp {cp} != world size "
                         f"{world_size}")
    Topology(world_size, ranks_per_node)  # ranks_per_node divides the world
    rpn = ranks_per_node
    if ep * tp <= rpn:
        if rpn % (ep * tp):
            raise ValueError(f"ParallelLayout: ep x tp = {ep * tp} does not divide ranks per node {rpn}")
        return ep
    if (ep * tp) % rpn or rpn % tp:
        raise ValueError(f"ParallelLayout: ep x tp = {ep * tp} must span whole nodes of {rpn} ranks "
                         f"with tp {tp} inside a node")
    return rpn // tp
