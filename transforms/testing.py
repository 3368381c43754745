"""Tools for users' own gradient property tests: check_vjp, assert_close, hypothesis strategies, and
the memory of a backward.

    check_vjp(f, *primals)   # float64 central difference in one random direction: <c, J t> == <J^T c, t>
    grads, peak = tracked_peak_bytes(lambda: grads_by("split_vjp(func)", f, params, x, ct))

Strategies build parameter pytrees (nested dicts of tensors) and input tensors with random shapes
and dtypes, so a research script can property-test its own layers in a few lines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from fmoe._compat import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

# rtol/atol per dtype for comparing two computations of the same quantity in that dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-10),
    torch.float32: (2e-4, 2e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (1e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Return (rtol, atol) for comparing results computed in `dtype`."""
    return TOLERANCES.get(dtype, (1e-5, 1e-6))


def assert_close(actual: Any, expected: Any, *, dtype: torch.dtype | None = None, scale: float = 1.0,
                 msg: str = "") -> None:
    """Assert two pytrees of tensors are close with dtype-aware tolerances (scaled by `scale`).

    Fails on NaN/Inf anywhere in `actual` and on any structure or shape mismatch.
    """
    a_leaves, a_spec = tree_flatten(actual)
    e_leaves, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        raise AssertionError(f"{msg} pytree structures differ: {a_spec} vs {e_spec}")
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if a is None and e is None:
            continue
        if isinstance(a, torch.Tensor) != isinstance(e, torch.Tensor):
            raise AssertionError(f"{msg} leaf {i}: {type(a).__name__} vs {type(e).__name__}")
        if not isinstance(a, torch.Tensor):
            if a != e:
                raise AssertionError(f"{msg} leaf {i}: {a!r} != {e!r}")
            continue
        if not torch.isfinite(a).all():
            raise AssertionError(f"{msg} leaf {i}: non-finite values in actual")
        rtol, atol = tolerance(dtype or a.dtype)
        torch.testing.assert_close(a.to(e.dtype), e, rtol=rtol * scale, atol=atol * scale,
                                   msg=lambda m, i=i: f"{msg} leaf {i}: {m}")


def _to64(tree: Any) -> Any:
    return tree_map(lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, tree)


def check_vjp(
    f: Callable[..., Any],
    *primals: Any,
    vjp: Callable[..., tuple[Any, Callable[[Any], Any]]] | None = None,
    eps: float = 1e-6,
    rtol: float = 1e-6,
    generator: torch.Generator | None = None,
) -> tuple[float, float]:
    """Check `vjp` of `f` against `f` run plainly and a float64 central difference in one random direction.

    Casts floating primals to float64. First, as JAX's check_vjp does, the primal output `out` of
    `vjp(f, *primals)` must equal `f(*primals)` run plainly (so a custom rule whose forward under a
    transform computes something else fails). Then draws a tangent t (over primals) and a cotangent c
    (over the output), and compares <c, (f(x + eps t) - f(x - eps t)) / 2 eps> with <vjp(c), t>.
    `vjp(f, *primals)` must return `(out, fn)` with `fn(c)` giving one gradient pytree per primal
    (default `torch.func.vjp`). Returns the two numbers; raises AssertionError when either check fails,
    naming each failing direction as `output<path> / primals<path>`: the output leaf the cotangent was on
    and the input leaf the tangent was on (`_failing_directions`).
    """
    vjp = vjp or torch.func.vjp
    gen = generator or torch.Generator().manual_seed(0)
    primals64 = _to64(primals)

    def rand_like(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return torch.randn(t.shape, generator=gen, dtype=t.dtype)
        return None

    tangent = tree_map(rand_like, primals64)
    out, vjp_fn = vjp(f, *primals64)
    try:
        assert_close(out, f(*primals64))
    except AssertionError as e:
        raise AssertionError(f"check_vjp: primal output under vjp differs from f(*primals): {e}") from e
    cot = tree_map(rand_like, out)
    fd = _fd_dot(f, primals64, tangent, cot, eps)
    an = _dot(tree_flatten(vjp_fn(cot))[0], tree_flatten(tangent)[0])
    if not _agree(fd, an, rtol, eps):
        where = _failing_directions(f, vjp, primals64, tangent, cot, eps, rtol)
        raise AssertionError(f"check_vjp: {_downcast(f, primals64, eps)}finite difference <c, J t> = "
                             f"{fd:.10g}, vjp <J^T c, t> = {an:.10g}; {where}")
    return fd, an


class _Downcasts(TorchDispatchMode):
    """Remember the first op that turns float64 inputs into a lower-precision floating output."""

    def __init__(self) -> None:
        super().__init__()
        self.first: tuple[str, torch.dtype] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.first is None:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            low = [t.dtype for t in outs if t.dtype != torch.float64]
            if low and any(t.dtype == torch.float64 for t in ins):
                self.first = (str(func.overloadpacket), low[0])
        return out


def _downcast(f: Callable[..., Any], primals64: Any, eps: float) -> str:
    """'' when f computes in float64 throughout, else the sentence naming where it leaves float64 (then the
    central difference's eps-sized steps drown in rounding and the check compares noise)."""
    mode = _Downcasts()
    with torch.no_grad(), mode:
        f(*primals64)
    if mode.first is None:
        return ""
    op, dtype = mode.first
    low = str(dtype).removeprefix("torch.")
    return (f"f computes in {low} ({op} turned float64 inputs into {low}), so the float64 central difference "
            f"(eps {eps:g}) is rounding noise: keep f in its inputs' dtype (no .float() or .to({dtype})) to "
            "check it; ")


def _dot(xs: Sequence[Any], ys: Sequence[Any]) -> float:
    """Sum of <x, y> over the pairs of leaves where both are tensors (None: a leaf with no direction)."""
    return sum(float((x * y).sum()) for x, y in zip(xs, ys) if x is not None and y is not None)


def _fd_dot(f: Callable[..., Any], primals: Any, tangent: Any, cot: Any, eps: float) -> float:
    """<cot, (f(primals + eps tangent) - f(primals - eps tangent)) / 2 eps>."""
    def shifted(sign: float) -> Any:
        return tree_map(lambda p, t: p if t is None else p + sign * eps * t, primals, tangent)

    diff = [None if p is None else p - m
            for p, m in zip(tree_flatten(f(*shifted(1.0)))[0], tree_flatten(f(*shifted(-1.0)))[0])]
    return _dot(tree_flatten(cot)[0], diff) / (2 * eps)


def _agree(fd: float, an: float, rtol: float, eps: float) -> bool:
    # the absolute term covers the central difference's O(eps^2) error when both are near 0
    return abs(fd - an) <= rtol * max(1.0, abs(fd), abs(an)) + 1e3 * eps * eps


def _only(tree: Any, k: int) -> Any:
    """`tree` with every tensor leaf but the k-th (in flatten order) zeroed; None leaves stay None."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([t if i == k or t is None else torch.zeros_like(t) for i, t in enumerate(leaves)],
                          spec)


def _failing_directions(f: Callable[..., Any], vjp: Callable[..., Any], primals: Any, tangent: Any, cot: Any,
                        eps: float, rtol: float) -> str:
    """Name the (output leaf, input leaf) pairs whose <c_out, J t_in> and <J^T c_out, t_in> disagree.

    Only run after the whole check failed: it calls `vjp` once per output leaf (a fresh one each time, as
    a custom rule's fn may run once only) and `f` twice per input leaf.
    """
    outs = [(f"output{keystr(path)}", k) for k, (path, c) in enumerate(tree_flatten_with_path(cot)[0])
            if c is not None]
    ins = [(f"primals{keystr(path)}", k) for k, (path, t) in enumerate(tree_flatten_with_path(tangent)[0])
           if t is not None]
    wrong = []
    for out_name, j in outs:
        cot_j = _only(cot, j)
        grads = tree_flatten(vjp(f, *primals)[1](cot_j))[0]
        for in_name, i in ins:
            t_i = _only(tangent, i)
            fd, an = _fd_dot(f, primals, t_i, cot_j, eps), _dot(grads, tree_flatten(t_i)[0])
            if not _agree(fd, an, rtol, eps):
                wrong.append(f"{out_name} / {in_name}: {fd:.10g} vs {an:.10g}")
    if not wrong:
        return "no single output / input pair is off by more than the tolerance, only their sum"
    return "wrong (cotangent on output / tangent on input: finite difference vs vjp): " + "; ".join(wrong)


# ---- hypothesis strategies ---------------------------------------------------------------------

float_dtypes = st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16])


def _check_draw(name: str, dtype: torch.dtype, scale: float) -> None:
    """Raise TypeError unless `dtype` is floating, ValueError unless `scale` is a finite number >= 0.

    Normal draws cast to an integer dtype are mostly 0 (to bool all True, to complex real only): a strategy
    that silently drew those would test next to nothing, so it refuses them when it is built.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name}: dtype must be a floating dtype, got {dtype} (draw integer tensors with "
                        "st.integers and torch.tensor)")
    number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if not (number and math.isfinite(scale) and scale >= 0):
        raise ValueError(f"{name}: scale must be a finite number >= 0, got {scale!r}")


# The strategies are `st.builds` of the two functions below, so a failing example prints as the call
# that rebuilds its tensors (`seeded_tensor(shape=(64, 64), dtype=torch.float64, scale=1.0, seed=7)`), not
# as the tensors' values: one line where a 64 x 64 tensor printed hundreds.
_SEEDS = st.integers(0, 2**31 - 1)


def _check_shape(name: str, where: str, shape: Any, tuple_only: bool = False) -> None:
    """TypeError unless `shape` is a shape: a tuple (or for `tensors` any sequence but a string) of ints
    >= 0; the message names where it was given (`where`) and what to write instead."""
    kinds = (tuple,) if tuple_only else (tuple, list, torch.Size)
    if not (isinstance(shape, kinds) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                             for n in shape)):
        hint = f" (write ({shape},) for one dimension)" if isinstance(shape, int) else (
            f" (write {tuple(shape)})" if isinstance(shape, list) else "")
        raise TypeError(f"{name}: {where} must be a shape, a tuple of ints >= 0 such as (2, 3), got "
                        f"{shape!r}{hint}")


def _check_shapes(shapes: Any, where: str = "shapes") -> None:
    """param_pytrees' `shapes`: dicts and lists (of dicts, lists or shapes) whose leaves are shapes
    (tuples of ints); a list of ints is a shape written as a list, and refused as one."""
    items = shapes.items() if isinstance(shapes, dict) else enumerate(shapes) if (
        isinstance(shapes, list) and not all(isinstance(n, int) for n in shapes)) else None
    if items is None:
        _check_shape("param_pytrees", where, shapes, tuple_only=True)
        return
    for key, value in items:
        _check_shapes(value, f"{where}[{key!r}]")


def seeded_tensor(shape: Sequence[int], dtype: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    """The tensor `tensors(shape, dtype, scale)` draws for `seed`: N(0, scale^2) entries."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=g, dtype=torch.float64) * scale).to(dtype)


def seeded_pytree(shapes: dict[str, Any], dtype: torch.dtype, scale: float, seed: int) -> dict[str, Any]:
    """The pytree `param_pytrees(shapes, dtype, scale)` draws for `seed`."""
    leaves, spec = tree_flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    # One seed, the leaves drawn one after another from its generator: a seed per leaf made equal leaves
    # whenever hypothesis drew equal seeds, which it does often (always 0 when it shrinks).
    g = torch.Generator().manual_seed(seed)
    return tree_unflatten([(torch.randn(tuple(s), generator=g, dtype=torch.float64) * scale).to(dtype)
                           for s in leaves], spec)


def tensors(shape: Sequence[int], dtype: torch.dtype = torch.float64,
            scale: float = 1.0) -> st.SearchStrategy[torch.Tensor]:
    """A tensor of `shape` and `dtype` with N(0, scale^2) entries from a hypothesis-drawn seed. Raises
    TypeError for a shape that is not a sequence of ints >= 0 or a dtype that is not floating, ValueError
    for a scale that is not finite and >= 0."""
    _check_draw("tensors", dtype, scale)
    _check_shape("tensors", "shape", shape)
    return st.builds(seeded_tensor, shape=st.just(tuple(shape)), dtype=st.just(dtype), scale=st.just(scale),
                     seed=_SEEDS)


def param_pytrees(shapes: dict[str, Any], dtype: torch.dtype = torch.float64,
                  scale: float = 0.5) -> st.SearchStrategy[dict[str, Any]]:
    """A nested dict of tensors whose structure and shapes follow `shapes` (dict of tuples or dicts), its
    leaves drawn independently. Raises as `tensors` does for `dtype` and `scale`, TypeError naming the key
    of a shape that is not a tuple of ints >= 0."""
    _check_draw("param_pytrees", dtype, scale)
    _check_shapes(shapes)
    return st.builds(seeded_pytree, shapes=st.just(shapes), dtype=st.just(dtype), scale=st.just(scale),
                     seed=_SEEDS)


def tracked_peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run `fn()` and return (its result, the peak of tensor memory allocated during it, in bytes).

    Counts every allocation and free of torch's allocators (torch.profiler's memory events), relative to
    what was allocated when `fn` started: deterministic for a given computation, independent of malloc
    and of the load on the machine, so tests can assert on it. Slow (a profiler run); for tests.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return out, peak


DIFF_MODES = ("autograd", "func.vjp", "func.vjp(retain_graph=False)", "split_vjp(func)",
              "split_vjp(autograd)")


def grads_by(mode: str, f: Callable[..., torch.Tensor], params: Any, x: torch.Tensor,
             ct: torch.Tensor) -> list[torch.Tensor]:
    """Return the gradients of <f(params, x), ct> (params' leaves in tree order, then x) computed one way.

    `mode` (one of DIFF_MODES): "autograd", tape autograd on fresh leaves (`backward`); "func.vjp",
    `torch.func.vjp` with its vjp_fn called as is (retain_graph=True: the graph's saved tensors live until
    the vjp_fn does); "func.vjp(retain_graph=False)", freeing each as the backward passes it;
    "split_vjp(func)" / "split_vjp(autograd)", `split_vjp` with that engine, dx then dw. For comparing
    the ways' gradients and, with `tracked_peak_bytes`, their peak memory.
    """
    from fmoe.transforms.split_vjp import split_vjp

    if mode == "autograd":
        leaves, spec = tree_flatten(params)
        leaves = [t.detach().requires_grad_() for t in leaves]
        x = x.detach().requires_grad_()
        f(tree_unflatten(leaves, spec), x).backward(ct)
        return [t.grad for t in leaves] + [x.grad]
    # The output is dropped before the backward, as tape autograd's temporary is (and a pipeline stage's,
    # once sent on).
    if mode in ("func.vjp", "func.vjp(retain_graph=False)"):
        vjp = torch.func.vjp(f, params, x)[1]
        dp, dx = vjp(ct, retain_graph=mode == "func.vjp")
        return tree_flatten(dp)[0] + [dx]
    engines = {"split_vjp(func)": "func", "split_vjp(autograd)": "autograd"}
    if mode not in engines:
        raise ValueError(f"grads_by: mode must be one of {DIFF_MODES}, got {mode!r}")
    vjp_dx = split_vjp(f, params, x, engine=engines[mode])[1]
    (dx,), vjp_dw = vjp_dx(ct)
    return tree_flatten(vjp_dw())[0] + [dx]
