"""The default-device trap: every tensor the library creates must live on the device of the data or
parameters it serves, and this makes a forgotten device fail loudly on CPU.

    with default_device_trap():    # torch's default device is `meta`; data and params stay on CPU
        ...library code...

A factory call without `device=` (`torch.zeros(())`, `torch.tensor(...)`, `torch.randn(generator=g)`)
then makes a meta tensor: mixed with a CPU tensor of one or more dims it raises ("Tensor on device meta is
not on the expected device cpu"), read on the host (`float`, `.item()`, `.tolist()`) it raises, copied to
CPU it raises. On CUDA the same call makes a CPU tensor that NCCL rejects or a kernel mixes with device
memory: the trap is the CPU stand-in for that. Two holes are closed by hand: gloo accepts a meta tensor
without complaint (it moves no bytes), so the collectives below refuse one; and a 0-dim meta tensor
mixes silently with a 0-dim CPU one (the result is meta, caught at its first host read).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

# the c10d entry points fmoe and its executor call through `dist.<name>` (looked up at call time)
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_to_all_single", "broadcast", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def _meta_tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.is_meta else []
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _meta_tensors(v)]
    if isinstance(x, dist.P2POp):
        return _meta_tensors(x.tensor)
    return []


def _refuse_meta(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        bad = _meta_tensors(list(args) + list(kwargs.values()))
        if bad:
            raise RuntimeError(f"default-device trap: dist.{name} got a meta tensor {tuple(bad[0].shape)} "
                               "(allocated without a device; on CUDA it would be a CPU tensor NCCL rejects)")
        return fn(*args, **kwargs)

    return checked


@contextlib.contextmanager
def default_device_trap() -> Iterator[None]:
    """Run the block with torch's default device `meta` and c10d refusing meta tensors; both restored on
    exit. Create the test's own data with an explicit device (or before entering)."""
    old = torch.get_default_device()
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    for n, fn in saved.items():
        setattr(dist, n, _refuse_meta(n, fn))
    torch.set_default_device("meta")
    try:
        yield
    finally:
        # back to no default device at all when that was CPU: set_default_device("cpu") would leave a
        # global DeviceContext function mode behind, which later tests' torch-function hooks would see
        torch.set_default_device(None if old == torch.device("cpu") else old)
        for n, fn in saved.items():
            setattr(dist, n, fn)


def trapped(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Returns fn(*args, **kwargs) run inside the trap (picklable: a spawned rank's entry point)."""
    with default_device_trap():
        return fn(*args, **kwargs)
