"""permute / unpermute: token rows to expert-sorted rows and back, with inverse-permutation backwards.

    layout = sort_layout(ids_TK, E)                   # stable sort of the flattened expert ids
    x_RD = permute(x_TD, layout)                       # row r is token row_src_R[r] // K (index_select)
    y_TD = unpermute(y_RD, probs_TK, layout)           # sum_k probs[t, k] * y[row_dst_N[t * K + k]]

Legend (the package's, docs/moe.md): T tokens, D features, K top-k slots, N = T * K (token, slot)
pairs (n = t * K + k), R rows of the expert-sorted layout, E experts, C capacity, X / Y generic axes.

A `Layout` is two index vectors that are inverse to each other on the kept pairs:
- row_src_R [R]: the pair n feeding row r, or N for a padding row (drop-and-pad);
- row_dst_N [N]: the row of pair n, or R when the pair was dropped.
Dropless: R = N and both are permutations. Capacity drop: R < N, dropped pairs point at R.
Drop-and-pad: R = E * C, expert e owns rows [e*C, (e+1)*C), unused rows are padding.
Each direction is one gather and one weighted scatter-sum (BENCHMARKS.md, "Glue bytes"):
- permute: a gather of x's rows (index_select); its backward sums each token's K rows in one pass;
- unpermute: each token's K rows summed with their gate weights inside the same pass; its backward is
  one pass too: each row takes its token's cotangent times the row's gate weight, and the gate weights'
  gradient is one dot product per pair, read from the rows where they are (no gathered copy).
The sums are embedding_bag's fixed-size bags (mode "sum", the gate weights as per-sample weights): one
read of the rows, one write of the output, fp32 accumulation for half precision on devices. Padding and
dropped pairs index a zero row appended to the source (index N//K = T, or R). No scatter, no atomics:
deterministic on every device. Under torch.func.vmap (no batching rule for embedding_bag) the same
sums run as a gather, a product and a sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fmoe._compat import Function, needs_grad, under_vmap
from fmoe.ops._donate import FRESH_BUFFERS_FAULT, may_donate
from fmoe.ops._dtypes import cast, compute_dtype
from fmoe.ops._host_bound import host_bound
from fmoe.transforms.pytree import pytree_dataclass


@pytree_dataclass(static=("counts", "num_tokens", "top_k", "full"))
@dataclass(frozen=True)
class Layout:
    """Expert-sorted row layout of N = T*K (token, slot) pairs. See the module docstring.

    row_src_R: int64 [R]; row_dst_N: int64 [N]; tok_R: int64 [R] = row_src_R // K (T for padding);
    counts_E: int64 [E] rows per expert in the layout (C each when padded), on the ids' device;
    counts: the same as python ints when known on the host without a sync (padded layouts), else None;
    num_tokens T; top_k K; full: True when both index vectors are permutations of [0, N) (dropless),
    so no zero row is ever read.
    """

    row_src_R: torch.Tensor
    row_dst_N: torch.Tensor
    tok_R: torch.Tensor
    counts_E: torch.Tensor
    counts: tuple[int, ...] | None
    num_tokens: int
    top_k: int
    full: bool = False

    @property
    def num_rows(self) -> int:
        """R, the number of rows of the layout."""
        return self.row_src_R.shape[0]


def _inverse(order_N: torch.Tensor) -> torch.Tensor:
    # a scatter of positions, called directly (indexed assignment goes through Python's indexing)
    positions_N = torch.arange(order_N.numel(), device=order_N.device)
    return torch.empty_like(order_N).scatter_(0, order_N, positions_N)


def expert_counts(ids_X: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Return counts_E int64 [E]: how many entries of ids_X (any shape, ids in [0, E)) name each expert.

    No host sync: E sizes the output (`torch.bincount` reads the largest id back from the device to size
    its own). The scatter-add of integer ones is exact in any order, so it is deterministic on
    accelerators too.
    """
    ids_N = cast(ids_X.reshape(-1), torch.int64)
    # Out of place: torch.func.vmap batches `scatter_add` over a batch of id sets, not its in-place form
    # into an unbatched zeros.
    return torch.zeros(num_experts, dtype=torch.int64, device=ids_N.device).scatter_add(
        0, ids_N, torch.ones_like(ids_N))


def sort_layout(ids_TK: torch.Tensor, num_experts: int, counts_E: torch.Tensor | None = None) -> Layout:
    """Return the dropless layout: pairs stably sorted by expert id (ties keep token order). No host sync.
    `counts_E`: the pairs per expert when the caller has them (the router's load), else counted here."""
    T, K = ids_TK.shape
    ids_N = ids_TK.reshape(-1)  # pair n = t * K + k
    order_N = torch.sort(ids_N, stable=True).indices
    if counts_E is None:
        counts_E = expert_counts(ids_N, num_experts)
    return Layout(row_src_R=order_N, row_dst_N=_inverse(order_N), tok_R=order_N // K, counts_E=counts_E,
                  counts=None, num_tokens=T, top_k=K, full=True)


def _zero_row(x_XD: torch.Tensor) -> torch.Tensor:
    return torch.cat([x_XD, x_XD.new_zeros(1, *x_XD.shape[1:])])


def _source(x_XD: torch.Tensor, full: bool) -> torch.Tensor:
    """The rows an index reads from: x_XD itself for a permutation (`full`), else x_XD and a zero row
    (index X reads zeros)."""
    return x_XD if full else _zero_row(x_XD)


def _rows(x_XD: torch.Tensor, index_Y: torch.Tensor, full: bool) -> torch.Tensor:
    """x_XD[index_Y] where index X means a zero row."""
    return _source(x_XD, full).index_select(0, index_Y)


BAG_KERNELS: dict[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.float64, torch.float32, torch.float16, torch.bfloat16),
    "cuda": (torch.float64, torch.float32, torch.float16, torch.bfloat16),
    "meta": (torch.float64, torch.float32, torch.float16, torch.bfloat16),
}
"""Device type -> the dtypes aten's embedding_bag (mode "sum", per-sample weights) takes there. Elsewhere
(other device types; torch.func.vmap, which has no batching rule for it) the bag sums run as a gather, a
product and a sum. The meta device stands for a device (benchmarks/glue_bytes.py traces there)."""

BAG_WEIGHT_GRAD_KERNELS: dict[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.float64, torch.float32, torch.float16, torch.bfloat16),
    "cuda": (torch.float64, torch.float32, torch.float16),
    "meta": (torch.float64, torch.float32, torch.float16),
}
"""Device type -> the dtypes embedding_bag's per-sample-weight backward takes there: on CUDA float, double
and half, not bfloat16 (aten's EmbeddingBag.cu dispatches FLOATING_TYPES_AND_HALF). Elsewhere the gate
weights' gradient gathers the rows and takes a batch of dot products."""


def _takes(table: dict[str, tuple[torch.dtype, ...]], t: torch.Tensor) -> bool:
    """True when `table`'s kernel takes t's device type and dtype, outside torch.func.vmap."""
    return t.dtype in table.get(t.device.type, ()) and not under_vmap()


def _bags(src_XD: torch.Tensor, rows_TJ: torch.Tensor, weights_TJ: torch.Tensor | None) -> torch.Tensor:
    """Return out_TD [T, D] = sum_j weights_TJ[t, j] * src_XD[rows_TJ[t, j]] (unweighted when None), in
    src's dtype.

    One pass (embedding_bag's sum over fixed-size bags): each source row is read once and each output
    row written once, with no [T, J, D] intermediate; the weights are applied inside, the sum accumulates
    in fp32 for half precision on devices (aten's acc_type; the CPU kernel may round the last place
    differently) and each output is rounded once. Trailing dims past the first are flattened for the
    kernel, which takes a 2-D table.
    """
    flat = src_XD.flatten(1)
    T, J = rows_TJ.shape
    w_N = None if weights_TJ is None else cast(weights_TJ, flat.dtype).reshape(-1)
    # aten's op itself (F.embedding_bag's checks and reshapes cost more than the kernel at small T):
    # bag t holds entries [t * J, (t + 1) * J) of the flattened rows; mode 0 = sum, no padding index
    offsets_T = torch.arange(0, T * J, J, device=rows_TJ.device)
    out = torch.embedding_bag(flat, rows_TJ.reshape(-1), offsets_T, False, 0, False, w_N, False, None)[0]
    return out.view(T, *src_XD.shape[1:])


def _bag_weight_grads(g_TD: torch.Tensor, src_XD: torch.Tensor, rows_TJ: torch.Tensor) -> torch.Tensor:
    """Return dw_TJ [T, J] = <g_TD[t], src_XD[rows_TJ[t, j]]> (the gradient of `_bags`' weights), in src's
    dtype: one dot product per (t, j), accumulating in fp32 inside the kernel, with no gathered copy of
    the rows (embedding_bag's own per-sample-weight backward)."""
    T, J = rows_TJ.shape
    bag_N = torch.arange(T * J, device=rows_TJ.device) // J  # the bag (token) of each flattened entry
    starts_T = torch.arange(0, T * J, J, device=rows_TJ.device)
    dw_N = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        cast(g_TD.flatten(1), src_XD.dtype), src_XD.flatten(1), rows_TJ.reshape(-1),
        starts_T, bag_N, 0, -1)  # mode 0: sum; padding index -1: none
    return dw_N.view(T, J)


def _gathered_sum(src_XD: torch.Tensor, rows_TJ: torch.Tensor,
                  weights_TJ: torch.Tensor | None) -> torch.Tensor:
    """`_bags` where embedding_bag does not run (`BAG_KERNELS`): one gather of the [T, J] rows, multiplied
    and summed in the compute dtype (mul and sum batch under vmap; addcmul_ would not)."""
    T, J = rows_TJ.shape
    acc = compute_dtype(src_XD.dtype)
    r_TJD = src_XD.index_select(0, rows_TJ.reshape(-1)).view(T, J, *src_XD.shape[1:]).to(acc)
    if weights_TJ is not None:
        r_TJD = r_TJD * weights_TJ.to(acc).view(T, J, *([1] * (src_XD.dim() - 1)))
    return r_TJD.sum(1).to(src_XD.dtype)


def _weighted_rows(src_XD: torch.Tensor, rows_TJ: torch.Tensor,
                   weights_TJ: torch.Tensor | None) -> torch.Tensor:
    """sum_j weights[t, j] * src[rows[t, j]]: `_bags` where it runs (`BAG_KERNELS`), else a gather."""
    return (_bags if _takes(BAG_KERNELS, src_XD) else _gathered_sum)(src_XD, rows_TJ, weights_TJ)


class _Permute(Function):
    generate_vmap_rule = True
    """x_RD = x_TD[src_R] (a zero row where src_R = T); backward: the inverse permutation, summed over K.

    permute_probs runs it with the N pairs as source rows (T -> N, K = 1).
    """

    @staticmethod
    def forward(x_TD, src_R, row_dst_N, K, full):
        return _rows(x_TD, src_R, full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_TD, src_R, row_dst_N, K, full = inputs
        ctx.save_for_backward(row_dst_N)
        ctx.K, ctx.full = K, full

    @staticmethod
    def backward(ctx, g_RD):
        (row_dst_N,) = ctx.saved_tensors
        # The inverse permutation: the rows of each token's K pairs (dropped pairs read the zero row),
        # summed in one pass (BENCHMARKS.md, "Glue bytes": two half-gathers, their sums and an fp32 add
        # moved 4x the bytes).
        if ctx.K == 1:
            return _rows(g_RD, row_dst_N, ctx.full), None, None, None, None
        dx = _weighted_rows(_source(g_RD, ctx.full), row_dst_N.view(-1, ctx.K), None)
        return dx, None, None, None, None


class _Unpermute(Function):
    generate_vmap_rule = True
    """y_TD = sum_k probs_TK[t, k] * y_RD[row_dst_N[t * K + k]]; backward: the forward permutation."""

    @staticmethod
    def forward(y_RD, probs_TK, row_src_R, row_dst_N, tok_R, T, K, full, donate):
        return _weighted_rows(_source(y_RD, full), row_dst_N.view(T, K), probs_TK)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y_RD, probs_TK, row_src_R, row_dst_N, tok_R, T, K, full, donate = inputs
        ctx.weighted = probs_TK is not None
        ctx.save_for_backward(y_RD, probs_TK if ctx.weighted else None, row_src_R, row_dst_N, tok_R)
        ctx.T, ctx.K, ctx.full, ctx.donate = T, K, full, donate

    @staticmethod
    def backward(ctx, g_TD):
        y_RD, probs_TK, row_src_R, row_dst_N, tok_R = ctx.saved_tensors
        dy = dprobs = None
        want_dy, want_dprobs = needs_grad(ctx)[0], ctx.weighted and needs_grad(ctx)[1]
        if want_dprobs:
            # d probs[t, k] = <g[t], y[row of (t, k)]> (a dropped pair reads the zero row: 0), in pair
            # order, y's dtype, accumulated in fp32: no gathered or upcast copy of the rows.
            dprobs_TK = _probs_grad(g_TD, _source(y_RD, ctx.full), row_dst_N.view(ctx.T, ctx.K))
            dprobs = cast(dprobs_TK, probs_TK.dtype)
        if want_dy:
            # Row r's token's cotangent (the forward permutation), times the row's gate weight inside
            # the same pass, in y's dtype (the gradient rounds to it anyway; the gate weight's own
            # rounding, 2**-9 in bf16, is of the same size).
            src = _source(cast(g_TD, y_RD.dtype), ctx.full)
            p_R1 = _rows(probs_TK.reshape(-1, 1), row_src_R, ctx.full) if ctx.weighted else None
            if ctx.donate and y_RD.device.type in FRESH_BUFFERS_FAULT and may_donate():
                dy = _rows_over(y_RD, src, tok_R, p_R1)
            else:
                dy = _weighted_rows(src, tok_R.view(-1, 1), p_R1)
        return dy, dprobs, None, None, None, None, None, None, None


def _rows_over(out_RD: torch.Tensor, src_XD: torch.Tensor, rows_R: torch.Tensor,
               weights_R1: torch.Tensor | None) -> torch.Tensor:
    """`_weighted_rows(src_XD, rows_R[:, None], weights_R1)` written over out_RD (a donated buffer of that
    shape and dtype) and returned: a gather into it, then the weights multiplied in place (each row's
    product with its weight, cast to src's dtype, rounded once to nearest: the bag kernel's values in
    fp32 / fp64; in bf16 the CPU bag kernel may round the last place differently). Two passes where the
    bag sum is one, and no new buffer (fmoe/ops/_donate.py: FRESH_BUFFERS_FAULT)."""
    torch.index_select(src_XD, 0, rows_R, out=out_RD)
    if weights_R1 is not None:
        out_RD.mul_(cast(weights_R1, out_RD.dtype))
    return out_RD


def _probs_grad(g_TD: torch.Tensor, y_XD: torch.Tensor, rows_TK: torch.Tensor) -> torch.Tensor:
    """<g_TD[t], y_XD[rows_TK[t, k]]> per (t, k), [T, K] in y's dtype: `_bag_weight_grads` where its kernel
    runs (`BAG_WEIGHT_GRAD_KERNELS`), else a gather of the rows and a batch of [1, D] x [D, K] products."""
    if _takes(BAG_WEIGHT_GRAD_KERNELS, y_XD):
        return _bag_weight_grads(g_TD, y_XD, rows_TK)
    T, K = rows_TK.shape
    y_TKD = y_XD.flatten(1).index_select(0, rows_TK.reshape(-1)).view(T, K, math.prod(y_XD.shape[1:]))
    return torch.bmm(y_TKD, g_TD.to(y_XD.dtype).flatten(1).unsqueeze(-1)).view(T, K)


def permute(x_TD: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Return x_RD: row r is x_TD[layout.tok_R[r]] (zeros for padding rows). Differentiable in x."""
    if x_TD.shape[0] != layout.num_tokens:
        raise ValueError(f"permute: x has {x_TD.shape[0]} rows, layout is for {layout.num_tokens} tokens")
    if host_bound(x_TD, layout.num_rows * math.prod(x_TD.shape[1:])):  # aten's gather, its backward index_add
        return _rows(x_TD, layout.tok_R, layout.full)
    return _Permute.apply(x_TD, layout.tok_R, layout.row_dst_N, layout.top_k, layout.full)


def permute_probs(probs_TK: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Return probs_R: the gate weight of each layout row (0 for padding rows). Differentiable."""
    p_N1 = probs_TK.reshape(-1, 1)  # pair n = t * K + k
    if host_bound(p_N1, layout.num_rows):
        return _rows(p_N1, layout.row_src_R, layout.full).reshape(-1)
    return _Permute.apply(p_N1, layout.row_src_R, layout.row_dst_N, 1, layout.full).reshape(-1)


def unpermute(y_RD: torch.Tensor, probs_TK: torch.Tensor | None, layout: Layout, *,
              donate: bool = False) -> torch.Tensor:
    """Return y_TD = sum_k probs_TK[t, k] * y_RD[row of (t, k)] (dropped pairs add 0), in y's dtype.

    With probs_TK None the K rows are summed unweighted (gate weights already applied in the expert).
    The weighted sum accumulates in fp32 (fp64 for fp64). Differentiable in y and probs.
    `donate` (fmoe/ops/_donate.py): y_RD is handed over; where new buffers fault (CPU) its backward
    writes y's gradient over y_RD's memory, so y_RD must not be read after the backward. Rows under
    fmoe/ops/_host_bound.py's limit on the CPU, under tape autograd, take aten's ops (nothing donated).
    """
    if y_RD.shape[0] != layout.num_rows:
        raise ValueError(f"unpermute: y has {y_RD.shape[0]} rows, layout has {layout.num_rows}")
    if probs_TK is not None and probs_TK.shape != (layout.num_tokens, layout.top_k):
        raise ValueError(f"unpermute: probs must be [{layout.num_tokens}, {layout.top_k}], got "
                         f"{tuple(probs_TK.shape)}")
    if host_bound(y_RD, y_RD.numel()):  # aten's gather, product and sum over the K slots
        rows_TK = layout.row_dst_N.view(layout.num_tokens, layout.top_k)
        return _gathered_sum(_source(y_RD, layout.full), rows_TK, probs_TK)
    return _Unpermute.apply(y_RD, probs_TK, layout.row_src_R, layout.row_dst_N, layout.tok_R,
                            layout.num_tokens, layout.top_k, layout.full, donate)
