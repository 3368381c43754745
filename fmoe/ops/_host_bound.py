"""Small glue under tape autograd: aten's own differentiable ops where a Python autograd Function costs
more host time than the passes it saves.

    if host_bound(x_TD, rows_RD_numel): ...aten composition, autograd's C++ backward...
    else: ...the op's Function (one-pass bag sums, donated buffers)...

fmoe's glue Functions (permute, unpermute, the packed SwiGLU) exist for bytes: each direction is one
gather or one bag sum, and a donated buffer takes a gradient where a new one would fault. Their price is
host time: a Python forward and a Python backward per call, run between the layer's GEMMs, which have
evicted the caches the interpreter's objects live in. At the pipeline benchmark's shapes (rows of 512 KiB)
that costs more than the passes save: its model with aten's gather, product and sum in their place took
1-2% less CPU per training step, with rows of 2 MiB 1% less, with rows of 8 MiB 0.7% more
(benchmarks/host_bound_glue.py; BENCHMARKS.md, "Small glue as aten ops"). Below HOST_BOUND_BYTES of rows
the public ops run the aten composition, under plain tape autograd only (torch.func and traced graphs keep
the Functions, whose rules they read), on devices whose aten gather backward (index_add) is deterministic
and for dtypes the composition computes as the op states (fp32 and fp64: half precision keeps the bag
sums' fp32 accumulation). The values are the Functions' to rounding (the K slots summed in another order).
"""

from __future__ import annotations

import torch

from fmoe._compat import functorch_active, is_tracing

ATEN_GLUE_DEVICES: tuple[str, ...] = ("cpu",)
"""Device types where the glue may run as aten ops: aten's index_add (an index_select's backward) adds in
index order on the CPU; on CUDA it adds with atomics, in no fixed order (fmoe's glue stays deterministic
there). Tests empty it to check the device path on CPU."""

HOST_BOUND_BYTES = 8 << 20
"""Rows smaller than this (bytes) are moved by aten ops under tape autograd (module docstring): aten was
ahead with permuted rows of 2 MiB and gate | up of 4 MiB, the Functions with 8 MiB and 16 MiB."""


def host_bound(x: torch.Tensor, rows_numel: int) -> bool:
    """Whether a glue op on `x` whose rows (the larger side it reads or writes) hold `rows_numel` elements
    of x's dtype runs as aten's own differentiable ops: plain tape autograd or none (no torch.func
    transform, no trace), x on an ATEN_GLUE_DEVICES device, fp32 or fp64, rows under HOST_BOUND_BYTES."""
    return (x.device.type in ATEN_GLUE_DEVICES and x.dtype in (torch.float32, torch.float64)
            and rows_numel * x.element_size() < HOST_BOUND_BYTES
            and not functorch_active() and not is_tracing())
