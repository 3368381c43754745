"""Tensor and sequence parallelism as pure functions over weight shards (Megatron's, after its
tensor_parallel/layers.py and mappings.py; seed 002 lists MoE with sequence parallelism).

Legend (the package's, docs/moe.md): P ranks of the tensor-parallel group, T tokens (B * S, sequence
major), T/P a rank's sequence shard under sequence parallelism, D model width, F a projection's full
output width, F/P its shard, V vocabulary, V/P a rank's vocabulary shard.

Which tensor is split how (w_DF a projection as `fmoe.ops.linear` takes it, x @ w_DF):
    column-parallel   w_DF split on F: rank p holds w_D(F/P) columns p*F/P ..; its output is a shard
    row-parallel      w_FD split on F: rank p holds rows p*F/P ..; its input is the matching shard, its
                      output partial sums, summed over the group (all-reduce, or reduce-scatter under SP)
    vocab-parallel    table_VD and head w_DV split on V: rank p holds vocabulary rows / columns p*V/P ..

The region maps (Megatron's f and g) and their transposes: a function computed identically on every
rank of the group counts its loss once, so the map that makes a replicated input reach every shard sums
the shards' input gradients (`copy_to_tp`: identity forward, all-reduce backward) and the map that sums
partial outputs hands the replicated gradient back unchanged (`reduce_from_tp`: all-reduce forward,
identity backward). Under sequence parallelism the activations outside the TP regions are sharded over
the sequence: an all-gather enters a region (its backward a reduce-scatter) and a reduce-scatter leaves
it (its backward an all-gather): `fmoe.parallel.collectives.all_gather` / `reduce_scatter` as they are.
Everything here is a setup_context Function or built from them, so it is correct under
`torch.func.vjp` and `split_vjp` (whose weight gradients `fmoe.ops.linear` defers).
"""

from __future__ import annotations

import torch

from fmoe._compat import Function
from fmoe.ops import embedding, linear
from fmoe.parallel.collectives import CommGroup, all_gather, all_reduce, all_reduce_max, reduce_scatter

IGNORE_INDEX = -100  # a target that takes no loss (fmoe.ops.cross_entropy's)


class _CopyToTP(Function):
    @staticmethod
    def forward(x, comm, op):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.comm, ctx.op = inputs

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.comm, op=ctx.op + ".bwd"), None, None


class _ReduceFromTP(Function):
    @staticmethod
    def forward(x, comm, op):
        return all_reduce(x, comm, op=op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def copy_to_tp(x: torch.Tensor, comm: CommGroup, *, op: str = "tp.copy") -> torch.Tensor:
    """Returns `x` (replicated on the group) entering a TP region: identity forward, its gradient summed
    over the group in the backward (every shard's use of x contributes). Megatron's f."""
    return _CopyToTP.apply(x, comm, op)


def tp_weight(w: torch.Tensor, comm: CommGroup, *, op: str = "tp.weight") -> torch.Tensor:
    """Returns replicated weight `w` (the same on every rank of the group) as read by a use that leaves
    each rank a partial gradient (its tokens, positions or heads only: the router, the shared expert, the
    q / k norms, and under sequence parallelism every replicated weight): `copy_to_tp`, its gradient
    summed over the group in every backward, unless `comm.weight_grads_per_step`; then `w` itself, its
    gradient left partial for the step to sum once over all microbatches (`sum_tp_partials`, the leaves
    `fmoe.tp_layout.tp_partial` names), as Megatron does: one all-reduce per step instead of one per
    weight per microbatch."""
    if getattr(comm, "weight_grads_per_step", False):
        return w
    return copy_to_tp(w, comm, op=op)


def sum_tp_partials(grads: list[torch.Tensor], comm: CommGroup, *, op: str = "tp.weight_grads") -> None:
    """Sums, in place over the group, the partial gradients `grads` of replicated weights read through
    `tp_weight` with `comm.weight_grads_per_step` (each rank's over all its microbatches): one flat
    all-reduce per dtype; returns None."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = all_reduce(torch.cat([g.reshape(-1) for g in same]), comm, op=op)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def reduce_from_tp(x: torch.Tensor, comm: CommGroup, *, op: str = "tp.reduce") -> torch.Tensor:
    """Returns the sum over the group of the partial results `x`, leaving a TP region: all-reduce
    forward, the (replicated) gradient passed back unchanged. Megatron's g."""
    return _ReduceFromTP.apply(x, comm, op)


def gather_sequence(x_BSD: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """Returns x_B(P*S)D: the sequence shards x_BSD of the group's ranks (rank p holds positions p*S ..)
    joined on the sequence axis, entering a TP region under sequence parallelism (its backward sums the
    ranks' gradients and keeps this rank's positions: a reduce-scatter)."""
    return all_gather(x_BSD.movedim(1, 0), comm, op="tp.sp_gather").movedim(0, 1)


def scatter_sequence(x_BSD: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """Returns this rank's positions (p*S/P ..) of the sum over the group of the partial results x_BSD,
    leaving a TP region under sequence parallelism (reduce-scatter; its backward an all-gather)."""
    return reduce_scatter(x_BSD.movedim(1, 0), comm, op="tp.sp_scatter").movedim(0, 1)


class _SplitRows(Function):
    @staticmethod
    def forward(x_TD, comm):
        n = x_TD.shape[0] // comm.size
        return x_TD[comm.rank * n:(comm.rank + 1) * n].contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, g_TD):
        return all_gather(g_TD.contiguous(), ctx.comm, op="tp.tokens"), None


class _JoinRows(Function):
    @staticmethod
    def forward(x_TD, comm):
        return all_gather(x_TD.contiguous(), comm, op="tp.tokens")

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, g_TD):
        n = g_TD.shape[0] // ctx.comm.size
        return g_TD[ctx.comm.rank * n:(ctx.comm.rank + 1) * n].contiguous(), None


def split_tokens(x_TD: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """Returns this rank's tokens x_(T/P)D (rows p*T/P ..) of x_TD replicated on the group: the tokens a
    rank routes under tensor parallelism without sequence parallelism (TP extends EP: each rank dispatches
    its own). Its backward gathers every rank's rows' gradients (an all-gather): the replicated x's
    gradient. ValueError unless P divides T."""
    if x_TD.shape[0] % comm.size:
        raise ValueError(f"split_tokens: {x_TD.shape[0]} tokens do not split over {comm.size} "
                         "tensor-parallel ranks")
    return _SplitRows.apply(x_TD, comm)


def join_tokens(x_TD: torch.Tensor, comm: CommGroup) -> torch.Tensor:
    """Returns x_(P*T)D replicated on the group: every rank's tokens joined in rank order (an all-gather),
    the transpose of `split_tokens` (its backward keeps this rank's rows of the replicated gradient)."""
    return _JoinRows.apply(x_TD, comm)


def shard_range(n: int, comm: CommGroup, what: str) -> tuple[int, int]:
    """Returns [start, end) of this rank's equal shard of `n` (ValueError naming `what` unless the group
    size divides n)."""
    if n % comm.size:
        raise ValueError(f"{what}: {n} does not split over {comm.size} tensor-parallel ranks")
    k = n // comm.size
    return comm.rank * k, (comm.rank + 1) * k


def column_parallel_linear(x_TD: torch.Tensor, w_DF: torch.Tensor, comm: CommGroup, *,
                           sequence_parallel: bool = False) -> torch.Tensor:
    """Returns y_T(F/P) = x @ w_DF for this rank's column shard w_D(F/P). x_TD: replicated on the group,
    or with `sequence_parallel` this rank's sequence shard x_(T/P)D, gathered first (its backward a
    reduce-scatter)."""
    x_TD = all_gather(x_TD, comm, op="tp.sp_gather") if sequence_parallel else copy_to_tp(x_TD, comm)
    return linear(x_TD, w_DF)


def row_parallel_linear(x_TF: torch.Tensor, w_FD: torch.Tensor, comm: CommGroup, *,
                        sequence_parallel: bool = False) -> torch.Tensor:
    """Returns y = x @ w_FD summed over the group, from this rank's input shard x_T(F/P) and row shard
    w_(F/P)D: y_TD replicated, or with `sequence_parallel` this rank's sequence shard y_(T/P)D
    (reduce-scatter instead of all-reduce)."""
    part_TD = linear(x_TF, w_FD)
    if sequence_parallel:
        return reduce_scatter(part_TD, comm, op="tp.sp_scatter")
    return reduce_from_tp(part_TD, comm)


def vocab_parallel_embedding(ids_BS: torch.Tensor, table_VD: torch.Tensor, comm: CommGroup, vocab: int, *,
                             sequence_parallel: bool = False) -> torch.Tensor:
    """Returns the embedding of ids_BS [B, S] from this rank's vocabulary shard table_(V/P)D of a
    `vocab`-token table: h_BSD replicated, or with `sequence_parallel` this rank's positions h_B(S/P)D
    of every sequence (as `scatter_sequence` leaves them). Ids outside the shard embed to zero here and
    come from their own rank."""
    start, end = shard_range(vocab, comm, "vocab_parallel_embedding")
    if table_VD.shape[0] != end - start:
        raise ValueError(f"vocab_parallel_embedding: the shard has {table_VD.shape[0]} rows, expected "
                         f"{end - start} of {vocab}")
    mine_BS = (ids_BS >= start) & (ids_BS < end)
    local_BS = torch.where(mine_BS, ids_BS - start, torch.zeros_like(ids_BS))
    part_BSD = embedding(local_BS, table_VD) * mine_BS.unsqueeze(-1).to(table_VD.dtype)
    if sequence_parallel:
        return scatter_sequence(part_BSD, comm)
    return reduce_from_tp(part_BSD, comm)


def vocab_parallel_cross_entropy(logits_TV: torch.Tensor, targets_T: torch.Tensor, comm: CommGroup,
                                 vocab: int) -> torch.Tensor:
    """Returns the mean cross-entropy (0-dim, fp32 or wider) over targets_T [T] (IGNORE_INDEX takes no
    loss) of logits whose vocabulary is split over the group: logits_T(V/P) this rank's columns. The
    softmax's max, normaliser and target logit are reduced over the group; the gradient reaching the
    logits is this shard's softmax minus its one-hot, as on one process."""
    start, end = shard_range(vocab, comm, "vocab_parallel_cross_entropy")
    if logits_TV.shape[-1] != end - start:
        raise ValueError(f"vocab_parallel_cross_entropy: {logits_TV.shape[-1]} logit columns, expected "
                         f"{end - start} of {vocab}")
    z_TV = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))
    # a shift for stability only: it cancels in the loss and takes no gradient
    m_T = all_reduce_max(z_TV.detach().amax(-1), comm, op="tp.ce_max")
    sum_T = reduce_from_tp(torch.exp(z_TV - m_T.unsqueeze(-1)).sum(-1), comm)
    keep_T = targets_T != IGNORE_INDEX
    mine_T = keep_T & (targets_T >= start) & (targets_T < end)
    local_T = torch.where(mine_T, targets_T - start, torch.zeros_like(targets_T))
    picked_T = z_TV.gather(-1, local_T.unsqueeze(-1)).squeeze(-1) * mine_T.to(z_TV.dtype)
    target_T = reduce_from_tp(picked_T, comm)
    loss_T = (torch.log(sum_T) + m_T - target_T) * keep_T.to(z_TV.dtype)
    return loss_T.sum() / keep_T.sum().clamp(min=1)
