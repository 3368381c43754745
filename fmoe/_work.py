"""How fmoe waits on c10d work: one rule for the executor's point-to-point and the collectives' handles.

Leaf module (imports only torch), so fmoe.schedule may import it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def wait_work(work: dist.Work, device: torch.device | None, timeout: timedelta | None = None) -> None:
    """Waits c10d work `work` whose tensors live on `device` (None: CPU) as its backend wants: on an
    accelerator `work.wait()` with no timeout (orders the current stream after the collective; a timeout
    would make NCCL / HCCL block the host until it completes); on CPU `work.wait(timeout)` (gloo blocks
    anyway; the timeout bounds it). Raises RuntimeError when a CPU wait reports it timed out.

    On an accelerator the bound is the process group's own timeout, enforced off the host by its
    watchdog (NCCL's aborts the communicator and fails the rank): ParallelLayout creates every group
    with --timeout (the executor's `timeout` in `fmoe train`), so a stalled peer fails the run then. A
    host-side deadline here (`wait(timeout)`, or polling `is_completed()`) would block the host on every
    exchange and end the CPU's run-ahead that hides the device's launches."""
    if (device is not None and device.type != "cpu") or timeout is None:
        work.wait()
        return
    if work.wait(timeout) is False:
        raise RuntimeError(f"the collective did not complete within {timeout}")
