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
Every forward and backward is one `index_select` of rows from a source extended by one zero row
(index N//K = T, or R), so padding and dropped pairs read zeros: no scatter, no expanded index, no
generic index autograd. The backward of permute is the inverse permutation (row_dst) followed by the
sum over the K slots; the backward of unpermute is the forward permutation (row_src).

Under plain autograd on CPU (no torch.func transform) the same index_selects run as aten ops with
autograd's own backwards instead: there the scatter-add of index_select's backward is serial, so
deterministic, and skipping the Python Function saves about 100 us per layer call at small shapes
(`benchmarks/train.py`). Devices and torch.func keep the gather-only Functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fmoe._compat import Function, functorch_active, needs_grad, under_vmap
from fmoe.ops._dtypes import compute_dtype
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
    inv_N = torch.empty_like(order_N)
    inv_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return inv_N


def expert_counts(ids_X: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Return counts_E int64 [E]: how many entries of ids_X (any shape, ids in [0, E)) name each expert.

    No host sync: E sizes the output (`torch.bincount` reads the largest id back from the device to size
    its own). The scatter-add of integer ones is exact in any order, so it is deterministic on
    accelerators too.
    """
    ids_N = ids_X.reshape(-1).to(torch.int64)
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


def _rows(x_XD: torch.Tensor, index_Y: torch.Tensor, full: bool) -> torch.Tensor:
    """x_XD[index_Y] where index X means a zero row; `full` (a permutation, no sentinel) skips the
    copy that appends the zero row."""
    return x_XD.index_select(0, index_Y) if full else _zero_row(x_XD).index_select(0, index_Y)


def _native(x: torch.Tensor) -> bool:
    """True when aten's index_select and its autograd backward replace the Functions (module docstring):
    CPU, in its compute dtype (a half-precision y would be saved upcast), outside torch.func."""
    return x.device.type == "cpu" and x.dtype == compute_dtype(x.dtype) and not functorch_active()


SLOT_LOOP_DEVICES: tuple[str, ...] = ("cpu",)
"""Device types whose unpermute forward sums the K slots one multiply-add at a time (faster on CPU); the
others run one batched product. Tests empty it to check the device form on CPU tensors."""


def _weighted_sum(y_TKD: torch.Tensor, probs_TK: torch.Tensor | None) -> torch.Tensor:
    """Return y_TD = sum_k probs_TK[t, k] * y_TKD[t, k] (unweighted when probs is None), accumulated in
    the compute dtype and returned in y's dtype."""
    acc = compute_dtype(y_TKD.dtype)
    if probs_TK is None:
        return torch.sum(y_TKD, 1, dtype=acc).to(y_TKD.dtype)
    p_TK = probs_TK.to(acc)
    if under_vmap() or (torch.is_grad_enabled() and (y_TKD.requires_grad or p_TK.requires_grad)):
        # Recorded by tape autograd: multiply then sum, whose backward is one product per input (the
        # per-slot form's backward would zero-fill a [T, K, D] gradient per slot: 2x slower). Under vmap
        # too: addcmul_ has no batching rule (vmap would loop over the batch).
        return (y_TKD.to(acc) * p_TK.unsqueeze(-1)).sum(1).to(y_TKD.dtype)
    if y_TKD.device.type not in SLOT_LOOP_DEVICES:
        # Inside a Function's forward on a device: a T-batch of [1, K] @ [K, D] products, the gate weights
        # in y's dtype (the output rounds to it anyway), fp32 accumulation inside the kernel: the rows are
        # read once (the per-slot multiply-add below reads and writes an fp32 [T, D] accumulator K times:
        # 4x the bytes, BENCHMARKS.md "Glue bytes").
        return torch.bmm(p_TK.unsqueeze(1).to(y_TKD.dtype), y_TKD).squeeze(1)
    # Inside a Function's forward on CPU: one multiply-add per slot into an accumulator in the compute
    # dtype, no [T, K, D] product (nor an upcast copy of half-precision rows): 4.5x faster on CPU than
    # multiply-then-sum in fp32, 3x in bf16; the T-batch of [1, K] @ [K, D] bmm is slower still here.
    # The accumulator starts as slot 0's product (not zeros): under torch.func.vmap it is then batched
    # like its inputs, and the in-place adds into it are legal.
    out_TD = torch.mul(y_TKD[:, 0], p_TK[:, 0:1])
    for k in range(1, y_TKD.shape[1]):
        out_TD.addcmul_(y_TKD[:, k], p_TK[:, k:k + 1])
    return out_TD.to(y_TKD.dtype)


def _unpermute_rows(y_RD: torch.Tensor, probs_TK: torch.Tensor | None, row_dst_N: torch.Tensor, T: int,
                    K: int, full: bool) -> torch.Tensor:
    """unpermute's forward (both paths): y_TD [T, D], the K rows of each token gathered and summed."""
    return _weighted_sum(_rows(y_RD, row_dst_N, full).view(T, K, y_RD.shape[-1]), probs_TK)


def _slot_sum(src_XD: torch.Tensor, rows_TJ: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """sum_j src_XD[rows_TJ[t, j]] per token t, [T, D] in `acc` (one gather, one reduction; one slot: the
    gathered rows themselves, no second [T, D] tensor)."""
    T, J = rows_TJ.shape
    if J == 1:
        return src_XD.index_select(0, rows_TJ[:, 0]).to(acc)
    return src_XD.index_select(0, rows_TJ.reshape(-1)).view(T, J, src_XD.shape[-1]).sum(1, dtype=acc)


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
        # Inverse permutation: the row of each (t, k) pair (dropped pairs read the zero row), summed over
        # k. Two gathers of half the slots each, each summed over its slots in one pass accumulating in the
        # compute dtype: the rows are read once and the accumulator twice (a gather and an fp32 add per
        # slot moved 4.5x the bytes: BENCHMARKS.md, "Glue bytes"), and no whole [T, K, D] copy of the
        # cotangent is made at once. The price: half of one is held while it is summed, T ceil(K/2) D
        # elements where the per-slot form held T D (a split backward holds the dw inputs here); K = 2
        # holds no more than it did.
        K = ctx.K
        if K == 1:
            return _rows(g_RD, row_dst_N, ctx.full), None, None, None, None
        src = g_RD if ctx.full else _zero_row(g_RD)
        dst_TK = row_dst_N.view(-1, K)
        acc = compute_dtype(g_RD.dtype)
        half = (K + 1) // 2
        dx = _slot_sum(src, dst_TK[:, :half], acc)
        dx += _slot_sum(src, dst_TK[:, half:], acc)
        return dx.to(g_RD.dtype), None, None, None, None


class _Unpermute(Function):
    generate_vmap_rule = True
    """y_TD = sum_k probs_TK[t, k] * y_RD[row_dst_N[t * K + k]]; backward: the forward permutation."""

    @staticmethod
    def forward(y_RD, probs_TK, row_src_R, row_dst_N, tok_R, T, K, full):
        return _unpermute_rows(y_RD, probs_TK, row_dst_N, T, K, full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y_RD, probs_TK, row_src_R, row_dst_N, tok_R, T, K, full = inputs
        ctx.weighted = probs_TK is not None
        ctx.save_for_backward(y_RD, probs_TK if ctx.weighted else None, row_src_R, row_dst_N, tok_R)
        ctx.K, ctx.full = K, full

    @staticmethod
    def backward(ctx, g_TD):
        y_RD, probs_TK, row_src_R, row_dst_N, tok_R = ctx.saved_tensors
        dy = dprobs = None
        want_dy, want_dprobs = needs_grad(ctx)[0], ctx.weighted and needs_grad(ctx)[1]
        # Row r's token's cotangent (the forward permutation): dy's rows before their gate weights, and
        # what d probs reads in the rows' order.
        g_RD = _rows(g_TD, tok_R, ctx.full) if want_dy or want_dprobs else None
        if want_dprobs:
            # d probs[t, k] = <g[t], y[row of (t, k)]>: one dot product per row of the layout, then the
            # rows put back in pair order (a dropped pair's is 0). A batch of [1, D] x [D, 1] products in
            # y's dtype, accumulating in fp32 inside (no fp32 copy of the rows), then the gate weights'.
            dprobs_R1 = torch.bmm(g_RD.unsqueeze(1), y_RD.unsqueeze(2)).view(-1, 1)
            dprobs = _rows(dprobs_R1, row_dst_N, ctx.full).view_as(probs_TK).to(probs_TK.dtype)
        if want_dy:
            if ctx.weighted:
                p_R1 = _rows(probs_TK.reshape(-1, 1), row_src_R, ctx.full)
                # In y's dtype: the gradient is rounded to it anyway, and a mixed bf16 x fp32 product
                # (upcast, multiply, round back) costs 4x on CPU; the gate weight's own rounding (2**-9
                # in bf16) is of the same size. In place: g_RD is this backward's own.
                g_RD = g_RD.mul_(p_R1.to(y_RD.dtype))
            dy = g_RD
        return dy, dprobs, None, None, None, None, None, None


def permute(x_TD: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Return x_RD: row r is x_TD[layout.tok_R[r]] (zeros for padding rows). Differentiable in x."""
    if x_TD.shape[0] != layout.num_tokens:
        raise ValueError(f"permute: x has {x_TD.shape[0]} rows, layout is for {layout.num_tokens} tokens")
    if _native(x_TD):
        return _rows(x_TD, layout.tok_R, layout.full)
    return _Permute.apply(x_TD, layout.tok_R, layout.row_dst_N, layout.top_k, layout.full)


def permute_probs(probs_TK: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Return probs_R: the gate weight of each layout row (0 for padding rows). Differentiable."""
    p_N1 = probs_TK.reshape(-1, 1)  # pair n = t * K + k
    if _native(p_N1):
        return _rows(p_N1, layout.row_src_R, layout.full).reshape(-1)
    return _Permute.apply(p_N1, layout.row_src_R, layout.row_dst_N, 1, layout.full).reshape(-1)


def unpermute(y_RD: torch.Tensor, probs_TK: torch.Tensor | None, layout: Layout) -> torch.Tensor:
    """Return y_TD = sum_k probs_TK[t, k] * y_RD[row of (t, k)] (dropped pairs add 0), in y's dtype.

    With probs_TK None the K rows are summed unweighted (gate weights already applied in the expert).
    The weighted sum accumulates in fp32 (fp64 for fp64). Differentiable in y and probs.
    """
    if y_RD.shape[0] != layout.num_rows:
        raise ValueError(f"unpermute: y has {y_RD.shape[0]} rows, layout has {layout.num_rows}")
    if probs_TK is not None and probs_TK.shape != (layout.num_tokens, layout.top_k):
        raise ValueError(f"unpermute: probs must be [{layout.num_tokens}, {layout.top_k}], got "
                         f"{tuple(probs_TK.shape)}")
    if _native(y_RD):
        return _unpermute_rows(y_RD, probs_TK, layout.row_dst_N, layout.num_tokens, layout.top_k, layout.full)
    return _Unpermute.apply(y_RD, probs_TK, layout.row_src_R, layout.row_dst_N, layout.tok_R,
                            layout.num_tokens, layout.top_k, layout.full)
