"""Host-sync counting: the operations that would make the host wait for an accelerator, counted on CPU.

    with count_syncs() as c:
        y = f(x)
    c.total, c.by_kind(), c.events          # events: (kind, "file:line" of the fmoe caller)

On a device the host can run ahead of the kernels it launches except where it needs a value the device
computes (or copies a host value into device memory with a blocking copy). On CPU nothing waits, so those
points are counted by what they are:
- "item": `aten._local_scalar_dense`, i.e. `.item()`, `int(t)`, `float(t)`, `bool(t)` (an `if` on a
  tensor), `t.__index__`;
- "tolist", "cpu", "numpy": `Tensor.tolist()`, `.cpu()`, `.numpy()`, `.to("cpu")` (the string form; a
  `.to(x.device)` cannot be told apart from a no-op on CPU and is not counted);
- data-dependent output sizes, which read a device value to size their output: `bincount`, `nonzero`
  (not `nonzero_static`), `unique*`, `masked_select`, `repeat_interleave` without `output_size`,
  `equal`, and indexing or `index_put` with a boolean mask;
- "upload": `torch.tensor` / `torch.as_tensor` of Python data (`aten.lift_fresh`): a blocking host-to-device
  copy when created on a device (or moved there).
Aten-level events come from a `TorchDispatchMode`, which sees the ops of custom autograd Functions'
forwards and backwards inside `torch.func.vjp` and of the autograd engine's backward (a
`TorchFunctionMode` sees neither: checked on torch 2.13); the Python-level ones (`tolist` and friends,
which dispatch no aten op on CPU) come from patching `torch.Tensor` while the context is open.

Legend (docs/moe.md): none (no tensor shapes here).
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# aten ops whose output size (or result) is read from the device
_SIZED = {
    _aten.bincount.default: "bincount",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.equal.default: "equal",
    _aten._unique.default: "unique",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten._local_scalar_dense.default: "item",
    _aten.lift_fresh.default: "upload",
}


def _caller() -> str:
    """file:line of the innermost frame in fmoe (or, failing that, outside torch and this module)."""
    f = sys._getframe(2)
    fallback = None
    while f is not None:
        name = f.f_code.co_filename
        if not name.endswith("sync_count.py") and "/torch/" not in name:
            where = f"{'/'.join(name.split('/')[-2:])}:{f.f_lineno}"
            if "/fmoe/" in name or "/transforms/" in name:
                return where
            fallback = fallback or where
        f = f.f_back
    return fallback or "?"


def _bool_index(indices: object) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in (indices or ()))


@dataclass
class SyncCounter:
    """The host syncs seen while a `count_syncs` context was open: events (kind, caller), in order."""

    events: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        """Number of host syncs."""
        return len(self.events)

    def by_kind(self) -> dict[str, int]:
        """{kind: count}."""
        return dict(collections.Counter(k for k, _ in self.events))

    def by_caller(self) -> dict[str, int]:
        """{"kind at file:line": count}: where the syncs come from."""
        return dict(collections.Counter(f"{k} at {w}" for k, w in self.events))

    def add(self, kind: str) -> None:
        """Record one sync of `kind` at the current caller."""
        self.events.append((kind, _caller()))


class _Mode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _SIZED.get(func)
        if kind is None:
            if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                kind = "repeat_interleave"
            elif func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and (
                    _bool_index(args[1])):
                kind = "bool_index"
        if kind is not None:
            self.counter.add(kind)
        return func(*args, **kwargs)


def _patched(counter: SyncCounter) -> dict[str, object]:
    """Replacements for the Tensor methods that read data on the host without an aten op."""
    orig = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy", "to")}

    def wrap(name: str):
        def f(self, *args, **kwargs):
            counter.add(name)
            return orig[name](self, *args, **kwargs)
        return f

    def to(self, *args, **kwargs):
        dev = kwargs.get("device", args[0] if args else None)
        if isinstance(dev, str) and dev.startswith("cpu"):
            counter.add("cpu")
        return orig["to"](self, *args, **kwargs)

    return {**{n: wrap(n) for n in ("tolist", "cpu", "numpy")}, "to": to, "_orig": orig}


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    """Count host syncs (module docstring) until the block exits; yields the `SyncCounter`. Not reentrant
    across threads; nested contexts each count what runs inside them."""
    counter = SyncCounter()
    patches = _patched(counter)
    orig = patches.pop("_orig")
    try:
        for name, fn in patches.items():
            setattr(torch.Tensor, name, fn)
        with _Mode(counter):
            yield counter
    finally:
        for name, fn in orig.items():
            setattr(torch.Tensor, name, fn)


# ---- per-layer measurements (shared by tests/test_host_syncs.py and benchmarks/host_syncs.py) -------

def block_syncs(params: dict, x_BSD: torch.Tensor, cfg: object, dispatcher: object = None) -> dict[str, int]:
    """Host syncs of one MoE block (fmoe.model.block) on one microbatch: {"forward", "dx", "dw"}, the
    forward under split_vjp, then its dx pass and its deferred dw pass."""
    from fmoe.model import block
    from fmoe.parallel.context import ParallelContext
    from fmoe.transforms import split_vjp

    par = ParallelContext(dispatcher=dispatcher)
    with count_syncs() as fwd:
        (y, aux_loss), vjp_dx = split_vjp(lambda p, x: _pair(block(p, x, cfg, parallel=par, check=False)),
                                          params, x_BSD)
    with count_syncs() as dx:
        _, vjp_dw = vjp_dx((torch.ones_like(y), torch.ones_like(aux_loss)))
    with count_syncs() as dw:
        vjp_dw()
    return _result(fwd, dx, dw)


def _result(fwd: SyncCounter, dx: SyncCounter, dw: SyncCounter) -> dict:
    """{"forward", "dx", "dw": counts, "where": {the same: {"kind at file:line": count}}}."""
    return {"forward": fwd.total, "dx": dx.total, "dw": dw.total,
            "where": {"forward": fwd.by_caller(), "dx": dx.by_caller(), "dw": dw.by_caller()}}


def _pair(out: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    y, aux = out
    return y, aux.loss


def moe_syncs(params: dict, x_TD: torch.Tensor, cfg: object, dispatcher: object = None) -> dict[str, int]:
    """Host syncs of the MoE layer function (fmoe.model.moe) under plain autograd: {"forward",
    "backward"}."""
    from fmoe.model import moe

    leaves = [t.requires_grad_() for t in _leaves(params)]
    with count_syncs() as fwd:
        y, aux = moe(params, x_TD, cfg, dispatcher=dispatcher, check=False)
    with count_syncs() as bwd:
        torch.autograd.grad((y.sum() + aux.loss,), leaves, allow_unused=True)
    return {"forward": fwd.total, "backward": bwd.total, "where": {"forward": fwd.by_caller(),
                                                                              "backward": bwd.by_caller()}}


def _leaves(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    return [tree]


def phased_block_syncs(params: dict, x_BSD: torch.Tensor, cfg: object, dispatcher: object) -> dict[str, int]:
    """Host syncs of one MoE block run as a pipeline runs it: its phases (fmoe.phases.moe_layer, the
    model's own) on one stage of one microbatch through the executor (fmoe.schedule.execute, schedule
    zb_h1(1, 1) unfused: F, I, W), compute phases under split_vjp and the exchanges issued and waited as
    the executor issues them. Returns {"forward" (F), "dx" (I: the dx passes and the transposed exchanges),
    "dw" (W)}; the block's output and balancing loss each take the cotangent 1."""
    from fmoe.outline import alone
    from fmoe.parallel.context import ParallelContext
    from fmoe.phases import H, moe_layer
    from fmoe.schedule import zb_h1
    from fmoe.schedule.execute import execute
    from fmoe.schedule.options import ExecOptions
    from fmoe.transforms.program import Layer, Phase, StageProgram

    def given(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:  # the block's input, from the data
        return {H: meta["x_BSD"]}, meta

    def summed(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:  # its output's cotangent: ones
        return {"out": acts[H].sum()}, meta

    layers = (Layer("in", (Phase("in", "compute", fn=given),)),
              moe_layer(cfg, alone(), ParallelContext(dispatcher=dispatcher)),
              Layer("out", (Phase("out", "compute", fn=summed, losses=("out",)),)))
    counters: dict[str, SyncCounter] = {}

    @contextlib.contextmanager
    def counted(op: object) -> Iterator[None]:
        with count_syncs() as counters[op.kind]:
            yield

    execute(zb_h1(1, 1), 0, {0: StageProgram(0, layers, params)}, lambda mb: {"x_BSD": x_BSD},
            options=ExecOptions(fuse_iw=False), around_op=counted)
    return _result(counters["F"], counters["I"], counters["W"])
