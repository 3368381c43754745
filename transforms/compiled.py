"""compiled_split: a split backward whose forward, dx pass and dw pass are three compiled graphs.

    split = CompiledSplit(f)                          # f(params, *args, *consts) -> (out, aux)
    out, vjp_dx, aux = split(params, *args, consts=(meta,))
    dargs, vjp_dw = vjp_dx(cotangent)
    dparams = vjp_dw()

The same contract as `split_vjp(f, params, *args, has_aux=True, engine="autograd")` (DxFn, DwFn: one
call each, `into` sums, zeros for unused leaves), but nothing of f runs eagerly once it is traced:

    forward(params, args, consts)      -> (out, aux tensors, residuals)
    dx(residuals, cotangent)           -> (dargs, dw residuals)
    dw(dw residuals)                   -> dparams

Residuals are explicit tensors handed from one graph to the next, as JAX's custom_vjp hands them, so no
closure leaves a compiled region (a vjp closure that escapes one is why torch.compile and a split backward
do not mix elsewhere). How the three are found: f's forward and its backward (torch.autograd.grad with
a symbolic cotangent) are traced as one aten graph from fake tensors (`_compat.trace_joint`); the nodes the
outputs need are the forward, those the input gradients need (and the forward did not compute) the dx
pass, and the rest the parameter gradients need the dw pass. Each is compiled on its own by
`torch.compile` (`backend`, dynamic sizes).

Sizes: a first trace is static; a call whose args' or consts' sizes differ from it is traced again with
those dims symbolic (dynamo's automatic dynamic shapes: row counts change from one microbatch to the next
under dropless routing), parameters' sizes always static. A trace holds under the conditions its shape
environment recorded (`_compat.guard_code`), checked on every call, so a structure traces once or twice.
An object in `args` or `consts` with a `traced_view()` method is replaced by what it returns, the object as
a trace sees it: host-side values that vary from call to call (split sizes, which only exchanges read and
a trace never does) dropped, so they neither key nor break a trace. Other non-tensor leaves of `params`,
`args` and `consts` are part of the key (equal values share a trace); a non-tensor output leaf that came
from a symbolic size is refused (it would be baked into the graph). `compiles` counts the traces.

Knows nothing of MoE or schedules; the executor uses it for its compute phases under `compile=True`.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from fmoe._compat import guard_code, trace_joint, tree_flatten, tree_map, tree_unflatten
from fmoe.transforms._flat import flatten, unflatten
from fmoe.transforms.split_vjp import _is_diff, _Once, _output_and_aux, _zeros

_TENSOR = object()  # an aux leaf the forward graph returns
_STATIC_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)


@dataclasses.dataclass
class _Graphs:
    """One trace of f: its three compiled graphs and how their inputs and outputs map to f's leaves."""

    holds: Callable[[list[Any]], bool]  # whether a call's tensors meet the trace's shape guards
    shapes: list[tuple[int, ...]]  # the traced inputs' sizes (what a later trace compares with)
    forward: Callable[..., Any]
    dx: Callable[..., Any]
    dw: Callable[..., Any]
    n_out: int  # forward's outputs: out tensors, aux tensors, then residuals
    n_aux: int
    out_spec: Any
    aux_skeleton: list[Any]  # aux leaves, tensors as _TENSOR
    aux_spec: Any
    dx_from: list[tuple[str, int]]  # per dx input: ("res", k) a forward residual, ("ct", k) a cotangent leaf
    dw_from: list[tuple[str, int]]  # per dw input: "res", "ct", or ("dx", k) the dx graph's k-th extra output
    dargs_none: list[bool]  # per darg output (the dx graph's first outputs): None, so zeros
    dparams_none: list[bool]
    darg_pos: list[int]  # per darg output: its leaf among the args'
    dparam_pos: list[int]  # per dparam output: its leaf among the params'


def _static(x: Any) -> Any:
    if isinstance(x, _STATIC_TYPES):
        return x
    if isinstance(x, tuple) and all(isinstance(v, _STATIC_TYPES) for v in x):
        return x
    raise TypeError(f"compiled_split: a non-tensor leaf of type {type(x).__name__} ({x!r:.80}) cannot be a "
                    "trace's constant; make it a registered pytree (transforms.pytree_dataclass) or pass "
                    "python scalars")


def _has_view(x: Any) -> bool:
    return hasattr(x, "traced_view")


def _traced_view(tree: Any, originals: list[Any]) -> Any:
    """`tree` with every object that has a `traced_view()` method replaced by what it returns: the object as
    a trace sees it, host-side values that vary from call to call (split sizes) dropped. The objects
    replaced are appended to `originals`, in tree order."""
    def view(x: Any) -> Any:
        if not _has_view(x):
            return x
        originals.append(x)
        return x.traced_view()

    return tree_map(view, tree, is_leaf=_has_view)


@dataclasses.dataclass(frozen=True)
class _Passed:
    """An aux leaf that is the k-th replaced object of the call's args and consts, passed through: the call's
    own object comes back (with its host values), not the trace's view."""

    k: int


def _changed_dims(traces: list[_Graphs], inputs: list[torch.Tensor], n_params: int) -> list[tuple[int, ...]]:
    """The dims to trace symbolic: of the args' and consts' tensors (never the parameters'), those whose size
    differs from an earlier trace's of the same structure (as dynamo's automatic dynamic shapes do); none
    for a first trace."""
    dims: list[set[int]] = [set() for _ in inputs]
    for g in traces:
        for k, (t, old) in enumerate(zip(inputs, g.shapes)):
            if k >= n_params and len(old) == t.dim():
                dims[k].update(d for d in range(t.dim()) if t.shape[d] != old[d])
    return [tuple(sorted(d)) for d in dims]


def _key_of(leaves: list[Any]) -> tuple[Any, ...]:
    """The part of a call's leaves a trace is specialised on: tensors' dtype, device and rank; other leaves'
    values."""
    return tuple((t.dtype, t.device.type, t.dim()) if isinstance(t, torch.Tensor) else ("v", _static(t))
                 for t in leaves)


def _aux_static(x: Any) -> Any:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError("compiled_split: an aux leaf is a Python number computed from a size that changes "
                        "between calls; return it as a tensor (it would be baked into the graph)")
    return x


class CompiledSplit:
    """A split backward of `f(params, *args, *consts) -> (out, aux)` run as three compiled graphs (module
    docstring). `backend`: torch.compile's ("inductor"; "aot_eager" and "eager" compile no code:
    dynamo captures each graph and runs its ops, with and without AOT autograd's pass), or None: the three
    graph modules run as they are, not compiled (the cut alone, for tests). Call as
    `split(params, *args, consts=(...), defer=True)`; returns (out, vjp_dx, aux) as
    `split_vjp(..., has_aux=True)` does. `compiles`: traces made so far."""

    def __init__(self, f: Callable[..., Any], backend: str | None = "inductor"):
        self.f = f
        self.backend = backend
        self.compiles = 0
        self.seconds = 0.0  # spent tracing and in the graphs' first calls (where torch.compile compiles)
        self._traces: dict[tuple[Any, ...], list[_Graphs]] = {}

    def __call__(self, params: Any, *args: Any, consts: tuple[Any, ...] = (), defer: bool = True
                 ) -> tuple[Any, Callable[..., Any], Any]:
        p_leaves, p_spec = flatten(params)
        originals: list[Any] = []
        a_leaves, a_spec = flatten(_traced_view(args, originals))
        c_leaves, c_spec = flatten(_traced_view(consts, originals))
        key = (p_spec, a_spec, c_spec, _key_of(p_leaves), _key_of(a_leaves), _key_of(c_leaves))
        inputs = [t for t in p_leaves + a_leaves + c_leaves if isinstance(t, torch.Tensor)]
        traces = self._traces.setdefault(key, [])
        graphs = next((g for g in traces if g.holds(inputs)), None)
        if graphs is None:
            start = time.perf_counter()
            n_p = sum(isinstance(t, torch.Tensor) for t in p_leaves)
            graphs = self._trace(p_leaves, p_spec, a_leaves, a_spec, c_leaves, c_spec,
                                 _changed_dims(traces, inputs, n_p))
            self.seconds += time.perf_counter() - start
            traces.append(graphs)
        with torch.no_grad():
            flat = list(graphs.forward(*[t.detach() for t in inputs]))
        out_meta = [(o.shape, o.dtype, o.device) for o in flat[:graphs.n_out]]
        out = unflatten(flat[:graphs.n_out], graphs.out_spec)
        aux_t = iter(flat[graphs.n_out:graphs.n_out + graphs.n_aux])
        aux = tree_unflatten([next(aux_t) if s is _TENSOR else originals[s.k] if isinstance(s, _Passed) else s
                              for s in graphs.aux_skeleton], graphs.aux_spec)
        residuals = flat[graphs.n_out + graphs.n_aux:]
        del flat
        return out, _Backward(graphs, residuals, out_meta, p_leaves, p_spec, a_leaves, a_spec, defer).dx, aux

    def _trace(self, p_leaves: list[Any], p_spec: Any, a_leaves: list[Any], a_spec: Any,
               c_leaves: list[Any], c_spec: Any, dynamic: list[tuple[int, ...]]) -> _Graphs:
        """Traces f's forward and backward as one graph, cuts it in three and compiles each."""
        n_p, n_a = len(p_leaves), len(a_leaves)
        leaves = p_leaves + a_leaves + c_leaves
        tensor_pos = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        diff_pos = [i for i in tensor_pos if i < n_p + n_a and _is_diff(leaves[i])]
        diff_set = set(diff_pos)
        n_in = len(tensor_pos)
        info: dict[str, Any] = {}

        def run_f(xs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any], list[torch.Tensor]]:
            """f on inputs `xs`, differentiable leaves made leaves that need gradients: (out leaves, aux
            leaves, those leaves)."""
            full = list(leaves)
            for i, x in zip(tensor_pos, xs):
                full[i] = x.detach().requires_grad_() if i in diff_set else x
            p = unflatten(full[:n_p], p_spec)
            a = unflatten(full[n_p:n_p + n_a], a_spec)
            c = unflatten(full[n_p + n_a:], c_spec)
            views = [x for x in tree_flatten((a, c), is_leaf=_has_view)[0] if _has_view(x)]
            with torch.enable_grad():
                out, aux = _output_and_aux(self.f(p, *a, *c))
            out_leaves, info["out_spec"] = flatten(out)
            aux_leaves, info["aux_spec"] = tree_flatten(aux, is_leaf=lambda x: any(x is v for v in views))
            aux_leaves = [next((_Passed(k) for k, v in enumerate(views) if x is v), x) for x in aux_leaves]
            return out_leaves, aux_leaves, [full[i] for i in diff_pos]

        def cotangents(fakes: list[torch.Tensor]) -> list[torch.Tensor]:
            out_leaves, _, _ = run_f(fakes)  # on fake tensors: the outputs' (symbolic) sizes
            bad = [type(o).__name__ for o in out_leaves if not _is_diff(o)]
            if bad:
                raise TypeError(f"compiled_split: every leaf of f's out must be a floating tensor, got {bad}")
            return [torch.empty_like(o.detach()) for o in out_leaves]

        def forward_and_backward(*xs: torch.Tensor) -> tuple[Any, ...]:
            out_leaves, aux_leaves, diff_leaves = run_f(xs[:n_in])
            info["aux_skeleton"] = [_TENSOR if isinstance(x, torch.Tensor) else x if isinstance(x, _Passed)
                                    else _aux_static(x) for x in aux_leaves]
            aux_tensors = [x.detach() for x in aux_leaves if isinstance(x, torch.Tensor)]
            pairs = [(o, ct) for o, ct in zip(out_leaves, xs[n_in:]) if o.requires_grad]
            with torch.enable_grad():
                grads = torch.autograd.grad([o for o, _ in pairs], diff_leaves, [ct for _, ct in pairs],
                                            allow_unused=True) if pairs else [None] * len(diff_leaves)
            info["n_out"], info["n_aux"] = len(out_leaves), len(aux_tensors)
            return (*[o.detach() for o in out_leaves], *aux_tensors, *grads)

        inputs = [leaves[i] for i in tensor_pos]
        gm, fakes = trace_joint(forward_and_backward, inputs, dynamic, cotangents)
        parts = _cut(gm, n_in, info["n_out"] + info["n_aux"],
                     [k for k, i in enumerate(diff_pos) if i >= n_p],
                     [k for k, i in enumerate(diff_pos) if i < n_p])
        self.compiles += 1
        dyn = any(dynamic)
        return _Graphs(
            holds=guard_code(fakes),
            forward=self._compile(parts.forward, dyn), dx=self._compile(parts.dx, dyn),
            dw=self._compile(parts.dw, dyn), shapes=[tuple(t.shape) for t in inputs],
            n_out=info["n_out"], n_aux=info["n_aux"], out_spec=info["out_spec"],
            aux_skeleton=info["aux_skeleton"], aux_spec=info["aux_spec"],
            dx_from=parts.dx_from, dw_from=parts.dw_from,
            dargs_none=parts.dargs_none, dparams_none=parts.dparams_none,
            darg_pos=[i - n_p for i in diff_pos if i >= n_p], dparam_pos=[i for i in diff_pos if i < n_p])

    def _compile(self, gm: fx.GraphModule, dynamic: bool) -> Callable[..., Any]:
        """`gm` compiled (lazily, at its first call, which is timed into `seconds`); `dynamic`: sizes vary
        (a trace with symbolic dims), else the graph is compiled for its sizes."""
        compiled = gm if self.backend is None else torch.compile(gm, backend=self.backend, dynamic=dynamic,
                                                                    fullgraph=True)
        first = [True]

        def call(*xs: Any) -> Any:
            if not first[0]:
                return compiled(*xs)
            first[0] = False
            start = time.perf_counter()
            try:
                return compiled(*xs)
            finally:
                self.seconds += time.perf_counter() - start

        return call


@dataclasses.dataclass
class _Parts:
    forward: fx.GraphModule
    dx: fx.GraphModule
    dw: fx.GraphModule
    dx_from: list[tuple[str, int]]
    dw_from: list[tuple[str, int]]
    dargs_none: list[bool]
    dparams_none: list[bool]


def _ancestors(targets: Sequence[Any]) -> set[fx.Node]:
    """Every node the nodes in `targets` (None and non-nodes skipped) are computed from, themselves too."""
    seen: set[fx.Node] = set()
    stack = [t for t in targets if isinstance(t, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _with_items(group: set[fx.Node]) -> set[fx.Node]:
    """`group` with the items taken from its multi-output nodes (a cut passes tensors, never a tuple)."""
    return group | {u for n in group for u in n.users
                    if u.op == "call_function" and u.target is operator.getitem}


def _cut(gm: fx.GraphModule, n_in: int, n_fw_out: int, darg_idx: list[int], dparam_idx: list[int]) -> _Parts:
    """Cuts the joint graph `gm` (placeholders: n_in primal inputs, then the cotangents; outputs: n_fw_out
    forward outputs, then one gradient per differentiable leaf) into forward, dx and dw graphs. The forward
    computes what its outputs need; dx what the gradients of the args (`darg_idx`) need beyond it; dw the
    rest of what the parameters' (`dparam_idx`) need. Values crossing a cut are the residuals."""
    nodes = list(gm.graph.nodes)
    phs = [n for n in nodes if n.op == "placeholder"]
    primals, cts = phs[:n_in], phs[n_in:]
    outs = list(next(n for n in nodes if n.op == "output").args[0])
    fw_outs, grads = outs[:n_fw_out], outs[n_fw_out:]
    darg_outs, dparam_outs = [grads[k] for k in darg_idx], [grads[k] for k in dparam_idx]
    fw_set = _with_items(_ancestors(fw_outs) | set(primals))
    if fw_set & set(cts):
        raise AssertionError("compiled_split: a forward output depends on a cotangent")
    dx_set = _with_items(_ancestors(darg_outs) - fw_set - set(cts))
    dw_set = _ancestors(dparam_outs) - fw_set - set(cts) - dx_set

    def used_by(group: set[fx.Node], outputs: list[Any], sources: set[fx.Node]) -> list[fx.Node]:
        """The nodes of `sources` that nodes of `group` read, or that `outputs` are, in graph order."""
        wanted = {m for n in group for m in n.all_input_nodes}
        wanted |= {o for o in outputs if isinstance(o, fx.Node)}
        return [n for n in nodes if n in wanted and n in sources]

    dx_in = used_by(dx_set, darg_outs, fw_set | set(cts))
    dw_in = used_by(dw_set, dparam_outs, fw_set | set(cts) | dx_set)
    residuals = [n for n in nodes if n in fw_set and (n in dx_in or n in dw_in)]
    dx_extra = [n for n in dw_in if n in dx_set]
    where = {n: ("res", k) for k, n in enumerate(residuals)}
    where.update({n: ("ct", k) for k, n in enumerate(cts)})
    where.update({n: ("dx", k) for k, n in enumerate(dx_extra)})
    return _Parts(
        forward=_sub(gm, nodes, primals, fw_set, fw_outs + residuals),
        dx=_sub(gm, nodes, dx_in, dx_set, darg_outs + dx_extra),
        dw=_sub(gm, nodes, dw_in, dw_set, dparam_outs),
        dx_from=[where[n] for n in dx_in], dw_from=[where[n] for n in dw_in],
        dargs_none=[o is None for o in darg_outs], dparams_none=[o is None for o in dparam_outs])


def _sub(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], body: set[fx.Node],
         outputs: list[Any]) -> fx.GraphModule:
    """The graph of `body`'s nodes (in `gm`'s order) reading `inputs` as placeholders, returning `outputs`."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in nodes:
        if n in body and n not in env and n.op != "placeholder":
            env[n] = g.node_copy(n, lambda m: env[m])
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return fx.GraphModule(gm, g)


def _placed(got: list[Any], positions: list[int], nones: list[bool], metas: list[Any]) -> list[Any]:
    """One gradient per leaf of `metas` (None for a leaf without one): graph outputs `got` at `positions`,
    zeros of the leaf's (shape, dtype, device) where the graph had none to give."""
    out: list[Any] = [None] * len(metas)
    for pos, none, g in zip(positions, nones, got):
        out[pos] = _zeros(metas[pos]) if none else g
    return out


def _added(into: Sequence[Any] | None, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """`grads` added into the sums `into` (one per leaf, or None) in place, as AccumulateGrad does."""
    if into is None:
        return grads
    return [g if s is None or g is None else s.add_(g) for s, g in zip(into, grads)]


class _Backward:
    """The dx and dw passes of one call (each once), holding its residuals until they are used."""

    def __init__(self, graphs: _Graphs, residuals: list[Any],
                 out_meta: list[tuple[torch.Size, torch.dtype, torch.device]],
                 p_leaves: list[Any], p_spec: Any, a_leaves: list[Any], a_spec: Any, defer: bool):
        self.graphs, self.residuals, self.out_meta, self.defer = graphs, residuals, out_meta, defer
        self.p_meta = [(t.shape, t.dtype, t.device) if _is_diff(t) else None for t in p_leaves]
        self.p_spec = p_spec
        self.a_meta = [(t.shape, t.dtype, t.device) if _is_diff(t) else None for t in a_leaves]
        self.a_spec = a_spec
        self.dx_once, self.dw_once = _Once("vjp_dx"), _Once("vjp_dw")

    def dx(self, cotangent: Any, *, into: Any = None) -> tuple[tuple[Any, ...], Callable[..., Any]]:
        g = self.graphs
        ct_leaves, ct_spec = flatten(cotangent)
        if ct_spec != g.out_spec:
            raise ValueError(f"compiled_split: the cotangent's structure differs from the output's: "
                             f"{ct_spec}")
        for k, (c, (shape, dtype, _)) in enumerate(zip(ct_leaves, self.out_meta)):
            if c is not None and (c.shape != shape or c.dtype != dtype):
                raise ValueError(f"compiled_split: cotangent leaf {k} is {tuple(c.shape)} {c.dtype}, the "
                                 f"output is {tuple(shape)} {dtype}")
        self.dx_once.claim()
        cts = [_zeros(meta) if c is None else c.detach() for c, meta in zip(ct_leaves, self.out_meta)]
        res = self.residuals
        with torch.no_grad():
            flat = list(g.dx(*[res[k] if s == "res" else cts[k] for s, k in g.dx_from]))
        n_dargs = len(g.dargs_none)
        extra = flat[n_dargs:]
        dw_inputs = [res[k] if s == "res" else cts[k] if s == "ct" else extra[k] for s, k in g.dw_from]
        self.residuals = None
        dargs = _placed(flat[:n_dargs], g.darg_pos, g.dargs_none, self.a_meta)
        del flat, extra
        if not self.defer:
            dparams = self._dw(dw_inputs, into)
            return unflatten(dargs, self.a_spec), lambda *, into=None: self._handed(dparams, into)
        return unflatten(dargs, self.a_spec), lambda *, into=None: self._dw_once(dw_inputs, into)

    def _handed(self, dparams: Any, into: Any) -> Any:
        self.dw_once.claim()
        return dparams

    def _dw_once(self, dw_inputs: list[Any], into: Any) -> Any:
        self.dw_once.claim()
        out = self._dw(dw_inputs, into)
        dw_inputs.clear()
        return out

    def _dw(self, dw_inputs: list[Any], into: Any) -> Any:
        g = self.graphs
        with torch.no_grad():
            flat = list(g.dw(*dw_inputs))
        grads = _placed(flat, g.dparam_pos, g.dparams_none, self.p_meta)
        into_leaves = None if into is None else flatten(into)[0]
        return unflatten(_added(into_leaves, grads), self.p_spec)


class CompiledPhases:
    """The compiled splits of one run, one per phase key (an executor's (kind, stage, layer, phase)), made on
    first use and kept for the run, so that each phase is traced once. `compiles`: traces made so far, all
    phases together; `backend` as CompiledSplit's."""

    def __init__(self, backend: str | None = "inductor"):
        self.backend = backend
        self._splits: dict[Any, CompiledSplit] = {}

    def split(self, key: Any, f: Callable[..., Any]) -> CompiledSplit:
        """The CompiledSplit of `key`, made over `f` on first use (later calls' `f` are the same function)."""
        got = self._splits.get(key)
        if got is None:
            got = self._splits[key] = CompiledSplit(f, self.backend)
        return got

    @property
    def compiles(self) -> int:
        return sum(s.compiles for s in self._splits.values())

    @property
    def seconds(self) -> float:
        """Seconds spent tracing and compiling, all phases together."""
        return sum(s.seconds for s in self._splits.values())

    def __len__(self) -> int:
        return len(self._splits)
