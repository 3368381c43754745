"""grouped_linear: one matmul per expert over contiguous row blocks, with a deferrable weight gradient.

    y_MF = grouped_linear(x_MD, w_EDF, counts_E)   # rows of x sorted by expert: expert e owns counts_E[e]

Legend (the package's, docs/moe.md): M rows (routed to this rank's experts, grouped by expert), D input
features, F output features, E experts (local), E1 = E + 1 boundaries.

Backends (`available_backends(dtype, device)` lists those usable):
- "grouped_mm": `torch._grouped_mm` with int32 cumulative offsets (fp32/bf16/fp16; on CPU its kernel
  needs every row stride to be a multiple of 16 bytes, i.e. D and F multiples of 16 / itemsize).
- "loop": a python loop over experts with slicing; works for every dtype (float64 included).
- "npu": `torch_npu.npu_grouped_matmul` (only when torch_npu imports and x lives on an npu device).
`backend=None` picks npu on npu devices, else grouped_mm when it supports the dtype, device and
shapes, else loop.

Host syncs: `counts_E` is read to the host exactly once per call (one `.tolist()` in the wrapper); the
forward and both backward products reuse that python list (and offsets built from it), so neither the
dx nor the deferred dw pass syncs again.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fmoe._compat import HAS_GROUPED_MM, Function, functorch_active, grouped_mm
from fmoe.transforms.tape import may_defer, weight_grad_or_defer

BACKENDS = ("grouped_mm", "loop", "npu")
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _npu_module():
    try:
        import torch_npu  # noqa: F401  (optional dependency, only for Ascend devices)
    except ImportError:
        return None
    return torch_npu


@functools.cache
def _grouped_mm_works(dtype: torch.dtype, device_type: str) -> bool:
    """Probe `torch._grouped_mm` once per (dtype, device type) on tiny aligned tensors (no error = usable)."""
    if not HAS_GROUPED_MM or dtype not in _GROUPED_MM_DTYPES:
        return False
    try:
        device = torch.device(device_type)
        x_MD = torch.zeros(4, 16, dtype=dtype, device=device)
        w_EDF = torch.zeros(2, 16, 16, dtype=dtype, device=device)
        offs_E = torch.tensor([1, 4], dtype=torch.int32, device=device)
        grouped_mm(x_MD, w_EDF, offs=offs_E)
        grouped_mm(x_MD.t(), x_MD, offs=offs_E)  # the 2D x 2D form the weight grad needs
        return True
    except Exception:  # any failure (unsupported arch, dtype, missing kernel) means: use another backend
        return False


def available_backends(dtype: torch.dtype, device: torch.device | str = "cpu") -> list[str]:
    """Return the backends usable for `dtype` on `device`, in order of preference (always ends with "loop").

    "grouped_mm" additionally requires D and F to be multiples of 16 bytes / itemsize at call time.
    """
    device = torch.device(device)
    out = []
    if device.type == "npu" and _npu_module() is not None:
        out.append("npu")
    if _grouped_mm_works(dtype, device.type):
        out.append("grouped_mm")
    out.append("loop")
    return out


def _aligned_for_grouped_mm(D: int, F: int, dtype: torch.dtype) -> bool:
    itemsize = dtype.itemsize
    return (D * itemsize) % 16 == 0 and (F * itemsize) % 16 == 0


def _bounds(counts: tuple[int, ...]) -> list[int]:
    b = [0]
    for c in counts:
        b.append(b[-1] + c)
    return b


def _offsets(counts: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Built from the host list: a host-to-device copy, never a device-to-host sync.
    if device.type == "cpu":
        return _cpu_offsets(counts, dtype)
    return torch.tensor(_bounds(counts)[1:], dtype=dtype, device=device)


@functools.lru_cache(maxsize=16)
def _cpu_offsets(counts: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Cached on CPU only: an MoE layer's three products and their backward ones share one routing, and
    # nothing writes to offsets. (A device tensor kept here could be freed under a side stream's kernel.)
    return torch.tensor(_bounds(counts)[1:], dtype=dtype)


# ---- the three products, per backend. a_MK rows grouped by counts ------------------------------

def _fwd(x_MD: torch.Tensor, w_EDF: torch.Tensor, counts: tuple[int, ...], backend: str) -> torch.Tensor:
    """y_MF[rows of e] = x_MD[rows of e] @ w_EDF[e] (also the dx product with w transposed)."""
    if backend == "grouped_mm":
        return grouped_mm(x_MD.contiguous(), w_EDF, offs=_offsets(counts, x_MD.device, torch.int32))
    if backend == "npu":
        torch_npu = _npu_module()
        group_list = _offsets(counts, x_MD.device, torch.int64)
        return torch_npu.npu_grouped_matmul([x_MD.contiguous()], [w_EDF.contiguous()], group_list=group_list,
                                            split_item=2, group_type=0, group_list_type=0)[0]
    # Out-of-place products joined by cat (not matmul(out=...)): stays differentiable for grad-of-grad.
    b = _bounds(counts)
    if not counts:
        return x_MD.new_zeros(x_MD.shape[0], w_EDF.shape[-1])
    return torch.cat([x_MD[b[e]:b[e + 1]] @ w_EDF[e] for e in range(len(counts))])


def _weight_grad(x_MD: torch.Tensor, g_MF: torch.Tensor, counts: tuple[int, ...],
                 backend: str) -> torch.Tensor:
    """dw_EDF[e] = x_MD[rows of e]^T @ g_MF[rows of e]; zero for an expert with no rows."""
    if backend == "grouped_mm":
        # 2D x 2D with offs groups the shared (row) dimension: one product per expert.
        return grouped_mm(x_MD.contiguous().t(), g_MF.contiguous(),
                          offs=_offsets(counts, x_MD.device, torch.int32))
    # "npu" uses the loop too: npu_grouped_matmul's K-grouped mode is not available on every release.
    # An expert with no rows gives a [D, 0] @ [0, F] product: zeros, as required.
    b = _bounds(counts)
    if not counts:
        return x_MD.new_zeros(0, x_MD.shape[-1], g_MF.shape[-1])
    return torch.stack([x_MD[b[e]:b[e + 1]].t() @ g_MF[b[e]:b[e + 1]] for e in range(len(counts))])


def _weight_grad_into(out_EDF: torch.Tensor, x_MD: torch.Tensor, g_MF: torch.Tensor, counts: tuple[int, ...],
                      backend: str) -> torch.Tensor:
    """out_EDF += _weight_grad(x, g): on CPU one GEMM with beta = 1 per expert into its slice (what the CPU
    grouped kernel runs anyway, less the [E, D, F] result and the pass adding it); elsewhere the grouped
    product, added (a device's grouped kernel beats a loop of per-expert launches)."""
    if out_EDF.device.type != "cpu":
        return out_EDF.add_(_weight_grad(x_MD, g_MF, counts, backend))
    b = _bounds(counts)
    for e in range(len(counts)):
        if counts[e]:
            out_EDF[e].addmm_(x_MD[b[e]:b[e + 1]].t(), g_MF[b[e]:b[e + 1]])
    return out_EDF


@dataclass(frozen=True)
class Grouped:
    """The grouped product over expert row blocks, y = x @ w[e] for the rows of expert e, and its two
    backward products: what `grouped_linear` and the fused MLP products (_mlp_products.py) run."""

    counts: tuple[int, ...]
    backend: str

    def fwd(self, x_MD: torch.Tensor, w_EDF: torch.Tensor) -> torch.Tensor:
        return _fwd(x_MD, w_EDF, self.counts, self.backend)

    def dx(self, g_MF: torch.Tensor, w_EDF: torch.Tensor) -> torch.Tensor:
        return _fwd(g_MF, w_EDF.transpose(-2, -1), self.counts, self.backend)

    def dw(self, x_MD: torch.Tensor, g_MF: torch.Tensor) -> torch.Tensor:
        return _weight_grad(x_MD, g_MF, self.counts, self.backend)

    def dw_into(self, out_EDF: torch.Tensor, x_MD: torch.Tensor, g_MF: torch.Tensor) -> torch.Tensor:
        """Adds dw(x, g) into out_EDF in place; returns out_EDF."""
        return _weight_grad_into(out_EDF, x_MD, g_MF, self.counts, self.backend)


class _GroupedLinear(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_MD: torch.Tensor, w_EDF: torch.Tensor, prod: Grouped) -> torch.Tensor:
        return prod.fwd(x_MD, w_EDF)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_MD, w_EDF, prod = inputs
        ctx.save_for_backward(x_MD, w_EDF)
        ctx.prod = prod
        ctx.w_plain = w_EDF  # the caller's tensor object: the tape keys deferral on it

    @staticmethod
    def backward(ctx, g_MF):
        x_MD, w_EDF = ctx.saved_tensors
        prod = ctx.prod
        # A cotangent may be expanded (stride 0); the grouped kernels reject that, so materialise it.
        g_MF = g_MF.contiguous()
        dx = prod.dx(g_MF, w_EDF) if ctx.needs_input_grad[0] else None
        dw = (weight_grad_or_defer(ctx.w_plain, prod.dw, x_MD, g_MF, accumulate=prod.dw_into)
              if ctx.needs_input_grad[1] else None)
        return dx, dw, None


def _choose_backend(x_MD: torch.Tensor, w_EDF: torch.Tensor, backend: str | None) -> str:
    return _backend_for(x_MD.dtype, x_MD.device, w_EDF.shape[1], w_EDF.shape[2], backend)


@functools.lru_cache(maxsize=64)
def _backend_for(dtype: torch.dtype, device: torch.device, D: int, F: int, backend: str | None) -> str:
    """The backend for one (dtype, device, D, F, request); cached, since it is asked once per product."""
    avail = available_backends(dtype, device)
    if backend is None:
        if "npu" in avail:
            return "npu"
        if "grouped_mm" in avail and _aligned_for_grouped_mm(D, F, dtype):
            return "grouped_mm"
        return "loop"
    if backend not in BACKENDS:
        raise ValueError(f"grouped_linear: unknown backend {backend!r}; choose one of {BACKENDS} or None")
    if backend not in avail:
        raise ValueError(f"grouped_linear: backend {backend!r} is not available for {dtype} on "
                         f"{device}; available: {avail}")
    if backend == "grouped_mm" and not _aligned_for_grouped_mm(D, F, dtype):
        raise ValueError(f"grouped_linear: backend 'grouped_mm' needs D and F to be multiples of "
                         f"16 bytes / itemsize for {dtype}, got D={D}, F={F}; use 'loop' or None")
    return backend


def check_grouped_args(name: str, x_MD: torch.Tensor, w_EDF: torch.Tensor,
                       counts_E: torch.Tensor | Sequence[int]) -> tuple[int, ...]:
    """Check a grouped product's x [M, D], w [E, D, F] and counts; return the counts as python ints.

    Raises ValueError (messages prefixed with `name`) on a bad shape, dtype or count; a counts tensor is
    read to the host here, once.
    """
    if x_MD.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [M, D], got shape {tuple(x_MD.shape)}")
    if w_EDF.dim() != 3:
        raise ValueError(f"{name}: w must be 3-D [E, D, F], got shape {tuple(w_EDF.shape)}")
    if x_MD.shape[1] != w_EDF.shape[1]:
        raise ValueError(f"{name}: x has {x_MD.shape[1]} features, w is {tuple(w_EDF.shape)} "
                         "([experts, in, out])")
    if x_MD.dtype != w_EDF.dtype:
        raise ValueError(f"{name}: x is {x_MD.dtype} but w is {w_EDF.dtype}; cast one first")
    if not x_MD.is_floating_point():
        raise ValueError(f"{name}: x must be floating point, got {x_MD.dtype}")
    if isinstance(counts_E, torch.Tensor):
        if counts_E.dim() != 1 or counts_E.is_floating_point() or counts_E.is_complex():
            raise ValueError(f"{name}: counts must be a 1-D integer tensor, got {counts_E.dtype} "
                             f"of shape {tuple(counts_E.shape)}")
        counts = tuple(int(c) for c in counts_E.tolist())  # the one host sync of this call
    else:
        counts = tuple(int(c) for c in counts_E)
    if len(counts) != w_EDF.shape[0]:
        raise ValueError(f"{name}: counts has {len(counts)} entries but w has "
                         f"{w_EDF.shape[0]} experts")
    if any(c < 0 for c in counts):
        raise ValueError(f"{name}: counts must be non-negative, got {list(counts)}")
    if sum(counts) != x_MD.shape[0]:
        raise ValueError(f"{name}: sum(counts) = {sum(counts)} but x has {x_MD.shape[0]} rows")
    return counts


def grouped_linear(x_MD: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor,
                   backend: str | None = None) -> torch.Tensor:
    """Return y_MF where the rows of expert e are x_MD[rows of e] @ w_EDF[e].

    Rows are contiguous per-expert blocks: expert e owns counts_E[e] consecutive rows, in expert order,
    and sum(counts_E) must equal M (empty experts allowed). `counts_E` is an integer tensor on any
    device (or a sequence of ints); it is read to the host once per call. Differentiable in x_MD and
    w_EDF; the weight gradient is deferred when a `split_vjp` tape defers w_EDF.
    `backend`: "grouped_mm", "loop", "npu" or None (choose automatically; see module docstring).
    """
    counts = check_grouped_args("grouped_linear", x_MD, w_EDF, counts_E)
    backend = _choose_backend(x_MD, w_EDF, backend)
    if backend != "npu" and not (may_defer() or functorch_active()):
        # Plain autograd and no tape: nothing can defer dw, so the products run as differentiable aten
        # ops (torch._grouped_mm has its own backward) with no Python backward per call.
        return _fwd(x_MD, w_EDF, counts, backend)
    return _GroupedLinear.apply(x_MD, w_EDF, Grouped(counts, backend))
