"""Differentiable collectives (setup_context autograd Functions), correct under `torch.func.vjp`.

Legend (the package's, docs/moe.md): P ranks in the group, X rows sent by this rank, Y rows received,
D trailing feature dims (any), in_splits_P / out_splits_P host lists of rows sent to / received from
each group rank.

c10d's in-place `all_to_all_single` gives silently zero gradients under `torch.func.vjp`, and the
`torch.distributed.nn` wrappers raise there (../shared/notes/torch-func.md). Here each collective is a
setup_context Function whose backward is the transposed collective:

    all_to_all(splits in -> out)   backward: all_to_all(out -> in)
    all_gather                     backward: reduce_scatter
    reduce_scatter                 backward: all_gather
    all_reduce (sum)               backward: all_reduce (sum)

Each has an `_async` form returning `(out, CommHandle)`: `out` may be read only after `handle.wait()`.
Backward collectives run synchronously inside the vjp call. Host synchronisation: none here; split
sizes are host lists the caller got from `exchange_counts` / `all_gather_counts` (which block: they
return host ints). Every call counts bytes per link class in `comm.counters` and, with
`comm.link_model`, completes no earlier than the model says.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from fmoe._compat import Function
from fmoe.parallel.async_comm import CommHandle
from fmoe.parallel.counters import (
    CommCounters,
    all_gather_per_peer,
    all_reduce_per_peer,
    reduce_scatter_per_peer,
)
from fmoe.parallel.failure import describe_failure
from fmoe.parallel.link_model import LinkModel
from fmoe.parallel.topology import INTRA, Topology


class CommGroup:
    """A process group plus what its collectives report to: topology, counters, link model, and the
    `timeout` a CPU (gloo) wait is bounded by (on a device the process group's own timeout bounds it:
    fmoe/parallel/async_comm.py says why a device wait takes none).

    Explicit object, no module state. `topology` None counts every transfer as intra-node.
    `weight_grads_per_step` (a tensor-parallel group's): replicated weights read through
    `fmoe.parallel.tensor.tp_weight` keep partial gradients, for the caller to sum once per step.
    """

    def __init__(self, group: dist.ProcessGroup, *, topology: Topology | None = None,
                 counters: CommCounters | None = None, link_model: LinkModel | None = None,
                 timeout: timedelta | None = None, weight_grads_per_step: bool = False):
        self.group = group
        self.weight_grads_per_step = weight_grads_per_step
        self.topology = topology
        self.counters = counters
        self.link_model = link_model
        self.timeout = timeout
        self.size: int = dist.get_world_size(group)
        self.rank: int = dist.get_rank(group)
        self.global_ranks: list[int] = dist.get_process_group_ranks(group)

    def link_of(self, j: int) -> str:
        """Link class between this rank and group rank `j`."""
        if self.topology is None:
            return INTRA
        return self.topology.link_class(self.global_ranks[self.rank], self.global_ranks[j])

    def _account(self, op: str, sent_to_P: Sequence[int]) -> float:
        """Count bytes sent to each group rank; return the link model's `not_before` time (0 if none)."""
        by_link: dict[str, int] = {}
        for j, n in enumerate(sent_to_P):
            if j != self.rank and n:
                link = self.link_of(j)
                by_link[link] = by_link.get(link, 0) + int(n)
        if self.counters is not None:
            self.counters.add_call(op)
            for link, n in by_link.items():
                self.counters.add_sent(op, link, n)
        if self.link_model is None:
            return 0.0
        return time.perf_counter() + self.link_model.duration(by_link)

    def _issue(self, op: str, sent_to_P: Sequence[int], launch, *tensors: torch.Tensor) -> CommHandle:
        """Launch a collective (c10d runs it on its own stream on a device); return its handle, which keeps
        `tensors` (its input and output buffers) alive until wait() has ordered the current stream after
        it. The handle's device is the tensors' (a CPU handle's wait blocks, bounded by `timeout`)."""
        not_before = self._account(op, sent_to_P)
        try:
            work = launch()
        except Exception as e:  # a broken group fails at issue time: same clear error as at wait time
            raise describe_failure(op, self.global_ranks, e) from e
        device = tensors[0].device if tensors else None
        return CommHandle(op, [work], device=device, timeout=self.timeout, keep=tensors,
                          not_before=not_before, counters=self.counters, ranks=self.global_ranks)


# torch >= 2.10 names them *_single; older ones only have *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _row_bytes(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


# ---- raw (non-differentiable) issue functions: plain tensors in, (out, handle) back ---------------

def _a2a(x_XD: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: CommGroup,
         op: str) -> tuple[torch.Tensor, CommHandle]:
    x_XD = x_XD.contiguous()
    out_YD = x_XD.new_empty((sum(out_splits), *x_XD.shape[1:]))
    rb = _row_bytes(x_XD)

    def launch():
        return dist.all_to_all_single(out_YD, x_XD, out_splits, in_splits, group=comm.group, async_op=True)

    return out_YD, comm._issue(op, [n * rb for n in in_splits], launch, x_XD, out_YD)


def _ag(x_XD: torch.Tensor, comm: CommGroup, op: str) -> tuple[torch.Tensor, CommHandle]:
    x_XD = x_XD.contiguous()
    out = x_XD.new_empty((comm.size * x_XD.shape[0], *x_XD.shape[1:]))
    share = all_gather_per_peer(out.numel() * out.element_size(), comm.size)  # this rank's chunk

    def launch():
        return _all_gather_single(out, x_XD, group=comm.group, async_op=True)

    return out, comm._issue(op, [share] * comm.size, launch, x_XD, out)


def _rs(x_PND: torch.Tensor, comm: CommGroup, op: str) -> tuple[torch.Tensor, CommHandle]:
    if x_PND.shape[0] % comm.size:
        raise ValueError(f"reduce_scatter: {x_PND.shape[0]} rows do not split over {comm.size} ranks")
    x_PND = x_PND.contiguous()
    out = x_PND.new_empty((x_PND.shape[0] // comm.size, *x_PND.shape[1:]))
    share = reduce_scatter_per_peer(x_PND.numel() * x_PND.element_size(), comm.size)  # chunk j to rank j

    def launch():
        return _reduce_scatter_single(out, x_PND, group=comm.group, async_op=True)

    return out, comm._issue(op, [share] * comm.size, launch, x_PND, out)


def _ar(x: torch.Tensor, comm: CommGroup, op: str,
        reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> tuple[torch.Tensor, CommHandle]:
    out = x.clone(memory_format=torch.contiguous_format)
    # Counted as reduce-scatter + all-gather: 2 (P-1)/P of the tensor leaves this rank.
    share = all_reduce_per_peer(out.numel() * out.element_size(), max(comm.size, 1))

    def launch():
        return dist.all_reduce(out, op=reduce_op, group=comm.group, async_op=True)

    return out, comm._issue(op, [share] * comm.size, launch, out)


# ---- autograd Functions ---------------------------------------------------------------------------

class _Box:
    """Carries the handle of an async forward out of `Function.apply` (a non-tensor input)."""

    handle: CommHandle | None = None


def _finish(out: torch.Tensor, handle: CommHandle, box: _Box | None) -> torch.Tensor:
    if box is None:
        handle.wait()
    else:
        box.handle = handle
    return out


class _AllToAll(Function):
    @staticmethod
    def forward(x_XD, out_splits, in_splits, comm, op, box):
        out, h = _a2a(x_XD, out_splits, in_splits, comm, op)
        return _finish(out, h, box)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.out_splits, ctx.in_splits, ctx.comm, ctx.op, _ = inputs

    @staticmethod
    def backward(ctx, g_YD):
        g = _AllToAll.apply(g_YD, ctx.in_splits, ctx.out_splits, ctx.comm, ctx.op + ".bwd", None)
        return g, None, None, None, None, None


class _AllGather(Function):
    @staticmethod
    def forward(x_XD, comm, op, box):
        out, h = _ag(x_XD, comm, op)
        return _finish(out, h, box)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.comm, ctx.op, _ = inputs

    @staticmethod
    def backward(ctx, g_PND):
        return _ReduceScatter.apply(g_PND, ctx.comm, ctx.op + ".bwd", None), None, None, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(x_PND, comm, op, box):
        out, h = _rs(x_PND, comm, op)
        return _finish(out, h, box)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.comm, ctx.op, _ = inputs

    @staticmethod
    def backward(ctx, g_XD):
        return _AllGather.apply(g_XD, ctx.comm, ctx.op + ".bwd", None), None, None, None


class _AllReduce(Function):
    @staticmethod
    def forward(x, comm, op, box):
        out, h = _ar(x, comm, op)
        return _finish(out, h, box)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.comm, ctx.op, _ = inputs

    @staticmethod
    def backward(ctx, g):
        return _AllReduce.apply(g, ctx.comm, ctx.op + ".bwd", None), None, None, None


# ---- public API -----------------------------------------------------------------------------------

def _splits(splits: Sequence[int] | None, n: int, comm: CommGroup, what: str) -> list[int]:
    if splits is None:
        if n % comm.size:
            raise ValueError(f"all_to_all: {n} rows do not split equally over {comm.size} ranks ({what})")
        return [n // comm.size] * comm.size
    splits = [int(s) for s in splits]
    if len(splits) != comm.size:
        raise ValueError(f"all_to_all: {what} has {len(splits)} entries for {comm.size} ranks")
    return splits


def _a2a_splits(x_XD: torch.Tensor, comm: CommGroup, out_splits: Sequence[int] | None,
                in_splits: Sequence[int] | None) -> tuple[list[int], list[int]]:
    if (out_splits is None) != (in_splits is None):
        raise ValueError("all_to_all: give both out_splits and in_splits, or neither (equal splits)")
    in_s = _splits(in_splits, x_XD.shape[0], comm, "in_splits")
    out_s = in_s if out_splits is None else _splits(out_splits, 0, comm, "out_splits")
    if sum(in_s) != x_XD.shape[0]:
        raise ValueError(f"all_to_all: in_splits sum to {sum(in_s)}, x has {x_XD.shape[0]} rows")
    return out_s, in_s


def all_to_all_async(x_XD: torch.Tensor, comm: CommGroup, out_splits: Sequence[int] | None = None,
                     in_splits: Sequence[int] | None = None, *, op: str = "all_to_all",
                     ) -> tuple[torch.Tensor, CommHandle]:
    """Issue an all-to-all: rows in_splits[j] of x_XD go to rank j; return (x_YD, handle).

    x_YD holds out_splits[j] rows from rank j, in rank order; read it only after `handle.wait()`.
    Splits None means equal. Differentiable (backward: the all-to-all with the splits swapped).
    """
    out_s, in_s = _a2a_splits(x_XD, comm, out_splits, in_splits)
    box = _Box()
    out = _AllToAll.apply(x_XD, out_s, in_s, comm, op, box)
    return out, box.handle


def all_to_all(x_XD: torch.Tensor, comm: CommGroup, out_splits: Sequence[int] | None = None,
               in_splits: Sequence[int] | None = None, *, op: str = "all_to_all") -> torch.Tensor:
    """Return x_YD: the synchronous, differentiable all-to-all (see `all_to_all_async`)."""
    out_s, in_s = _a2a_splits(x_XD, comm, out_splits, in_splits)
    return _AllToAll.apply(x_XD, out_s, in_s, comm, op, None)


def all_gather_async(x_XD: torch.Tensor, comm: CommGroup, *, op: str = "all_gather",
                     ) -> tuple[torch.Tensor, CommHandle]:
    """Issue an all-gather of equal-size x_XD; return (x_(P*X)D in rank order, handle). Differentiable."""
    box = _Box()
    out = _AllGather.apply(x_XD, comm, op, box)
    return out, box.handle


def all_gather(x_XD: torch.Tensor, comm: CommGroup, *, op: str = "all_gather") -> torch.Tensor:
    """Return x_(P*X)D: every rank's x_XD concatenated in rank order (synchronous, differentiable)."""
    return _AllGather.apply(x_XD, comm, op, None)


def reduce_scatter_async(x_PND: torch.Tensor, comm: CommGroup, *, op: str = "reduce_scatter",
                         ) -> tuple[torch.Tensor, CommHandle]:
    """Issue a sum reduce-scatter; return (x_XD = sum over ranks of chunk `rank`, handle). Differentiable."""
    box = _Box()
    out = _ReduceScatter.apply(x_PND, comm, op, box)
    return out, box.handle


def reduce_scatter(x_PND: torch.Tensor, comm: CommGroup, *, op: str = "reduce_scatter") -> torch.Tensor:
    """Return x_XD: chunk `rank` of x_PND summed over ranks (synchronous, differentiable)."""
    return _ReduceScatter.apply(x_PND, comm, op, None)


def all_reduce_async(x: torch.Tensor, comm: CommGroup, *, op: str = "all_reduce",
                     ) -> tuple[torch.Tensor, CommHandle]:
    """Issue a sum all-reduce into a new tensor; return (sum over ranks, handle). Differentiable."""
    box = _Box()
    out = _AllReduce.apply(x, comm, op, box)
    return out, box.handle


def all_reduce(x: torch.Tensor, comm: CommGroup, *, op: str = "all_reduce") -> torch.Tensor:
    """Return the sum of `x` over the ranks of the group (synchronous, differentiable, not in place)."""
    return _AllReduce.apply(x, comm, op, None)


# ---- integer metadata (not differentiable); these are the host synchronisation points ------------

def exchange_counts(counts_PL: torch.Tensor, comm: CommGroup, *, op: str = "counts") -> torch.Tensor:
    """Return recv_PL: row j of counts_PL goes to rank j; row j of the result came from rank j.

    Blocks until done (the caller then reads the counts on the host to size a variable all-to-all).
    """
    flat = counts_PL.reshape(comm.size, -1).to(torch.int64).contiguous()
    with torch.no_grad():
        out, h = _a2a(flat, [1] * comm.size, [1] * comm.size, comm, op)
        h.wait()
    return out.reshape(counts_PL.shape)


def all_reduce_max(x: torch.Tensor, comm: CommGroup, *, op: str = "all_reduce_max") -> torch.Tensor:
    """Return the elementwise max of `x` over the group (a new tensor; not differentiable; blocks until
    done), counted and link-modelled like `all_reduce`."""
    with torch.no_grad():
        out, h = _ar(x, comm, op, dist.ReduceOp.MAX)
        h.wait()
    return out


def all_gather_counts(counts_X: torch.Tensor, comm: CommGroup, *, op: str = "counts") -> torch.Tensor:
    """Return counts_PX: every rank's int counts_X stacked in rank order (blocks until done)."""
    flat = counts_X.reshape(1, -1).to(torch.int64).contiguous()
    with torch.no_grad():
        out, h = _ag(flat, comm, op)
        h.wait()
    return out.reshape(comm.size, *counts_X.shape)
