"""Failure handling: when one rank raises or dies, the others stop with a clear error, never hang.

Three layers, from cheapest to last resort:
  - `fail_fast()`: a rank that raises inside it aborts its process group before re-raising, which
    closes its connections, so peers blocked in a collective with it fail at once instead of waiting.
  - a rank that dies closes its connections too (the OS does it); peers' collectives fail at once.
  - a rank that hangs (alive, never reaching the collective): the process-group timeout bounds the wait
    (`init_process_group(timeout=...)`); `check_peers` (a monitored barrier) names the missing ranks.
Any failure of a collective surfaces as `CollectiveError`, naming the collective and the group's ranks.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch.distributed as dist

from fmoe import _compat


class CollectiveError(RuntimeError):
    """A collective failed because a peer raised, died or timed out."""


def describe_failure(op: str, ranks: list[int] | None, cause: BaseException) -> CollectiveError:
    """Return a CollectiveError for collective `op` over global `ranks` caused by `cause`."""
    where = f" over ranks {ranks}" if ranks is not None else ""
    me = dist.get_rank() if dist.is_initialized() else "?"
    first = str(cause).splitlines()[0] if str(cause) else ""
    return CollectiveError(f"rank {me}: collective {op!r}{where} failed: a peer rank raised, died or "
                           f"timed out ({type(cause).__name__}: {first})")


def abort_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Tear down `group` (default: the world, hence all groups) so peers waiting on us fail now."""
    if not dist.is_initialized():
        return
    try:
        if not _compat.abort_process_group(group):
            dist.destroy_process_group(group)
    except Exception:  # already broken: nothing left to tear down
        pass


@contextlib.contextmanager
def fail_fast(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the block; if it raises, abort `group` (default: every group) first, then re-raise."""
    try:
        yield
    except BaseException:
        abort_process_group(group)
        raise


def check_peers(group: dist.ProcessGroup | None = None, timeout_s: float = 30.0) -> None:
    """Monitored barrier (gloo): return when every rank arrives; else raise CollectiveError naming the
    ranks that did not arrive within `timeout_s`."""
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except Exception as e:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        raise describe_failure("monitored_barrier", ranks, e) from e
