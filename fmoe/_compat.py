"""Every private torch API fmoe uses, named once: a torch release that changes one breaks this file only.

Each name below wraps (or re-exports) one private API; tests/test_compat.py exercises each for real, so
an upgrade that moves one fails one test here, not a dozen elsewhere. Checked on torch 2.13.

- `grouped_mm`, `grouped_mm_op`, `HAS_GROUPED_MM`: `torch._grouped_mm(a, b, offs=...)` (and its aten op
  `torch.ops.aten._grouped_mm`), one GEMM per row group in a single kernel; torch has no public grouped
  GEMM. Used by fmoe/ops/_grouped_linear.py (the "grouped_mm" backend) and its flop-count test.
  `grouped_mm_syncs`: where that op is a host sync per call (its CUDA fallback), which the automatic
  backend choice avoids.
- `is_functorch_wrapped`, `get_unwrapped`: `torch._C._functorch.is_functorch_wrapped_tensor` /
  `get_unwrapped`, which see through one torch.func wrapper. Used by transforms/tape.py: the tape keys
  deferral on the caller's tensor object, and a deferred thunk must hold tensors that outlive the vjp.
- `disable_functorch`: `torch._C._DisableFuncTorch`, a context that runs its block below every torch.func
  transform. Used by fmoe/parallel/async_comm.py: a gloo wait writes into the collective's output, which
  under torch.func would be an (illegal) in-place write to a captured tensor.
- `flatten_mesh`: `DeviceMesh._flatten(name, backend_override)`, merging several mesh dims into one 1-D
  mesh with its own process group; there is no public way to do that. Used by fmoe/parallel/mesh.py (ep,
  expert groups). `group_options`: `torch._C._distributed_c10d.Backend.Options` (or the backend's own
  Options class), the only carrier of a timeout into a DeviceMesh's groups (`backend_override`): without
  it every subgroup takes torch's default timeout, not the world's. Used by fmoe/parallel/mesh.py.
- `abort_process_group`: `torch.distributed.distributed_c10d._abort_process_group`, which closes a
  group's connections at once (destroy_process_group may block on a dead peer). Used by
  fmoe/parallel/failure.py so that peers blocked in a collective with a failed rank fail now.
- `tree_flatten`, `tree_unflatten`, `tree_map`: `torch.utils._pytree`, the pytree utilities torch.func
  itself uses (same leaf and node rules as our vjp primals); torch 2.13 has no public pytree module.
  Used by transforms/split_vjp.py, remat.py, testing.py and the tests. `tree_flatten_with_path` and
  `keystr` (same module) name a leaf by its path (`[0]['h']`); split_vjp and testing.check_vjp use them in
  error messages only. `register_pytree_node` and `GetAttrKey` (same module) make a class a pytree
  node, as torch.func and torch.compile read them; used by transforms/pytree.py. `SUPPORTED_NODES` (the
  registry: node type -> its flatten / unflatten functions), `is_namedtuple_class`, `TreeSpec` and
  `treespec_leaf` (same module) let transforms/_flat.py walk every registered node as torch's
  `tree_flatten` does, without its per-node TreeSpec objects, and build torch's spec for key paths.
- `tensor_version`: `Tensor._version`, the counter every in-place write bumps (shared by views and
  `detach()`), which tape autograd checks on its saved tensors. Used by transforms/tape.py: a deferred
  weight-grad thunk checks that the tensors it captured were not modified in place before it runs.
- `Function`: a `torch.autograd.Function` whose `apply` skips the `inspect.signature` binding torch's
  `Function.apply` does on every call of a Function with `setup_context` (about 60 us, more than a small
  op's kernel): when every forward argument is given positionally there is nothing to bind. It then
  does what torch's `apply` does next, through `torch._functorch.utils.unwrap_dead_wrappers` and
  `torch._functorch.autograd_function.custom_function_call` (inside torch.func transforms). Used by
  every primitive in fmoe/ops, the differentiable collectives and remat.
- `functorch_active`: `torch._C._are_functorch_transforms_active()`, whether any torch.func transform is
  active. Used by fmoe/ops/_attention.py to pick sdpa's own backward under tape autograd.
- `under_vmap`: `torch._C._functorch.get_interpreter_stack()` and `TransformType.Vmap`, telling whether a
  `torch.func.vmap` is active. Used by transforms/split_vjp.py, which refuses to run under vmap.

- `trace_joint`, `guard_code`, `real_values`: `make_fx` (torch.fx.experimental.proxy_tensor)
  over fake tensors of a `FakeTensorMode` with a `ShapeEnv` (dim 0 of chosen inputs symbolic, through
  `StatelessSymbolicContext` / `DimDynamic`), the shape env's guards as one expression
  (`produce_guards_expression`, evaluated as `evaluate_guards_expression` does, with the symbolic-shapes
  module's `SYMPY_INTERP`), and the contexts that step outside a trace
  (`unset_fake_temporarily`, `disable_proxy_modes_tracing`). Used by transforms/compiled.py, which traces
  a function's forward and backward as one graph to cut it into forward, dx and dw. `is_tracing` says
  whether such a trace (or torch.compile) is running: no host read of a tensor's values then.

This module imports only torch (it is a leaf, so fmoe.transforms may import it); distributed modules are
imported on first use.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch._C._functorch as _functorch
from torch.utils._pytree import (
    SUPPORTED_NODES,
    GetAttrKey,
    TreeSpec,
    is_namedtuple_class,
    keystr,
    register_pytree_node,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_unflatten,
    treespec_leaf,
)

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "SUPPORTED_NODES", "Function", "GetAttrKey", "HAS_GROUPED_MM", "TreeSpec", "abort_process_group",
    "assume_constant", "disable_functorch", "flatten_mesh", "functorch_active", "get_unwrapped", "graph_kept",
    "group_options", "grouped_mm", "grouped_mm_op", "grouped_mm_syncs", "is_functorch_wrapped",
    "is_namedtuple_class", "keystr", "needs_grad", "register_pytree_node", "tensor_version",
    "trace_safe_cache", "tree_flatten", "tree_flatten_with_path", "tree_map", "tree_unflatten",
    "treespec_leaf", "under_vmap",
]

T = TypeVar("T")

HAS_GROUPED_MM: bool = hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """Return `torch._grouped_mm(a, b, offs=offs)`: one product per group of rows of `a`.

    3-D b: a_NK @ b_EKF -> [N, F], rows offs[e-1]:offs[e] of a with b[e]. 2-D b: a_KN @ b_NF -> [E, K, F],
    grouping the shared dim N. `offs` is int32 cumulative group ends [E].
    """
    return torch._grouped_mm(a, b, offs=offs)


def grouped_mm_syncs(dtype: torch.dtype, device: torch.device) -> bool:
    """True when `torch._grouped_mm` in `dtype` on `device` reads its offsets on the host at every call.
    On CUDA its own grouped kernel runs for bf16 on compute capability 9.x and 10.x only (torch 2.13,
    aten/src/ATen/native/cuda/GroupedBlas.cpp, `bf16bf16_grouped_mm`); every other case takes
    `_grouped_mm_fallback`, which copies `offs` to the CPU (a host sync) and loops over the groups (the 9
    syncs of an fp32 MoE block the device check saw). ROCm: bf16 only. CPU: never (the host is the
    device); other devices: not known to."""
    if device.type != "cuda":
        return False
    if dtype != torch.bfloat16:
        return True
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] not in (9, 10)


def grouped_mm_op() -> Any:
    """Return the aten op packet `torch.ops.aten._grouped_mm` (a key for FlopCounterMode mappings)."""
    return torch.ops.aten._grouped_mm


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """True when `t` is a torch.func wrapper (a tensor seen inside vjp / grad / vmap)."""
    return _functorch.is_functorch_wrapped_tensor(t)


def get_unwrapped(t: torch.Tensor) -> torch.Tensor:
    """Return the tensor one torch.func wrapper of `t` holds (same shape; identity kept, no detach)."""
    return _functorch.get_unwrapped(t)


def tensor_version(t: torch.Tensor) -> int:
    """Return `t._version`: how many in-place writes `t`'s data has had (views and detaches share it).

    Returns -1 for an inference tensor, which has no counter (and outside `torch.inference_mode` cannot be
    written in place).
    """
    return -1 if t.is_inference() else t._version


def under_vmap() -> bool:
    """True when the caller runs inside `torch.func.vmap` (at any depth of the torch.func transform stack)."""
    if torch.compiler.is_compiling():
        return False  # dynamo cannot read the interpreter stack; it runs its own vmap over traced code
    if not torch._C._are_functorch_transforms_active():  # eager and no transform: no stack to walk
        return False
    stack = _functorch.get_interpreter_stack()
    return bool(stack) and any(i.key() == _functorch.TransformType.Vmap for i in stack)


def disable_functorch() -> contextlib.AbstractContextManager[Any]:
    """Return a context manager whose block runs below every active torch.func transform."""
    return torch._C._DisableFuncTorch()


def flatten_mesh(mesh: DeviceMesh, name: str, options: Any = None) -> DeviceMesh:
    """Return the 1-D mesh `name` that merges every dim of `mesh` (size = product of its dims); its
    process group is created with `options` (`group_options`; None: torch's defaults)."""
    return mesh._flatten(name, backend_override=options)


def group_options(device_type: str, timeout: timedelta) -> Any:
    """Return process-group options that carry `timeout`, for a DeviceMesh's `backend_override`: the
    backend's own Options class where torch exposes one (ProcessGroupNCCL.Options on CUDA, which NCCL's
    group creation insists on; torch_npu's ProcessGroupHCCL.Options on NPU), else c10d's generic
    `Backend.Options` (gloo takes only the timeout from it)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend

    backend = {"cuda": "nccl", "npu": "hccl"}.get(device_type, "gloo")
    own = getattr(getattr(dist, f"ProcessGroup{backend.upper()}", None), "Options", None)
    if own is None:
        return Backend.Options(backend, timeout)
    options = own()
    options._timeout = timeout
    return options


def abort_process_group(group: dist.ProcessGroup | None = None) -> bool:
    """Abort `group` (default: the world, hence every group); returns False when torch lacks the API."""
    import torch.distributed.distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    if abort is None:
        return False
    abort(group) if group is not None else abort()
    return True


class Function(torch.autograd.Function):
    """`torch.autograd.Function` without the per-call signature binding (see the module docstring).

    Subclasses define `forward(*args)` (no ctx), `setup_context` and `backward` as usual. A call with
    keywords, or with fewer positional arguments than forward takes (defaults to fill in), goes through
    torch's own `apply`."""

    _forward_arity: int | None = None


    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Returns forward's outputs, recorded for autograd (and torch.func) exactly as torch's apply."""
        if torch.compiler.is_compiling():
            # torch.compile traces torch's own apply (its autograd.Function support); the shortcut below
            # is for eager calls, and traced it loses the weight gradients of a Function whose inputs
            # all need gradients.
            return super().apply(*args, **kwargs)
        arity = cls.__dict__.get("_forward_arity")
        if arity is None:
            import inspect

            arity = len(inspect.signature(cls.forward).parameters)
            cls._forward_arity = arity
        if kwargs or len(args) != arity:
            return super().apply(*args, **kwargs)
        if not functorch_active():
            args = _functorch_utils().unwrap_dead_wrappers(args)
            return super(torch.autograd.Function, cls).apply(*args)  # what torch's apply calls here
        if _under_jvp():
            # Forward-mode AD is not built for fmoe's Functions: one line naming the Function and the way out
            # (torch's own message names neither). Not a `jvp` staticmethod: torch.compile refuses to trace
            # a Function that defines one.
            raise NotImplementedError(f"{cls.__module__}.{cls.__name__} has no forward-mode rule: "
                                      "torch.func.jvp and jacfwd do not run through fmoe's ops; "
                                      "use torch.func.vjp, grad or jacrev")
        return _custom_function_call()(cls, *args)


def assume_constant(fn: Callable[..., T]) -> Callable[..., T]:
    """`torch.compiler.assume_constant_result` without importing torch._dynamo (seconds at import, paid by
    every spawned rank): it sets the attribute dynamo reads, `_dynamo_marked_constant`. While compiling,
    a call to `fn` runs eagerly and its result is a constant of the graph."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def trace_safe_cache(maxsize: int) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """`functools.lru_cache(maxsize)` that torch.compile traces past: while compiling (or `trace_joint`
    traces), the wrapped function runs uncached (dynamo would trace the cache wrapper's body anyway, and
    warns that it may be silently wrong; a trace's results are fake); eager calls hit the cache. The
    wrapper keeps `cache_clear` / `cache_info`."""
    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> T:
            if is_tracing():  # a traced call's results are fake tensors: never cached
                return fn(*args, **kwargs)
            return cached(*args, **kwargs)

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        call.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return call

    return wrap


def needs_grad(ctx: Any) -> tuple[bool, ...]:
    """`ctx.needs_input_grad` of an autograd.Function's backward; all True while torch.compile traces it.

    torch 2.13's trace of `torch.func.grad` over a Function reports False for an input that does need a
    gradient when another input needs one too (the weight of a linear whose input is itself computed):
    its gradient would silently be zero (tests/test_transforms_compose.py). Every gradient is computed
    then; autograd drops those nobody asked for.
    """
    if torch.compiler.is_compiling():
        return (True,) * len(ctx.needs_input_grad)
    return ctx.needs_input_grad


def _under_jvp() -> bool:
    """True inside torch.func.jvp (or jacfwd) at any depth of the transform stack."""
    return any(i.key() == _functorch.TransformType.Jvp for i in _functorch.get_interpreter_stack())


def graph_kept() -> bool:
    """Inside a backward: True when autograd keeps the graph after it (retain_graph or create_graph), so its
    saved tensors may be read again. `torch._C._autograd._get_current_graph_task_keep_graph` (what
    AOTAutograd's donated buffers ask); True where this torch cannot tell."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())


def functorch_active() -> bool:
    """True while any torch.func transform (vjp, grad, vmap, ...) is active:
    `torch._C._are_functorch_transforms_active()`."""
    return torch._C._are_functorch_transforms_active()


def _functorch_utils() -> Any:
    import torch._functorch.utils as utils

    return utils


def _custom_function_call() -> Any:
    from torch._functorch.autograd_function import custom_function_call

    return custom_function_call


# ---- graph traces from fake tensors (transforms/compiled.py) ------------------------------------------

_TRACING_GRAPH = [0]  # > 0 while trace_joint runs its function


def is_tracing() -> bool:
    """True while torch.compile traces or `trace_joint` runs: the tensors have no values to read then."""
    return _TRACING_GRAPH[0] > 0 or torch.compiler.is_compiling()


def real_values() -> contextlib.AbstractContextManager[Any]:
    """A context whose block runs on real tensors while `trace_joint` traces (a kernel probe on real
    zeros, not recorded in the graph); a no-op otherwise."""
    if _TRACING_GRAPH[0] == 0:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    stack = contextlib.ExitStack()
    stack.enter_context(unset_fake_temporarily())
    stack.enter_context(disable_proxy_modes_tracing())
    return stack


def trace_joint(fn: Callable[..., Any], inputs: list[Any], dynamic: list[tuple[int, ...]],
                more: Callable[[list[Any]], list[Any]]) -> tuple[Any, list[Any]]:
    """Traces `fn(*inputs, *more(fakes))` into an aten-level `torch.fx.GraphModule` over fake copies of
    `inputs` (tensors; the dims listed in `dynamic[i]` of input i symbolic unless their size is 0 or 1, the
    rest static). `more(fakes)` runs in the fake mode first and returns further inputs, whose sizes may be
    expressions of the inputs' (the cotangents of outputs). Returns (graph module, the fakes of `inputs`,
    for `guard_code`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        sizes = [DimDynamic.DYNAMIC if i in dims else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    fakes = [fake(t, d) for t, d in zip(inputs, dynamic)]
    _TRACING_GRAPH[0] += 1
    try:
        with mode:
            gm = make_fx(fn, tracing_mode="fake")(*fakes, *more(fakes))
    finally:
        _TRACING_GRAPH[0] -= 1
    return gm, fakes


def guard_code(fakes: list[Any]) -> Callable[[list[Any]], bool]:
    """Returns `holds(inputs)`: whether real `inputs` meet the conditions under which a graph traced by
    `trace_joint` over `fakes` holds (static sizes, and what the trace assumed of the symbolic ones). The
    shape env's expression (`produce_guards_expression`) is compiled once: it is asked on every call."""
    shape_env = fakes[0].fake_mode.shape_env if fakes else None
    code = None if shape_env is None else shape_env.produce_guards_expression(fakes, ignore_static=False)
    if code is None:
        return lambda inputs: True
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    compiled = compile(code, "<fmoe trace guards>", "eval")  # what evaluate_guards_expression evals
    names = [f"t{i}" for i in range(len(fakes))]
    return lambda inputs: bool(eval(compiled, SYMPY_INTERP, {"L": dict(zip(names, inputs))}))
