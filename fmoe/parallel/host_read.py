"""Reading a dispatcher's split sizes to the host without draining the compute stream.

    sizes = read_ints(lambda: torch.cat([...counts...]), device, after=handles)   # host ints

An expert-parallel layer needs its all-to-all's split sizes on the host (c10d takes them as Python
ints): one read per layer. `t.tolist()` on a device copies on the current (compute) stream and blocks the
host until that stream has run everything queued on it, e.g. the other microbatch's compute an fb-overlap
pair queued while the count exchange travelled: the device then idles until the host launches again.
Here, on an accelerator, a side stream waits for the count exchange only (`after`: its handles'
`order_stream`, which makes the current stream wait for the collective's end, c10d's `work.wait()`),
computes the sizes there, copies them into pinned host memory (non-blocking) and records an event; the
host waits for that event alone. The sizes' inputs were written before the exchange was issued (c10d
orders its stream after the compute stream at issue) or by the exchange, so the side stream sees them
complete. Megatron copies its split sizes the same way (a side stream and an event). On CPU there is no
stream: `tolist()`.

The other way, `upload_ints` puts host ints on the device in one non-blocking copy from pinned memory
(`torch.tensor(ints, device=...)` and a pageable `.to(device)` each block the host until the copy is
done, i.e. until the compute stream has reached it).

Checked on CPU against a stream model (tests/test_host_syncs.py), never on a GPU or NPU.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

_SIDE: dict[torch.device, Any] = {}  # one side stream per device, made on first use


def on_host(device: torch.device) -> bool:
    """True when `device` is the host's (CPU: no stream to spare, reads are free)."""
    return device.type == "cpu"


def side_stream(device: torch.device) -> Any:
    """Returns the side stream the reads of `device` run on (a `torch.Stream`, made once per device)."""
    if device not in _SIDE:
        _SIDE[device] = torch.Stream(device=device)
    return _SIDE[device]


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """Returns an empty pinned host tensor of `t`'s shape and dtype (the target of a non-blocking copy)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)


def read_ints(make: Callable[[], torch.Tensor], device: torch.device, after: Sequence[Any] = ()) -> list:
    """Returns `make()`'s values as (nested) Python ints, `make` being run where the read is cheapest:
    on CPU `make().tolist()` (`after` is already waited); on an accelerator on the side stream, after the
    exchanges `after` (CommHandles), the host waiting for that stream's event only (module docstring)."""
    if on_host(device):
        return make().tolist()
    side = side_stream(device)
    with side:
        for h in after:
            h.order_stream()
        t = make()
        host = pinned_like(t)
        host.copy_(t, non_blocking=True)
        done = side.record_event()
    done.synchronize()
    return host.tolist()


def upload_ints(ints: Sequence[int], device: torch.device) -> torch.Tensor:
    """Returns int64 [len(ints)] holding `ints` on `device`: on an accelerator one non-blocking copy from
    pinned host memory (no host wait), on CPU the host tensor itself (made from a buffer, no copy)."""
    host = torch.frombuffer(array.array("q", ints), dtype=torch.int64) if ints else torch.zeros(
        0, dtype=torch.int64)
    if on_host(device):
        return host
    return host.pin_memory().to(device, non_blocking=True)
