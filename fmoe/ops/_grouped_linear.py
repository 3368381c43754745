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
shapes and runs without a host sync there (`fmoe._compat.grouped_mm_syncs`: on CUDA bf16 on sm90 /
sm100 only; fp32 would read its offsets on the host at every product), else loop (one read of the
counts per layer, shared by its products).

Host syncs: none on an accelerator with "grouped_mm" or "npu": the counts stay on the device, and the
grouped GEMM's offsets are their cumulative sum made there (`Counts`). The host ints are read (one
`.tolist()`) only where a backend needs them, "loop", or where reading them costs nothing
(`HOST_READS_FREE`, the CPU: the host is the device, and its dw then accumulates per expert in place).
A caller that runs several products on one routing (the MoE layer's experts) makes one `Counts` with
`group_counts` and hands it to each, so the forward and both backward products share one read (or none).
The range checks (counts non-negative, summing to M) run where the host ints are known; device-only counts
are not checked (that would be a sync).

Ascend: "npu" follows torch_npu's documented `npu_grouped_matmul` (group_type 0 groups the rows M of x,
2 groups the shared dimension K; group_list_type 1 means group_list holds the rows per group, a device
int64 tensor; split_item 2 / 3: x / y a single tensor): y and dx are one M-grouped call each, dw one
K-grouped call with x given as a transposed view [D, M] (tests/test_ops_grouped_linear.py checks the calls
against a fake torch_npu with those semantics). An empty group is a zero count (a zero dw slice).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fmoe._compat import (
    HAS_GROUPED_MM,
    Function,
    assume_constant,
    functorch_active,
    grouped_mm,
    grouped_mm_syncs,
    is_tracing,
    needs_grad,
    real_values,
    under_vmap,
)
from fmoe.ops import _grouped_op
from fmoe.ops._donate import may_donate, new_buffer_faults
from fmoe.transforms.pytree import pytree_dataclass
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
    # Built from host ints: on an accelerator a blocking host-to-device copy, which `Counts` avoids by
    # making offsets from device counts; host ints reach a device only from a caller that has no others.
    if device.type == "cpu":
        return _cpu_offsets(counts, dtype)
    return torch.tensor(_bounds(counts)[1:], dtype=dtype, device=device)


@functools.lru_cache(maxsize=16)
def _cpu_offsets(counts: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Cached on CPU only: an MoE layer's three products and their backward ones share one routing, and
    # nothing writes to offsets. (A device tensor kept here could be freed under a side stream's kernel.)
    return torch.tensor(_bounds(counts)[1:], dtype=dtype, device="cpu")


HOST_READS_FREE: tuple[str, ...] = ("cpu",)
"""Device types whose counts the host reads without waiting for an accelerator (the host is the device).
Tests empty it to run the accelerator path on CPU tensors (tests/test_host_syncs.py)."""


@pytree_dataclass(static=("host",))
@dataclass(frozen=True, eq=False)
class Counts:
    """The rows per group (expert) of grouped products, in the forms the backends read.

    host: python ints, or None where reading them would be a host sync; dev_E: integer [E] on the rows'
    device, or None when only host ints exist. `offsets` gives torch._grouped_mm's int32 cumulative ends,
    from dev_E by a cumsum on its device (made once, then shared), from the host ints only where there is
    no dev_E on the rows' device.
    """

    host: tuple[int, ...] | None
    dev_E: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.host) if self.host is not None else self.dev_E.shape[0]

    def traced_view(self) -> Counts:
        """These counts as a compiled phase sees them (transforms/compiled.py): the device form only, where
        there is one (the host ints vary from call to call, and a trace reads none)."""
        return self if self.dev_E is None else Counts(None, self.dev_E)

    def _dev_offs_E(self) -> torch.Tensor:
        # Made once per Counts and kept (the forward and both backward products share it); a plain
        # attribute, not functools.cached_property, whose lock (Python 3.11) torch.compile cannot trace.
        offs = self.__dict__.get("_offs_E")
        if offs is None:
            offs = torch.cumsum(self.dev_E, 0, dtype=torch.int32)
            object.__setattr__(self, "_offs_E", offs)
        return offs

    def offsets(self, device: torch.device) -> torch.Tensor:
        """int32 [E] cumulative row ends on `device` (no host read)."""
        if self.dev_E is not None and traced():
            # Not cached: vmap's wrappers and compile's fake tensors belong to one transform level, and a
            # backward runs at another.
            return torch.cumsum(self.dev_E, 0, dtype=torch.int32)
        if self.dev_E is not None and (self.host is None or self.dev_E.device == device):
            # one cumsum per Counts, shared by its products (host ints would make a new tensor per
            # routing: a cache of them misses on every layer, whose counts differ)
            return self._dev_offs_E()
        return _offsets(self.host, device, torch.int32)

    def group_list(self, device: torch.device) -> torch.Tensor:
        """int64 [E] rows per group on `device`: npu_grouped_matmul's group_list (group_list_type 1)."""
        if self.dev_E is not None:
            return self.dev_E.to(torch.int64)
        return torch.tensor(self.host, dtype=torch.int64, device=device)

    def read(self) -> tuple[int, ...]:
        """The host ints (a host sync when only the device has them)."""
        return self.host if self.host is not None else tuple(self.dev_E.tolist())


# ---- the three products, per backend. a_MK rows grouped by counts ------------------------------

def _npu_call(x: torch.Tensor, w: torch.Tensor, counts: Counts, split_item: int,
              group_type: int) -> torch.Tensor:
    return _npu_module().npu_grouped_matmul([x], [w], bias=None, group_list=counts.group_list(x.device),
                                            split_item=split_item, group_type=group_type,
                                            group_list_type=1)[0]


def traced() -> bool:
    """True under torch.func.vmap or while torch.compile traces: no host read of the counts then (vmap's
    tensors have no data, compile's are fake), the products go through the library ops (_grouped_op.py)."""
    return is_tracing() or under_vmap()


def _fwd(x_MD: torch.Tensor, w_EDF: torch.Tensor, counts: Counts, backend: str) -> torch.Tensor:
    """y_MF[rows of e] = x_MD[rows of e] @ w_EDF[e] (also the dx product with w transposed)."""
    if backend != "npu" and traced():
        return _grouped_op.grouped_mm(x_MD, w_EDF, counts.offsets(x_MD.device), backend)
    if backend == "grouped_mm":
        return grouped_mm(x_MD.contiguous(), w_EDF, offs=counts.offsets(x_MD.device))
    if backend == "npu":
        # group_type 0: the rows M of the single x are grouped; y is one [M, F] tensor (split_item 2).
        return _npu_call(x_MD.contiguous(), w_EDF, counts, split_item=2, group_type=0)
    # Out-of-place products joined by cat (not matmul(out=...)): stays differentiable for grad-of-grad.
    host = counts.read()
    b = _bounds(host)
    if not host:
        return x_MD.new_zeros(x_MD.shape[0], w_EDF.shape[-1])
    return torch.cat([x_MD[b[e]:b[e + 1]] @ w_EDF[e] for e in range(len(host))])


def _weight_grad(x_MD: torch.Tensor, g_MF: torch.Tensor, counts: Counts, backend: str) -> torch.Tensor:
    """dw_EDF[e] = x_MD[rows of e]^T @ g_MF[rows of e]; zero for an expert with no rows."""
    if backend != "npu" and traced():
        return _grouped_op.grouped_mm_dw(x_MD, g_MF, counts.offsets(x_MD.device), backend)
    if backend == "grouped_mm":
        # 2D x 2D with offs groups the shared (row) dimension: one product per expert.
        return grouped_mm(x_MD.contiguous().t(), g_MF.contiguous(), offs=counts.offsets(x_MD.device))
    if backend == "npu":
        # group_type 2: the shared dimension K (= the rows M) is grouped; y is one [E, D, F] tensor
        # (split_item 3). x goes in as the transposed view [D, M] of the row-major rows.
        return _npu_call(x_MD.contiguous().t(), g_MF.contiguous(), counts, split_item=3, group_type=2)
    # An expert with no rows gives a [D, 0] @ [0, F] product: zeros, as required.
    host = counts.read()
    b = _bounds(host)
    if not host:
        return x_MD.new_zeros(0, x_MD.shape[-1], g_MF.shape[-1])
    return torch.stack([x_MD[b[e]:b[e + 1]].t() @ g_MF[b[e]:b[e + 1]] for e in range(len(host))])


def _weight_grad_into(out_EDF: torch.Tensor, x_MD: torch.Tensor, g_MF: torch.Tensor, counts: Counts,
                      backend: str) -> torch.Tensor:
    """out_EDF += _weight_grad(x, g): on CPU (host ints known) one GEMM with beta = 1 per expert into its
    slice (what the CPU grouped kernel runs anyway, less the [E, D, F] result and the pass adding it);
    elsewhere the grouped product, added (a device's grouped kernel beats a loop of per-expert launches,
    and a loop would need the host ints)."""
    if out_EDF.device.type != "cpu" or counts.host is None or traced():
        return out_EDF.add_(_weight_grad(x_MD, g_MF, counts, backend))
    b = _bounds(counts.host)
    for e in range(len(counts.host)):
        if counts.host[e]:
            out_EDF[e].addmm_(x_MD[b[e]:b[e + 1]].t(), g_MF[b[e]:b[e + 1]])
    return out_EDF


def expert_blocks(host: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows, in expert order."""
    b = _bounds(host)
    return [(e, b[e], b[e + 1]) for e in range(len(host)) if host[e]]


def expert_weight_grads(w_E: torch.Tensor, host: tuple[int, ...]) -> torch.Tensor:
    """A new tensor like w_E for per-expert weight gradients written one expert's slice at a time: the
    slices of experts without rows zero, the others left for their GEMMs to write whole."""
    out = torch.empty_like(w_E)
    for e, c in enumerate(host):
        if not c:
            out[e].zero_()
    return out


def _dx_over(x_MD: torch.Tensor, g_MF: torch.Tensor, w_EDF: torch.Tensor, counts: Counts) -> torch.Tensor:
    """The dx product written over x_MD's own memory (a donated buffer; host ints known): expert e's rows
    take g_MF[rows of e] @ w_EDF[e]^T, one GEMM per expert into its rows. Returns x_MD."""
    w_EFD = w_EDF.transpose(-2, -1)
    for e, a, b in expert_blocks(counts.host):
        torch.mm(g_MF[a:b], w_EFD[e], out=x_MD[a:b])
    return x_MD


@dataclass(frozen=True, eq=False)
class Grouped:
    """The grouped product over expert row blocks, y = x @ w[e] for the rows of expert e, and its two
    backward products: what `grouped_linear` and the fused MLP products (_mlp_products.py) run."""

    counts: Counts
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

    def donates(self, x_MD: torch.Tensor) -> bool:
        """Whether writing into x_MD's memory (or one expert's rows at a time) beats a new buffer of its
        size: where that buffer would fault for sure (`new_buffer_faults`), with the host ints known and
        x's rows one contiguous block (a per-expert GEMM writes each block)."""
        return (new_buffer_faults(x_MD) and self.counts.host is not None and x_MD.is_contiguous()
                and self.backend in ("grouped_mm", "loop"))


class _GroupedLinear(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x_MD: torch.Tensor, w_EDF: torch.Tensor, prod: Grouped, donate: bool) -> torch.Tensor:
        return prod.fwd(x_MD, w_EDF)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_MD, w_EDF, prod, donate = inputs
        ctx.save_for_backward(x_MD, w_EDF)
        ctx.prod = prod
        ctx.donate = donate
        ctx.w_plain = w_EDF  # the caller's tensor object: the tape keys deferral on it

    @staticmethod
    def backward(ctx, g_MF):
        x_MD, w_EDF = ctx.saved_tensors
        prod = ctx.prod
        # A cotangent may be expanded (stride 0); the grouped kernels reject that, so materialise it.
        g_MF = g_MF.contiguous()
        if ctx.donate and needs_grad(ctx)[0] and may_donate():
            # dw first (made now, not deferred: it reads x), then x's memory takes dx (fmoe/ops/_donate.py)
            dw = prod.dw(x_MD, g_MF) if needs_grad(ctx)[1] else None
            return _dx_over(x_MD, g_MF, w_EDF, prod.counts), dw, None, None
        dx = prod.dx(g_MF, w_EDF) if needs_grad(ctx)[0] else None
        dw = (weight_grad_or_defer(ctx.w_plain, prod.dw, x_MD, g_MF, accumulate=prod.dw_into)
              if needs_grad(ctx)[1] else None)
        return dx, dw, None, None


def _choose_backend(x_MD: torch.Tensor, w_EDF: torch.Tensor, backend: str | None) -> str:
    return _backend_for(x_MD.dtype, x_MD.device, w_EDF.shape[1], w_EDF.shape[2], backend)


@assume_constant
def _backend_for(dtype: torch.dtype, device: torch.device, D: int, F: int, backend: str | None) -> str:
    """The backend for one (dtype, device, D, F, request). torch.compile calls it eagerly and keeps the
    answer as a constant (it probes kernels on real tensors, and its cache is not for tracing); a
    `transforms.compiled` trace asks it outside the trace, on real tensors."""
    with real_values():
        return _backend_choice(dtype, device, D, F, backend)


@functools.lru_cache(maxsize=64)
def _backend_choice(dtype: torch.dtype, device: torch.device, D: int, F: int, backend: str | None) -> str:
    """`_backend_for`, cached, since it is asked once per product."""
    avail = available_backends(dtype, device)
    if backend is None:
        if "npu" in avail:
            return "npu"
        syncs = grouped_mm_syncs(dtype, device)  # per product: the loop's one read per layer is fewer
        if "grouped_mm" in avail and _aligned_for_grouped_mm(D, F, dtype) and not syncs:
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
                       counts_E: torch.Tensor | Sequence[int] | Counts,
                       backend: str | None = None) -> Grouped:
    """Check a grouped product's x [M, D], w [E, D, F] and counts; return its `Grouped` product (the
    backend chosen, the counts as `group_counts` gives them).

    Raises ValueError (messages prefixed with `name`) on a bad shape or dtype, and on a bad count where the
    host ints are known (see the module docstring).
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
    backend = _choose_backend(x_MD, w_EDF, backend)
    counts = _group_counts(counts_E, x_MD.device, backend, name)
    if len(counts) != w_EDF.shape[0]:
        raise ValueError(f"{name}: counts has {len(counts)} entries but w has "
                         f"{w_EDF.shape[0]} experts")
    if counts.host is not None:
        if any(c < 0 for c in counts.host):
            raise ValueError(f"{name}: counts must be non-negative, got {list(counts.host)}")
        if sum(counts.host) != x_MD.shape[0]:
            raise ValueError(f"{name}: sum(counts) = {sum(counts.host)} but x has {x_MD.shape[0]} rows")
    return Grouped(counts, backend)


def group_counts(counts_E: torch.Tensor | Sequence[int] | Counts, x_MD: torch.Tensor, w_EDF: torch.Tensor,
                 backend: str | None = None) -> Counts:
    """Return `counts_E` (an integer tensor, python ints or a `Counts`) as the `Counts` that products of
    rows like x_MD with weights like w_EDF share: the host ints are read (the one host sync) only when the
    backend chosen needs them ("loop") or reading is free (`HOST_READS_FREE`); a device tensor is kept for
    the grouped kernels."""
    return _group_counts(counts_E, x_MD.device, _choose_backend(x_MD, w_EDF, backend), "group_counts")


def _group_counts(counts_E: torch.Tensor | Sequence[int] | Counts, device: torch.device, backend: str,
                  name: str) -> Counts:
    if isinstance(counts_E, Counts) and counts_E.host is not None:  # shared by a layer's products: as it is
        return counts_E
    need_host = (backend == "loop" or device.type in HOST_READS_FREE) and not traced()
    if isinstance(counts_E, Counts):
        if need_host:
            return Counts(counts_E.read(), counts_E.dev_E)
        return counts_E
    if isinstance(counts_E, torch.Tensor):
        if counts_E.dim() != 1 or counts_E.is_floating_point() or counts_E.is_complex():
            raise ValueError(f"{name}: counts must be a 1-D integer tensor, got {counts_E.dtype} "
                             f"of shape {tuple(counts_E.shape)}")
        return Counts(tuple(int(c) for c in counts_E.tolist()) if need_host else None, counts_E)
    return Counts(tuple(int(c) for c in counts_E))


def _compiled_transform_product(x_MD: torch.Tensor, w_EDF: torch.Tensor, prod: Grouped) -> torch.Tensor:
    """The grouped product while torch.compile traces a torch.func transform (`compile(grad(f))`): aten's
    `_grouped_mm`, which torch.func differentiates itself. In torch 2.13 that is bf16 only (its fake-tensor
    rule refuses other dtypes, though the CPU kernel runs fp32), and the library op cannot stand in: a
    custom op's autograd does not run under torch.func.grad, and traced there its weight gradient came out
    zero. Anything else is refused rather than differentiated wrongly."""
    if prod.backend == "grouped_mm" and x_MD.dtype == torch.bfloat16:
        return grouped_mm(x_MD.contiguous(), w_EDF, offs=prod.counts.offsets(x_MD.device))
    raise NotImplementedError(
        f"grouped_linear: torch.compile of a torch.func transform (grad, vjp, vmap) over the grouped expert "
        f"products runs in bfloat16 only (torch {torch.__version__}: aten._grouped_mm traces bf16 only); got "
        f"{x_MD.dtype} with backend {prod.backend!r}. Use bf16, or compile the loss and call .backward() "
        "(torch.compile's own autograd), or run the transform eagerly")


def grouped_linear(x_MD: torch.Tensor, w_EDF: torch.Tensor, counts_E: torch.Tensor | Sequence[int] | Counts,
                   backend: str | None = None, *, donate: bool = False) -> torch.Tensor:
    """Return y_MF where the rows of expert e are x_MD[rows of e] @ w_EDF[e].

    Rows are contiguous per-expert blocks: expert e owns counts_E[e] consecutive rows, in expert order,
    and sum(counts_E) must equal M (empty experts allowed). `counts_E` is an integer tensor on x's device,
    python ints, or a `Counts` (`group_counts`) shared by several products; see the module docstring
    for when it is read to the host. Differentiable in x_MD and w_EDF; the weight gradient is deferred
    when a `split_vjp` tape defers w_EDF.
    `backend`: "grouped_mm", "loop", "npu" or None (choose automatically; see module docstring).
    `donate` (as JAX's donate_argnums): the caller hands x_MD over, to be read by nothing after this
    product's backward. Under plain tape autograd on a device whose new buffers fault (the CPU,
    fmoe/ops/_donate.py) the backward then makes dw first and writes dx over x_MD's memory, one GEMM per
    expert, instead of into a new [M, D] buffer; nowhere else, and not under torch.func, while tracing or
    in a backward that keeps its graph, is anything donated.
    """
    prod = check_grouped_args("grouped_linear", x_MD, w_EDF, counts_E, backend)
    transformed = functorch_active()
    if transformed or is_tracing():  # the mode probed once: the eager path below asks nothing more
        if torch.compiler.is_compiling() and transformed:
            return _compiled_transform_product(x_MD, w_EDF, prod)
        if prod.backend != "npu" and traced():
            # The library op, whose own autograd, vmap and fake rules transforms read; the offsets go in as
            # a tensor argument (a Function's non-tensor argument would hide them from vmap's levels).
            return _grouped_op.product(x_MD, w_EDF, prod.counts.offsets(x_MD.device), prod.backend)
    elif prod.backend != "npu" and not may_defer():
        # Plain autograd and no tape: nothing can defer dw, so the products run as differentiable aten
        # ops (torch._grouped_mm has its own backward) with no Python backward per call, unless x is
        # donated where that pays.
        if donate and x_MD.requires_grad and prod.donates(x_MD):
            return _GroupedLinear.apply(x_MD, w_EDF, prod, True)
        return _fwd(x_MD, w_EDF, prod.counts, prod.backend)
    return _GroupedLinear.apply(x_MD, w_EDF, prod, False)
