"""The parallel context of the model's functions: one record for how a layer is laid over ranks.

    par = ParallelContext(tp=CommGroup(tp_group), sequence_parallel=True, dispatcher=AllToAllDispatcher(...))
    loss, aux = gpt_loss(params, ids_BS, targets_BS, cfg, state, parallel=par)

`tp`: the tensor-parallel group (params are this rank's shards, fmoe/tp_layout.py); `sequence_parallel`:
the hidden state between layers is this rank's positions [B, S/P, D] (needs `tp`); `dispatcher`: the
exchange an MoE layer's rows travel through (None: `LocalDispatcher`, every expert in this process; under
tensor parallelism its group is the ep x tp expert group, TP extending EP). The model's functions take
the record whole and read what they need, so a new axis joins here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fmoe.dispatch.local import LocalDispatcher
from fmoe.parallel.collectives import CommGroup


@dataclass(frozen=True)
class ParallelContext:
    """How the model's functions are laid over ranks (module docstring). The default is one process."""

    tp: CommGroup | None = None
    sequence_parallel: bool = False
    dispatcher: Any = None

    def __post_init__(self) -> None:
        if self.sequence_parallel and self.tp is None:
            raise ValueError("sequence parallelism needs a tensor-parallel group (tp=)")

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
