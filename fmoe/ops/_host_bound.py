"""Small glue under tape autograd: aten's own differentiable ops where a Python autograd Function costs
more host time than the passes it saves.

    if host_bound(x_TD, rows_RD_numel): ...aten composition, autograd's C++ backward...
    else: ...the op's Function (one-pass bag sums, donated buffers)...

fmoe's glue Functions (permute, unpermute, the packed SwiGLU) exist for bytes: each direction is one
gather or one bag sum, and a donated buffer takes a gradient where a new one would fault. Their price is
host time: a Python forward and a Python backward per call, run between the layer's GEMMs, which have
evicted the caches the interpreter's objects live in. At the pipeline benchmark's shapes (rows of 512 KiB)
that costs more than the passes save: the layer with aten's gather-multiply-sum in their place took 1.5%
less CPU per training step, and from rows of 2 MiB the two forms were even (BENCHMARKS.md, "Small glue
as aten ops"). Below HOST_BOUND_BYTES of rows the public ops run the aten composition, under plain tape
autograd only (torch.func and traced graphs keep the Functions, whose rules they read), on devices whose
aten gather backward (index_add) is deterministic and for dtypes the composition computes exactly as the
op states (fp32 and fp64: half precision keeps the bag sums' fp32 accumulation).
"""

from __future__ import annotations

import torch

from fmoe._compat import functorch_active, is_tracing

ATEN_GLUE_DEVICES: tuple[str, ...] = ("cpu",)
"""Device types where the glue may run as aten ops: aten's index_add (an index_select's backward) adds in
index order on the CPU; on CUDA it adds with atomics, in no fixed order (fmoe's glue stays deterministic
there). Tests empty it to check the device path on CPU."""

HOST_BOUND_BYTES = 2 << 20
"""Rows smaller than this (bytes) are moved by aten ops under tape autograd (module docstring): the size
from which the two forms measured even (aten ahead at 512 KiB of permuted rows and 1 MiB of gate | up)."""


def host_bound(x: torch.Tensor, rows_numel: int) -> bool:
    """Whether a glue op on `x` whose rows (the larger side it reads or writes) hold `rows_numel` elements
    of x's dtype runs as aten's own differentiable ops: plain tape autograd or none (no torch.func
    transform, no trace), x on an ATEN_GLUE_DEVICES device, fp32 or fp64, rows under HOST_BOUND_BYTES."""
    return (x.device.type in ATEN_GLUE_DEVICES and x.dtype in (torch.float32, torch.float64)
            and rows_numel * x.element_size() < HOST_BOUND_BYTES
            and not functorch_active() and not is_tracing())
