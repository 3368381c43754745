"""The parallel context of the model's functions: one record for how a layer is laid over ranks.

    par = ParallelContext(tp=CommGroup(tp_group), sequence_parallel=True, dispatcher=AllToAllDispatcher(...))
    loss, aux = gpt_loss(params, ids_BS, targets_BS, cfg, state, parallel=par)

`tp`: the tensor-parallel group (params are this rank's shards, fmoe/tp_layout.py); `sequence_parallel`:
the hidden state between layers is this rank's positions [B, S/P, D] (needs `tp`); `dispatcher`: the
exchange an MoE layer's rows travel through (None: `LocalDispatcher`, every expert in this process; under
tensor parallelism its group is the ep x tp expert group, TP extending EP); `cp`: the context-parallel
group, over which each sequence is split (fmoe/parallel/context_parallel.py: rank r holds chunks r and
2N-1-r of 2N; the hidden state is this rank's positions [B, S/N, D], token ids and targets stay whole),
`cp_comm_type` its attention's form ("p2p" ring, or "all_gather"; Megatron's --cp-comm-type). With both
`cp` and `tp` the sequence is split over cp and the heads over tp (the cp group: the ranks of one tp index);
with sequence parallelism too, each tp rank holds 1/P of its cp rank's positions. The dispatcher's group
may span cp ranks (the expert group laid over data x context ranks, as Megatron carves EP): each rank
routes its own positions and sends them to whichever rank holds the expert. The model's
functions take the record whole and read what they need, so a new axis joins here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fmoe.dispatch.local import LocalDispatcher
from fmoe.parallel.collectives import CommGroup
from fmoe.parallel.context_parallel import KINDS, cp_positions


@dataclass(frozen=True)
class ParallelContext:
    """How the model's functions are laid over ranks (module docstring). The default is one process."""

    tp: CommGroup | None = None
    sequence_parallel: bool = False
    dispatcher: Any = None
    cp: CommGroup | None = None
    cp_comm_type: str = "p2p"

    def __post_init__(self) -> None:
        if self.sequence_parallel and self.tp is None:
            raise ValueError("sequence parallelism needs a tensor-parallel group (tp=)")
        if self.cp_comm_type not in KINDS:
            raise ValueError(f"cp_comm_type must be one of {', '.join(KINDS)}, got {self.cp_comm_type!r}")

    @property
    def cp_size(self) -> int:
        """The context-parallel group's size (1 without one)."""
        return 1 if self.cp is None else self.cp.size

    def positions(self, S: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """This rank's positions of a length-S sequence under context parallelism (None without it)."""
        return None if self.cp is None else cp_positions(S, self.cp.rank, self.cp.size, device)

    @property
    def tp_size(self) -> int:
        """The tensor-parallel group's size (1 without one)."""
        return 1 if self.tp is None else self.tp.size

    @property
    def joined_tp(self) -> CommGroup | None:
        """The group an MoE block joins its tokens over before the residual: `tp` when each rank routed
        a share of replicated tokens, None under sequence parallelism (each rank keeps its positions)."""
        return None if self.sequence_parallel else self.tp

    def exchange(self, num_experts: int) -> Any:
        """Returns the dispatcher MoE rows travel through: `dispatcher`, or a LocalDispatcher of
        `num_experts` experts."""
        return self.dispatcher if self.dispatcher is not None else LocalDispatcher(num_experts)


LOCAL = ParallelContext()  # one process: no tensor parallelism, every expert local
