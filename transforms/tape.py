"""The weight-grad tape: where deferred weight gradients wait for the dw pass.

A weight-bearing primitive (a matmul, a grouped GEMM) computes its weight gradient in its
backward. While a tape is *active* (during the dx pass of `split_vjp`), the primitive asks the
tape whether it defers that weight; if so its backward returns only dx and records a thunk that
computes dw later from plain tensors. `WeightGradTape.run()` evaluates the thunks and sums them per
parameter (a weight used twice accumulates).

A thunk runs after the dx pass, on tensors it captured then. Each entry keeps the version counters of
its captured tensors (`tensor_version`, bumped by every in-place write) as they were when it was
recorded; `check()` (and so `run()`) raises `CaptureModifiedError` when one has moved, as tape autograd
does for a saved tensor modified in place, instead of computing dw from the new contents. The check
reads integers only: no copies.

Identity matters: a tape defers exactly the tensors it was built with (the parameter leaves handed
to `split_vjp`). A primitive sees the very same tensor objects in its `forward`, also under nested
`torch.func` transforms, so deferral is decided by object identity. A weight that is an
intermediate (a cast or a slice of a parameter) is not deferred: its gradient flows in the dx pass.

The tape knows nothing of MoE or schedules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fmoe._compat import get_unwrapped, is_functorch_wrapped, tensor_version

# The active tape is process-wide, not a contextvar: the autograd engine may run a backward on its own
# device threads (CUDA), where a contextvar set by the caller would be invisible. One dx pass runs at a
# time per process; `active_tape` nests like a stack.
_ACTIVE: list[WeightGradTape | None] = [None]
# Forwards whose weight gradients may be deferred: split_vjp runs f inside `recording()`. A primitive whose
# plain form is a native op (linear) uses it outside recording, a tape and torch.func: nothing could defer.
_RECORDING: list[int] = [0]


def unwrapped(t: torch.Tensor) -> torch.Tensor:
    """Return the tensor object under every functorch wrapper of `t` (identity kept, no detach)."""
    while is_functorch_wrapped(t):
        t = get_unwrapped(t)
    return t


def plain(t: torch.Tensor) -> torch.Tensor:
    """Return `t` with every functorch wrapper removed and detached from autograd.

    Tensors seen inside a backward under `torch.func.vjp` are wrappers whose transform level dies when
    the vjp returns; a deferred thunk must hold plain tensors.
    """
    return unwrapped(t).detach()


class CaptureModifiedError(RuntimeError):
    """A tensor captured by a deferred weight-grad thunk was modified in place after the thunk was recorded.

    `tensor` is the captured (plain) tensor, `weight_index` the tape position of the weight whose
    gradient needs it, `recorded` / `current` its version counter then and now.
    """

    def __init__(self, message: str, *, tensor: torch.Tensor, weight_index: int, recorded: int,
                 current: int):
        super().__init__(message)
        self.tensor, self.weight_index, self.recorded, self.current = tensor, weight_index, recorded, current


# One queued thunk: (weight index, thunk, captured tensors, their versions when recorded, its accumulating
# form or None).
_Entry = tuple[int, Callable[[], torch.Tensor], tuple[torch.Tensor, ...], tuple[int, ...],
               Callable[[torch.Tensor], torch.Tensor] | None]


class WeightGradTape:
    """Deferred weight-gradient thunks for a fixed list of parameter tensors.

    `defers(w)` is True when `w` is one of the tensors the tape was built with. `record(w, thunk,
    captures)` stores `thunk() -> dw` (same shape as `w`) with the versions of the tensors it reads.
    `check()` raises `CaptureModifiedError` if one of those was modified in place since; `run()` checks,
    then returns one gradient (or None) per parameter, in construction order, and empties the tape.
    """

    def __init__(self, weights: Sequence[torch.Tensor]):
        self._weights = list(weights)
        self._index = {id(w): i for i, w in enumerate(self._weights)}
        self._entries: list[_Entry] = []
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # placeholders' one element

    def placeholder(self, w: torch.Tensor) -> torch.Tensor:
        """Return the stride-0 zero of `w`'s shape that stands in for its deferred gradient in the dx pass
        (no memory, no memset); `is_placeholder` recognises it afterwards."""
        if w.dim() == 0:  # a view of the shared element would let an in-place write reach it
            return w.new_zeros(())
        key = (w.dtype, w.device)
        if key not in self._zeros:
            self._zeros[key] = w.new_zeros(())
        return self._zeros[key].expand(w.shape)

    def is_placeholder(self, g: torch.Tensor | None) -> bool:
        """True when `g` is one of this tape's placeholders as handed out (a sum of two is not: it is a
        real zero tensor). A caller adding the deferred gradient to the dx pass's may then skip the add."""
        z = None if g is None else self._zeros.get((g.dtype, g.device))
        return (z is not None and g.dim() > 0 and all(st == 0 for st in g.stride())
                and g.data_ptr() == z.data_ptr())

    def defers(self, w: torch.Tensor) -> bool:
        """True when the weight gradient of `w` goes on this tape instead of the dx pass."""
        return id(w) in self._index

    def record(self, w: torch.Tensor, thunk: Callable[[], torch.Tensor],
               captures: Sequence[torch.Tensor] = (),
               accumulate: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Queue `thunk() -> dw` for weight `w` (which this tape must defer); returns None.

        `captures`: the tensors `thunk` reads; their version counters are kept, and `check()` / `run()`
        refuse to run the thunk once one of them has been modified in place. `accumulate(out)`, optional:
        adds the same dw into `out` (w's shape and dtype) in place and returns `out`, with no dw tensor
        of its own (a GEMM with beta = 1); giving it also declares that `thunk()` returns a tensor
        nothing else holds. `run(into=...)` uses both.
        """
        if id(w) not in self._index:
            raise ValueError("record(): this tape does not defer that tensor; ask defers(w) first")
        caps = tuple(captures)
        self._entries.append((self._index[id(w)], thunk, caps, tuple(tensor_version(t) for t in caps),
                              accumulate))

    def __len__(self) -> int:
        return len(self._entries)

    def check(self) -> None:
        """Return None if every captured tensor is as it was when recorded; else raise CaptureModifiedError.

        Reads the version counters only (no copies). Nothing is consumed, so the tape can still run
        once the caller knows better.
        """
        for i, _, caps, versions, _ in self._entries:
            for t, v in zip(caps, versions):
                now = tensor_version(t)
                if now != v:
                    raise CaptureModifiedError(
                        f"a tensor of shape {tuple(t.shape)} captured by the deferred weight gradient of "
                        f"weight {i} (shape {tuple(self._weights[i].shape)}) was modified in place after "
                        f"it was recorded (version {v} -> {now}); the deferred gradient would use the new "
                        "contents", tensor=t, weight_index=i, recorded=v, current=now)

    def run(self, into: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor | None]:
        """Evaluate all thunks, summing per weight; returns [dw or None] per weight. Empties the tape.

        `into` (one tensor or None per weight, each of its weight's shape and dtype): sums to add the
        gradients into in place, as AccumulateGrad does. A weight with a sum gets the sum back (each of
        its entries added by its `accumulate` form where it has one, so no dw tensor is made; else made
        and added); a weight without one gets a tensor nothing else holds (a thunk's result that may
        alias something, one with no `accumulate` form, is copied), which the caller may keep as its
        sum. A weight with no entry gets its sum or None.

        Raises CaptureModifiedError (before running any thunk, leaving the tape as it was) when `check()`
        fails, ValueError when `into` does not fit the weights. A thunk that raises while it runs leaves
        the tape emptied and the sums with the entries before it added.
        """
        if into is not None:
            self._check_into(into)
        self.check()
        grads: list[torch.Tensor | None] = [None] * len(self._weights) if into is None else list(into)
        entries, self._entries = self._entries, []
        with torch.no_grad():
            while entries:
                i, thunk, _, _, accumulate = entries.pop()
                if grads[i] is not None and into is not None and accumulate is not None:
                    grads[i] = accumulate(grads[i])
                    continue
                g = thunk()
                if g.shape != self._weights[i].shape:
                    raise RuntimeError(
                        f"deferred weight grad has shape {tuple(g.shape)}, "
                        f"weight has {tuple(self._weights[i].shape)}"
                    )
                if grads[i] is not None:
                    grads[i] = grads[i].add_(g)
                elif into is not None and accumulate is None:
                    grads[i] = g.clone()  # only a declared-fresh result may become the caller's sum
                else:
                    grads[i] = g
        return grads

    def _check_into(self, into: Sequence[torch.Tensor | None]) -> None:
        if len(into) != len(self._weights):
            raise ValueError(f"run(into=...): {len(into)} sums for {len(self._weights)} weights")
        for k, (s, w) in enumerate(zip(into, self._weights)):
            if s is not None and (not isinstance(s, torch.Tensor)
                                  or (s.shape, s.dtype, s.device) != (w.shape, w.dtype, w.device)):
                got = (tuple(s.shape), s.dtype, s.device) if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"run(into=...): weight {k} is {tuple(w.shape)} {w.dtype} on {w.device}, "
                                 f"its sum is {got}")

    def clear(self) -> None:
        """Drop every recorded thunk and the weight references."""
        self._entries = []
        self._weights = []
        self._index = {}
        self._zeros = {}


@contextlib.contextmanager
def active_tape(tape: WeightGradTape | None) -> Iterator[WeightGradTape | None]:
    """Make `tape` the tape that primitives consult while the block runs (None disables deferral)."""
    _ACTIVE.append(tape)
    try:
        yield tape
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Marks a forward whose weight gradients a tape may defer later (split_vjp runs f inside it)."""
    _RECORDING[0] += 1
    try:
        yield
    finally:
        _RECORDING[0] -= 1


def may_defer() -> bool:
    """Whether a primitive running now may have its weight gradient deferred: inside `recording()` (a
    split_vjp forward) or while a tape is active (a dx pass, where remat replays its forward)."""
    return _RECORDING[0] > 0 or _ACTIVE[-1] is not None


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Returns `value` as a list of tensors: itself when a tensor, the tensors of a list or tuple, else []."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for x in value if isinstance(x, torch.Tensor)]
    return []


def _closure_tensors(thunk: Callable[[], Any]) -> list[torch.Tensor]:
    """Return the tensors `thunk` closes over: its closure cells' tensors and tensors in list/tuple cells."""
    found: list[torch.Tensor] = []
    for cell in getattr(thunk, "__closure__", None) or ():
        try:
            found += tensors_in(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return found


def defer_weight_grad(w: torch.Tensor, thunk: Callable[[], torch.Tensor],
                      captures: Sequence[torch.Tensor] | None = None,
                      accumulate: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> torch.Tensor | None:
    """Record `thunk` on the active tape if it defers `w`; returns the placeholder gradient, else None.
    `accumulate`: the thunk's accumulating form, as in `WeightGradTape.record`.

    The low-level step (a primitive's backward calls `weight_grad_or_defer`, which wraps it):

        dw = defer_weight_grad(w, lambda: x_keep.t() @ g_keep, captures=(x_keep, g_keep))
        if dw is None:
            dw = x.t() @ g          # no tape, or not one of its weights: compute now

    `captures`: the (plain) tensors the thunk reads; the tape refuses to run it once one of them was
    modified in place (`CaptureModifiedError`). None (default) takes the tensors in the thunk's closure
    cells (directly or in a list/tuple cell), which covers a lambda over plain tensors.

    The placeholder is a stride-0 zero of w's shape (no memory, no memset), so the dx pass does not
    materialise a zero gradient for every deferred weight as `torch.func.vjp` would for a None.
    """
    tape = _ACTIVE[-1]
    w = unwrapped(w)
    if tape is None or not tape.defers(w):
        return None
    tape.record(w, thunk, _closure_tensors(thunk) if captures is None else captures, accumulate)
    return tape.placeholder(w)


def weight_grad_or_defer(w: torch.Tensor, compute: Callable[..., torch.Tensor], *args: Any,
                         accumulate: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Return the gradient of weight `w` for a primitive's backward: `compute(*args)` now, or, when the
    active tape defers `w`, the stride-0 zero placeholder of w's shape, with `compute` queued on the tape.
    `accumulate(out, *args)`, optional: adds `compute(*args)` into `out` in place without making it (for
    `WeightGradTape.run(into=...)`) and returns `out`; giving it declares that `compute` returns a tensor
    nothing else holds.

    The whole deferred-dw recipe in one call (`w` is the caller's tensor, kept in setup_context):

        dw = weight_grad_or_defer(ctx.w_plain, _weight_grad, x_ND, g_NF)

    The queued thunk holds `plain` aliases of the tensor args (detached, unwrapped, no data copied: they
    must outlive the vjp), and the tape checks their version counters before running it: an arg modified
    in place after the dx pass raises `CaptureModifiedError` at `run()`. Other args pass as they are.
    `compute` must return a tensor of w's shape.
    """
    tape = _ACTIVE[-1]
    if tape is None or not tape.defers(unwrapped(w)):  # the common case first: no aliases to build
        return compute(*args)
    keep = [plain(a) if isinstance(a, torch.Tensor) else a for a in args]
    dw = defer_weight_grad(w, lambda: compute(*keep), [a for a in keep if isinstance(a, torch.Tensor)],
                           None if accumulate is None else lambda out: accumulate(out, *keep))
    return compute(*args) if dw is None else dw
