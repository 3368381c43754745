"""Donated buffers: an op whose caller hands an input over (JAX's donate_argnums) writes a gradient over
that input's memory in its backward, once nothing reads the input any more, instead of into a new buffer.

    if ctx.donate and may_donate(): ...write over the saved input...
    if t.device.type in FRESH_BUFFERS_FAULT: ...one more pass into the donated buffer beats a new one...

fmoe's MoE layer donates what it makes and reads nowhere else (the experts' gate | up rows, the rows
its combine hands back); public ops donate nothing unless asked. A node that saved a donated tensor
too fails loudly at its backward (autograd's saved-version check), never silently.
"""

from __future__ import annotations

import torch

from fmoe._compat import functorch_active, graph_kept, is_tracing

FRESH_BUFFERS_FAULT: tuple[str, ...] = ("cpu",)
"""Device types whose new buffers are paged in on first touch: CPU memory from the C allocator, where
glibc maps every block above 32 MiB afresh (even with `fmoe.train.host_memory.keep_freed_memory`) and
each 4 KiB page then faults and is zero-filled, several times the cost of one elementwise pass over it
(BENCHMARKS.md, "Donated buffers"). There, writing a result into a donated buffer pays even when it
takes one more pass; accelerators' caching allocators hand back mapped memory, so there it does not."""


ALWAYS_MAPPED_BYTES = 32 * 2**20
"""glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): a block at least this big is
mapped afresh at every allocation, so each new buffer that size faults page by page. A smaller block may
come back from the heap already paged in; there writing into a donated buffer saves nothing, and an op
that works one expert's rows at a time to avoid new buffers only adds host work (BENCHMARKS.md)."""


def new_buffer_faults(t: torch.Tensor, numel: int | None = None) -> bool:
    """Whether a new buffer the size of `t` (or of `numel` elements of t's dtype), on t's device, is paged
    in on first touch for sure (FRESH_BUFFERS_FAULT, at least ALWAYS_MAPPED_BYTES)."""
    n = t.numel() if numel is None else numel
    return t.device.type in FRESH_BUFFERS_FAULT and n * t.element_size() >= ALWAYS_MAPPED_BYTES


def may_donate() -> bool:
    """Whether a backward may write over a donated input now: eager tape autograd only (no torch.func
    transform, whose wrappers the writes would bypass; no trace, whose graph follows values; no
    create_graph backward, which would record the writes), and only when autograd frees the graph after
    this backward (not under retain_graph, whose next backward reads the saved tensors again)."""
    return not (functorch_active() or is_tracing() or torch.is_grad_enabled() or graph_kept())
