"""TP extends EP (MISSION.md feature 21): the tp ranks split the *number* of experts, not their weights.

Legend (the package's, docs/moe.md): E global experts, L = E / (tp * ep) experts per rank.

Each rank of the ep x tp expert group owns L whole experts, so each grouped GEMM keeps full-size
weights. Tokens are exchanged over the whole expert group (ParallelLayout.group("expert")); the tokens
of the tp ranks must be distinct (sequence-parallel input), as each rank dispatches its own.
"""

from __future__ import annotations


def experts_per_rank(num_experts: int, tp: int, ep: int) -> int:
    """Return L = num_experts // (tp * ep); ValueError unless tp * ep divides num_experts."""
    if tp < 1 or ep < 1:
        raise ValueError(f"tp ({tp}) and ep ({ep}) must be >= 1")
    if num_experts % (tp * ep):
        raise ValueError(f"TP-extends-EP: num_experts ({num_experts}) must be divisible by tp x ep "
                         f"({tp} x {ep} = {tp * ep}); each of the {tp * ep} ranks owns whole experts")
    return num_experts // (tp * ep)


def local_expert_range(num_experts: int, tp: int, ep: int, expert_rank: int) -> range:
    """Global ids of the experts owned by rank `expert_rank` (0 <= expert_rank < tp * ep) of the group."""
    per = experts_per_rank(num_experts, tp, ep)
    if not 0 <= expert_rank < tp * ep:
        raise ValueError(f"expert_rank {expert_rank} outside the expert group of {tp * ep} ranks")
    return range(expert_rank * per, (expert_rank + 1) * per)
