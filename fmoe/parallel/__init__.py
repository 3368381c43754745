"""Expert parallelism: process layout, differentiable collectives, and the dispatchers that use them.

See docs/parallel.md. Everything is an explicit object (no module state): a `ParallelLayout` gives
process groups, a `CommGroup` wraps one with its topology / counters / link model / CPU wait timeout, and a
dispatcher holds CommGroups and implements the dispatch/combine seam (fmoe/dispatch/base.py).
"""

from fmoe.parallel.agreement import AgreementError, agree
from fmoe.parallel.allgather import AllGatherDispatcher
from fmoe.parallel.alltoall import AllToAllDispatcher
from fmoe.parallel.async_comm import CommHandle, wait_work
from fmoe.parallel.collectives import (
    CommGroup,
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    all_to_all,
    all_to_all_async,
    reduce_scatter,
    reduce_scatter_async,
)
from fmoe.parallel.context import ParallelContext
from fmoe.parallel.counters import CommCounters
from fmoe.parallel.failure import CollectiveError, check_peers, fail_fast
from fmoe.parallel.hierarchical import HierarchicalDispatcher
from fmoe.parallel.link_model import LinkModel
from fmoe.parallel.mesh import ParallelLayout
from fmoe.parallel.teardown import close_default_group, exit_process
from fmoe.parallel.topology import Topology
from fmoe.parallel.tp_extends_ep import experts_per_rank
from fmoe.parallel.traffic import (
    alltoall_combine_bytes,
    alltoall_dispatch_bytes,
    expected_alltoall_bytes,
    expected_hierarchical_bytes,
    hierarchical_combine_bytes,
    hierarchical_dispatch_bytes,
)

__all__ = [
    "AgreementError",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "CollectiveError",
    "CommCounters",
    "CommGroup",
    "CommHandle",
    "HierarchicalDispatcher",
    "LinkModel",
    "ParallelContext",
    "ParallelLayout",
    "Topology",
    "agree",
    "all_gather",
    "all_gather_async",
    "all_reduce",
    "all_reduce_async",
    "all_to_all",
    "all_to_all_async",
    "alltoall_combine_bytes",
    "alltoall_dispatch_bytes",
    "check_peers",
    "close_default_group",
    "exit_process",
    "expected_alltoall_bytes",
    "expected_hierarchical_bytes",
    "experts_per_rank",
    "fail_fast",
    "hierarchical_combine_bytes",
    "hierarchical_dispatch_bytes",
    "reduce_scatter",
    "reduce_scatter_async",
    "wait_work",
]
