"""Dynamic capacity agreed over the expert group (seed 002, feature 16): one capacity for every rank that
exchanges tokens, at the cost of one small all-reduce per MoE layer, and a second only on a miss.

    agree = CapacityAgreement(CommGroup(layout.group("expert")))
    with fmoe.capacity.capacity_agreement(agree):       # every dynamic layout in the block asks it
        ...

Seed 002 (MindSpeed's dropless dynamic padding): rather than all-reducing the maximum load every step,
each rank first checks whether the forecast capacity holds its own largest expert load; the ranks agree
on that flag (here: the number of ranks that missed, summed), and only when one missed do they all-reduce
the true maximum, which every rank then pads to. A rank alone decided for itself before, so the ranks of
one all-to-all padded to different capacities whenever one missed.

The ops are counted in the CommGroup's counters as "capacity.fits" and "capacity.max". Host syncs: the
flag is read back (one int), and on a miss the maximum (one more).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fmoe.parallel.collectives import CommGroup

FITS_OP = "capacity.fits"
MAX_OP = "capacity.max"


class CapacityAgreement:
    """`agree(max_load, forecast) -> (capacity, missed)` over `comm` (fmoe.capacity.Agree): the forecast
    when it holds every rank's max load, else the maximum over the group; `missed` is the same on all."""

    def __init__(self, comm: CommGroup):
        self.comm = comm

    def _all_reduce(self, x_1: torch.Tensor, op: str, reduce: dist.ReduceOp) -> int:
        """All-reduces the one-element int64 `x_1` in place (blocks); returns its value on the host."""
        def launch() -> dist.Work:
            return dist.all_reduce(x_1, op=reduce, group=self.comm.group, async_op=True)

        # through the group's issue: counted, a failure named, a CPU wait bounded by its timeout
        self.comm._issue(op, [x_1.element_size()] * self.comm.size, launch, x_1).wait()
        return int(x_1.item())

    def __call__(self, max_load: torch.Tensor, forecast: int) -> tuple[int, bool]:
        """Returns (capacity, missed) for this step's `max_load` (a 0-dim integer tensor, this rank's
        largest expert load of the microbatch) and the window's `forecast`."""
        with torch.no_grad():
            missed_1 = (max_load > forecast).to(torch.int64).reshape(1)
            if not self._all_reduce(missed_1, FITS_OP, dist.ReduceOp.SUM):
                return forecast, False
            peak_1 = max_load.to(torch.int64).reshape(1).clone()
            return self._all_reduce(peak_1, MAX_OP, dist.ReduceOp.MAX), True
