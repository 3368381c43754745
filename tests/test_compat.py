"""fmoe._compat: each private torch API fmoe relies on, exercised for real (one test per API).

When a torch upgrade breaks one of these, fix fmoe/_compat.py; nothing else names the private API.
Legend: N rows, K inner dim, F output features, E groups.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from dist_utils import spawn
from torch.utils.flop_counter import FlopCounterMode

from fmoe import _compat


def test_grouped_mm_matches_a_loop_and_its_aten_op() -> None:
    assert _compat.HAS_GROUPED_MM
    g = torch.Generator().manual_seed(0)
    x_NK = torch.randn(8, 16, generator=g)
    w_EKF = torch.randn(3, 16, 8, generator=g)
    g_NF = torch.randn(8, 8, generator=g)
    offs_E = torch.tensor([3, 3, 8], dtype=torch.int32)
    rows = [slice(0, 3), slice(3, 3), slice(3, 8)]  # groups of 3, 0 and 5 rows
    y_NF = _compat.grouped_mm(x_NK, w_EKF, offs=offs_E)
    y_loop = torch.cat([x_NK[r] @ w_EKF[e] for e, r in enumerate(rows)])
    torch.testing.assert_close(y_NF, y_loop)
    # The 2-D x 2-D form groups the shared dim: the per-group weight grad (zeros for the empty group).
    dw_EKF = _compat.grouped_mm(x_NK.t(), g_NF, offs=offs_E)
    dw_loop = torch.stack([x_NK[r].t() @ g_NF[r] for r in rows])
    torch.testing.assert_close(dw_EKF, dw_loop)
    assert float(dw_EKF[1].abs().max()) == 0.0
    # The aten op packet is the one that runs (a FlopCounterMode mapping keyed on it is consulted).
    seen: list[int] = []

    def flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        seen.append(1)
        return 1

    with FlopCounterMode(display=False, custom_mapping={_compat.grouped_mm_op(): flops}) as counter:
        _compat.grouped_mm(x_NK, w_EKF, offs=offs_E)
    assert seen and counter.get_total_flops() == 1


def test_functorch_unwrap_under_vjp() -> None:
    x = torch.randn(3, dtype=torch.float64)
    seen: dict[str, object] = {}

    def f(x_in: torch.Tensor) -> torch.Tensor:
        seen["wrapped"] = _compat.is_functorch_wrapped(x_in)
        seen["inner"] = _compat.get_unwrapped(x_in)
        return x_in * 2

    out, vjp_fn = torch.func.vjp(f, x)
    assert seen["wrapped"] is True and seen["inner"] is x  # one level: the caller's tensor object
    assert not _compat.is_functorch_wrapped(x) and not _compat.is_functorch_wrapped(out)
    (dx,) = vjp_fn(torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(dx, torch.full((3,), 2.0, dtype=torch.float64))


def test_disable_functorch_allows_a_write_to_a_captured_tensor() -> None:
    buf, src = torch.zeros(3), torch.ones(3)
    errors: list[str] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        try:
            buf.copy_(src)  # what a gloo wait does to a collective's output: illegal under a transform
        except RuntimeError as e:
            errors.append(str(e))
        with _compat.disable_functorch():
            buf.copy_(src)
            assert not _compat.is_functorch_wrapped(torch.ones(1) + 1)
        return x * 2

    torch.func.vjp(f, torch.randn(3))
    assert errors and "captured" in errors[0]
    torch.testing.assert_close(buf, src)


def _flatten_mesh_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    flat = _compat.flatten_mesh(mesh["a", "b"], "ab", _compat.group_options("cpu", timedelta(seconds=7)))
    t = torch.ones(2)
    dist.all_reduce(t, group=flat.get_group())
    timeout = flat.get_group()._get_backend(torch.device("cpu")).options._timeout
    return {"names": flat.mesh_dim_names, "size": flat.size(), "ndim": flat.ndim, "sum": t.tolist(),
            "timeout_s": timeout.total_seconds()}


def test_flatten_mesh_with_group_options_on_a_world_1_gloo_group() -> None:
    (r,) = spawn(_flatten_mesh_rank, 1, timeout_s=90, pg_timeout_s=20)
    assert r.value == {"names": ("ab",), "size": 1, "ndim": 1, "sum": [1.0, 1.0], "timeout_s": 7.0}


def _abort_rank(rank: int, world: int) -> dict:
    sub = dist.new_group([0])
    aborted_sub = _compat.abort_process_group(sub)
    still = dist.is_initialized()
    aborted_world = _compat.abort_process_group()
    return {"sub": aborted_sub, "world": aborted_world, "init_after_sub": still,
            "init_after_world": dist.is_initialized()}


def test_abort_process_group_on_gloo() -> None:
    (r,) = spawn(_abort_rank, 1, timeout_s=90, pg_timeout_s=20)
    assert r.value == {"sub": True, "world": True, "init_after_sub": True, "init_after_world": False}


def test_pytree_round_trip_and_map() -> None:
    tree = {"b": [torch.ones(2), (3, None)], "a": {"w": torch.zeros(1, 2)}}
    leaves, spec = _compat.tree_flatten(tree)
    assert [type(x) for x in leaves] == [torch.Tensor, int, type(None), torch.Tensor]  # dict order kept
    back = _compat.tree_unflatten(leaves, spec)
    assert back.keys() == tree.keys() and back["b"][1] == (3, None) and back["a"]["w"] is tree["a"]["w"]
    doubled = _compat.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, tree)
    assert _compat.tree_flatten(doubled)[1] == spec
    torch.testing.assert_close(doubled["b"][0], torch.full((2,), 2.0))
    assert doubled["b"][1] == (3, None)


def test_tensor_version_counts_in_place_writes_shared_by_views_and_detach() -> None:
    t = torch.zeros(3)
    v0 = _compat.tensor_version(t)
    t.add_(1.0)
    assert _compat.tensor_version(t) == v0 + 1
    alias = t.detach()
    t[0].fill_(2.0)  # a write through a view
    assert _compat.tensor_version(alias) == _compat.tensor_version(t) == v0 + 2
    _ = t + 1  # out of place: no bump
    assert _compat.tensor_version(t) == v0 + 2
    with torch.inference_mode():
        frozen = torch.zeros(2)
    assert _compat.tensor_version(frozen) == -1


def test_under_vmap_sees_vmap_at_any_depth() -> None:
    seen: dict[str, bool] = {}

    def probe(key: str):
        def f(x: torch.Tensor) -> torch.Tensor:
            seen[key] = _compat.under_vmap()
            return x.sum()
        return f

    seen["outside"] = _compat.under_vmap()
    torch.func.vmap(probe("vmap"))(torch.ones(2, 3))
    torch.func.grad(probe("grad"))(torch.ones(3))
    torch.func.vmap(torch.func.grad(probe("vmap_of_grad")))(torch.ones(2, 3))
    assert seen == {"outside": False, "vmap": True, "grad": False, "vmap_of_grad": True}


def test_tree_flatten_with_path_and_keystr() -> None:
    tree = ({"w": torch.ones(1), "blocks": [torch.zeros(1)]}, (torch.ones(2),))
    leaves, spec = _compat.tree_flatten_with_path(tree)
    assert [_compat.keystr(p) for p, _ in leaves] == ["[0]['w']", "[0]['blocks'][0]", "[1][0]"]
    assert leaves[2][1] is tree[1][0] and spec == _compat.tree_flatten(tree)[1]
    assert leaves[1][0][0].idx == 0 and leaves[2][0][1].idx == 0  # SequenceKey.idx: the position


class _Scale(_compat.Function):
    @staticmethod
    def forward(x, factor=2.0):
        return x * factor

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def test_function_skips_signature_binding_and_still_works_under_torch_func(monkeypatch) -> None:
    x = torch.randn(3, requires_grad=True)
    _Scale.apply(x, 3.0)  # first call: the arity is looked up once
    import inspect

    def no_signature(*args, **kwargs):
        raise AssertionError("inspect.signature on the hot path")

    monkeypatch.setattr(inspect, "signature", no_signature)
    y = _Scale.apply(x, 3.0)
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.full((3,), 3.0))
    out, vjp = torch.func.vjp(lambda t: _Scale.apply(t, 3.0), x.detach())
    assert torch.equal(vjp(torch.ones(3))[0], torch.full((3,), 3.0)) and torch.equal(out, x.detach() * 3)
    monkeypatch.undo()
    assert torch.equal(_Scale.apply(x.detach()), x.detach() * 2)  # a default filled in: torch's own apply
    assert torch.equal(_Scale.apply(x.detach(), factor=4.0), x.detach() * 4)


def test_grouped_mm_syncs_only_on_cuda_outside_its_own_kernel(monkeypatch) -> None:
    assert not _compat.grouped_mm_syncs(torch.float32, torch.device("cpu"))  # the host is the device
    assert _compat.grouped_mm_syncs(torch.float32, torch.device("cuda", 0))  # the fallback: offs.cpu()
    for major, syncs in ((9, False), (10, False), (8, True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, m=major: (m, 0))
        assert _compat.grouped_mm_syncs(torch.bfloat16, torch.device("cuda", 0)) == syncs, major


def test_trace_joint_traces_fake_tensors_with_the_dims_asked_symbolic_and_its_guards_hold() -> None:
    seen: list[bool] = []

    def fn(x_NK, w_KF, extra_N):
        seen.append(_compat.is_tracing())
        with _compat.real_values():  # a probe on real tensors, not in the graph
            seen.append(type(torch.ones(2)) is torch.Tensor)  # real, not a FakeTensor
        return ((x_NK @ w_KF).relu() * extra_N[:, None],)

    x_NK, w_KF = torch.randn(5, 3), torch.randn(3, 4)
    gm, fakes = _compat.trace_joint(fn, [x_NK, w_KF], [(0,), ()], lambda f: [torch.empty(f[0].shape[0])])
    assert seen[0] and seen[1] and not _compat.is_tracing()
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "aten.mm.default" in ops and "aten.ones.default" not in ops  # the probe left no node
    for n in (5, 9):  # one graph for any row count: dim 0 symbolic
        x, e = torch.randn(n, 3), torch.randn(n)
        (got,) = gm(x, w_KF, e)
        torch.testing.assert_close(got, (x @ w_KF).relu() * e[:, None])
    holds = _compat.guard_code(fakes)
    assert holds([torch.randn(9, 3), w_KF])
    assert not holds([torch.randn(9, 3), torch.randn(3, 6)])  # w's F is static
