"""The executor's options: one record, built once per run, handed to every step.

    opts = ExecOptions(overlap=True, engine="autograd", timeout=timedelta(seconds=120))
    execute(s, rank, programs, data, group=pp_group, options=opts)
    execute(..., options=dataclasses.replace(opts, loss_scale=scale))   # what changes from step to step

Each field is documented where the executor reads it (fmoe.schedule.execute.execute's docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

ENGINES = ("autograd", "func")


@dataclass(frozen=True)
class ExecOptions:
    """How the executor runs a step (see `execute`): `overlap` fb overlap of F&B pairs and lone Bs;
    `engine` how compute phases are differentiated; `timeout` bounds every P2P wait; `recv_ahead` compute
    actions a receive is posted before its consumer; `grad_dtype` the dtype weight gradients are summed in
    over microbatches; `loss_scale` the backward's seed factor (fp16 loss scaling); `fuse_iw` run an I
    whose W comes next as one B; `compute_model` hold each compute phase to a modelled duration (None:
    off); `device` where receive buffers and loss sums live (None: the stages' parameters'); `trace` record
    the step's timeline (StepResult.events; False: none, and none of its cost); `compiled` run every compute
    phase as three compiled graphs, forward, dx and dw (fmoe.transforms.compiled.CompiledPhases, made once
    per run so that each phase is traced once; None: split_vjp, eagerly); `early_recv` post a receive as
    soon as it is asked for, past the wire order (None: where the transport matches by tag, gloo:
    fmoe.schedule.wire.tag_matched; True on NCCL or HCCL would hang)."""

    overlap: bool = True
    engine: str = "autograd"
    timeout: timedelta = timedelta(seconds=120)
    recv_ahead: int = 4
    grad_dtype: torch.dtype | None = None
    loss_scale: float = 1.0
    fuse_iw: bool = True
    compute_model: Any = None
    device: torch.device | None = None
    trace: bool = True
    compiled: Any = None
    early_recv: bool | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ValueError(f"execute: loss_scale must be a positive finite number, got {self.loss_scale}")
        if self.engine not in ENGINES:
            raise ValueError(f"execute: engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not isinstance(self.recv_ahead, int) or self.recv_ahead < 1:
            raise ValueError(f"execute: recv_ahead must be a positive int, got {self.recv_ahead!r}")


DEFAULTS = ExecOptions()  # what `execute` runs with when given no options
