"""grouped_linear against a per-row loop oracle: outputs, dx, dw (plain vjp and split_vjp), FLOPs, errors.

Legend: N rows, D input features, F output features, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from fmoe._compat import HAS_GROUPED_MM, grouped_mm_op
from fmoe.ops import _grouped_linear as gl_mod
from fmoe.ops import available_backends, grouped_linear
from fmoe.transforms.split_vjp import split_vjp
from fmoe.transforms.tape import WeightGradTape, active_tape
from fmoe.transforms.testing import assert_close, check_vjp


@dataclass
class Case:
    counts: list[int]
    D: int
    F: int
    dtype: torch.dtype
    backend: str | None
    seed: int = 0


@st.composite
def cases(draw: st.DrawFn) -> Case:
    E = draw(st.integers(1, 4))
    return Case(
        counts=draw(st.lists(st.integers(0, 5), min_size=E, max_size=E)),
        D=draw(st.sampled_from([3, 8, 16])),
        F=draw(st.sampled_from([5, 8, 16])),
        dtype=draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16])),
        backend=draw(st.sampled_from(["loop", "grouped_mm", None])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_ND, w_EDF, g_NF (cotangent) in case.dtype, and counts_E."""
    g = torch.Generator().manual_seed(case.seed)
    N, E = sum(case.counts), len(case.counts)
    x_ND = torch.randn(N, case.D, generator=g, dtype=torch.float64).to(case.dtype)
    w_EDF = (torch.randn(E, case.D, case.F, generator=g, dtype=torch.float64) * 0.5).to(case.dtype)
    g_NF = torch.randn(N, case.F, generator=g, dtype=torch.float64).to(case.dtype)
    return x_ND, w_EDF, g_NF, torch.tensor(case.counts, dtype=torch.int64)


def oracle(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per-row definition: y[n] = x[n] @ w[expert_of_row(n)]."""
    expert_of_row = [e for e, c in enumerate(counts) for _ in range(c)]
    rows = [x_ND[n] @ w_EDF[expert_of_row[n]] for n in range(x_ND.shape[0])]
    return torch.stack(rows) if rows else x_ND.new_zeros(0, w_EDF.shape[-1]) + 0 * w_EDF.sum()


def oracle_grads(x_ND, w_EDF, g_NF, counts):
    """(y, dx, dw) in float64 by plain tape autograd on the per-row oracle."""
    x64 = x_ND.double().requires_grad_()
    w64 = w_EDF.double().requires_grad_()
    y = oracle(x64, w64, counts)
    dx, dw = torch.autograd.grad(y, (x64, w64), g_NF.double(), allow_unused=True)
    dx = torch.zeros_like(x64) if dx is None else dx
    dw = torch.zeros_like(w64) if dw is None else dw
    return y.detach(), dx, dw


def resolve_backend(case: Case, x_ND, w_EDF, counts_E) -> str | None:
    """The backend to run: a grouped_mm request it cannot serve must raise ValueError, then use auto."""
    item = case.dtype.itemsize
    ok = "grouped_mm" in available_backends(case.dtype, "cpu") and (case.D * item) % 16 == 0 \
        and (case.F * item) % 16 == 0
    if case.backend == "grouped_mm" and not ok:
        with pytest.raises(ValueError, match="grouped_mm"):
            grouped_linear(x_ND, w_EDF, counts_E, backend="grouped_mm")
        return None
    return case.backend


EDGE = [
    Case([2, 0, 3], 8, 8, torch.float32, "grouped_mm"),   # an expert with zero rows
    Case([2, 0, 3], 3, 5, torch.float64, "loop"),
    Case([4], 8, 16, torch.bfloat16, "grouped_mm"),       # E = 1
    Case([0, 5, 0], 16, 8, torch.float32, "grouped_mm"),  # all rows on one expert
    Case([0, 0], 8, 8, torch.float32, "grouped_mm"),      # N = 0
    Case([0, 0], 3, 5, torch.float64, "loop"),
]


def with_examples(fn):
    for c in EDGE:
        fn = example(case=c)(fn)
    return fn


@settings(max_examples=30, deadline=None)
@with_examples
@given(case=cases())
def test_vjp_matches_loop_oracle(case: Case) -> None:
    x_ND, w_EDF, g_NF, counts_E = make(case)
    backend = resolve_backend(case, x_ND, w_EDF, counts_E)
    y, vjp_fn = torch.func.vjp(lambda x, w: grouped_linear(x, w, counts_E, backend), x_ND, w_EDF)
    dx, dw = vjp_fn(g_NF)
    y_ref, dx_ref, dw_ref = oracle_grads(x_ND, w_EDF, g_NF, case.counts)
    assert y.dtype == case.dtype and y.shape == (sum(case.counts), case.F)
    assert_close(y, y_ref, dtype=case.dtype, msg="y")
    assert_close(dx, dx_ref, dtype=case.dtype, msg="dx")
    assert_close(dw, dw_ref, dtype=case.dtype, scale=2.0, msg="dw")


@settings(max_examples=20, deadline=None)
@with_examples
@given(case=cases())
def test_tape_autograd_path_matches_loop_oracle(case: Case) -> None:
    """Outside split_vjp, tapes and torch.func the products run as aten ops with their own backward."""
    x_ND, w_EDF, g_NF, counts_E = make(case)
    backend = resolve_backend(case, x_ND, w_EDF, counts_E)
    x, w = x_ND.clone().requires_grad_(), w_EDF.clone().requires_grad_()
    y = grouped_linear(x, w, counts_E, backend)
    assert "_GroupedLinear" not in type(y.grad_fn).__name__
    dx, dw = torch.autograd.grad(y, (x, w), g_NF, allow_unused=True)
    dx = torch.zeros_like(x) if dx is None else dx
    dw = torch.zeros_like(w) if dw is None else dw
    y_ref, dx_ref, dw_ref = oracle_grads(x_ND, w_EDF, g_NF, case.counts)
    assert_close(y.detach(), y_ref, dtype=case.dtype, msg="y")
    assert_close(dx, dx_ref, dtype=case.dtype, msg="dx")
    assert_close(dw, dw_ref, dtype=case.dtype, scale=2.0, msg="dw")


@settings(max_examples=20, deadline=None)
@with_examples
@given(case=cases())
def test_split_vjp_defers_weight_grad(case: Case) -> None:
    x_ND, w_EDF, g_NF, counts_E = make(case)
    backend = resolve_backend(case, x_ND, w_EDF, counts_E)
    calls = []
    real = gl_mod._weight_grad

    def spy(*a):
        calls.append(1)
        return real(*a)

    with mock.patch.object(gl_mod, "_weight_grad", spy):
        y, vjp_dx = split_vjp(lambda p, x: grouped_linear(x, p["w"], counts_E, backend), {"w": w_EDF}, x_ND)
        (dx,), vjp_dw = vjp_dx(g_NF)
        assert calls == [], "the dx pass computed the weight grad instead of deferring it"
        dparams = vjp_dw()
        assert calls == [1]
    _, dx_ref, dw_ref = oracle_grads(x_ND, w_EDF, g_NF, case.counts)
    assert_close(dx, dx_ref, dtype=case.dtype, msg="dx")
    assert_close(dparams["w"], dw_ref, dtype=case.dtype, scale=2.0, msg="dw")


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_tape_gets_one_entry(backend: str) -> None:
    case = Case([3, 0, 2], 8, 8, torch.float32, backend)
    x_ND, w_EDF, g_NF, counts_E = make(case)
    _, vjp_fn = torch.func.vjp(lambda x, w: grouped_linear(x, w, counts_E, backend), x_ND, w_EDF)
    tape = WeightGradTape([w_EDF])
    with active_tape(tape):
        dx, dw_now = vjp_fn(g_NF)
    assert len(tape) == 1
    assert torch.count_nonzero(dw_now) == 0  # backward returned None for w: vjp reports zeros
    (dw_later,) = tape.run()
    _, _, dw_ref = oracle_grads(x_ND, w_EDF, g_NF, case.counts)
    assert_close(dw_later, dw_ref, dtype=torch.float32)
    assert torch.count_nonzero(dw_later[1]) == 0  # the expert with no rows


@settings(max_examples=15, deadline=None)
@given(counts=st.lists(st.integers(0, 4), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_finite_differences_float64(counts: list[int], seed: int) -> None:
    x_ND, w_EDF, _, counts_E = make(Case(counts, 3, 4, torch.float64, "loop", seed))
    check_vjp(lambda x, w: grouped_linear(x, w, counts_E, "loop"), x_ND, w_EDF)


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_grad_of_sum_has_stride0_cotangent(backend: str) -> None:
    # torch.func.grad of y.sum() feeds an expanded cotangent; grouped_mm rejects stride 0 unless copied.
    x_ND, w_EDF, _, counts_E = make(Case([2, 3], 8, 8, torch.float32, backend))
    dx, dw = torch.func.grad(lambda x, w: grouped_linear(x, w, counts_E, backend).sum(), argnums=(0, 1))(
        x_ND, w_EDF)
    _, dx_ref, dw_ref = oracle_grads(x_ND, w_EDF, torch.ones(5, 8), [2, 3])
    assert_close((dx, dw), (dx_ref, dw_ref), dtype=torch.float32)


def test_counts_read_once_in_forward() -> None:
    # The host list is taken once, at the call; changing counts_E afterwards cannot affect backward.
    x_ND, w_EDF, g_NF, counts_E = make(Case([2, 3], 4, 4, torch.float64, "loop"))
    _, vjp_fn = torch.func.vjp(lambda x, w: grouped_linear(x, w, counts_E), x_ND, w_EDF)
    counts_E.copy_(torch.tensor([5, 0]))
    dx, dw = vjp_fn(g_NF)
    _, dx_ref, dw_ref = oracle_grads(x_ND, w_EDF, g_NF, [2, 3])
    assert_close((dx, dw), (dx_ref, dw_ref))


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_flops_conserved_by_split() -> None:
    # FlopCounterMode does not count aten._grouped_mm (it reports 0), so this uses the loop backend.
    x_ND, w_EDF, g_NF, counts_E = make(Case([3, 0, 5, 2], 8, 16, torch.float32, "loop"))

    def f(p, x):
        return grouped_linear(x, p["w"], counts_E, "loop")

    _, vjp_fn = torch.func.vjp(lambda w, x: f({"w": w}, x), w_EDF, x_ND)
    full = _flops(lambda: vjp_fn(g_NF))
    _, vjp_dx = split_vjp(f, {"w": w_EDF}, x_ND)
    out = {}
    dx_pass = _flops(lambda: out.update(dw_fn=vjp_dx(g_NF)[1]))
    dw_pass = _flops(lambda: out["dw_fn"]())
    assert dw_pass > 0
    assert dx_pass + dw_pass == full


def test_flops_conserved_by_split_grouped_mm() -> None:
    # Same check for the grouped_mm backend, with the missing formula supplied by custom_mapping:
    # [N, K] x [E, K, F] and [D, N] x [N, F] (grouped along N) both cost 2 * a0 * a1 * b_last.
    def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]

    mapping = {grouped_mm_op(): grouped_mm_flops}
    x_ND, w_EDF, g_NF, counts_E = make(Case([3, 0, 5, 2], 8, 16, torch.float32, "grouped_mm"))

    def f(p, x):
        return grouped_linear(x, p["w"], counts_E, "grouped_mm")

    def flops(fn):
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            fn()
        return counter.get_total_flops()

    _, vjp_fn = torch.func.vjp(lambda w, x: f({"w": w}, x), w_EDF, x_ND)
    full = flops(lambda: vjp_fn(g_NF))
    _, vjp_dx = split_vjp(f, {"w": w_EDF}, x_ND)
    out = {}
    dx_pass = flops(lambda: out.update(dw_fn=vjp_dx(g_NF)[1]))
    dw_pass = flops(lambda: out["dw_fn"]())
    assert dw_pass == 2 * 10 * 8 * 16
    assert dx_pass + dw_pass == full


def test_vmap_over_batch_loop_backend() -> None:
    x_BND = torch.randn(3, 5, 4, dtype=torch.float64)
    w_EDF = torch.randn(2, 4, 6, dtype=torch.float64)
    counts_E = torch.tensor([2, 3])
    y = torch.func.vmap(lambda x: grouped_linear(x, w_EDF, counts_E, "loop"))(x_BND)
    assert_close(y, torch.stack([oracle(x, w_EDF, [2, 3]) for x in x_BND]))


def test_available_backends() -> None:
    assert available_backends(torch.float64, "cpu") == ["loop"]
    assert available_backends(torch.int32, "cpu") == ["loop"]
    if HAS_GROUPED_MM:
        assert available_backends(torch.float32, "cpu") == ["grouped_mm", "loop"]


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "counts", "kw", "match"),
    [
        ((5, 4), (2, 4, 3), [2, 2], {}, "sum\\(counts\\)"),
        ((5, 4), (2, 4, 3), [6, -1], {}, "non-negative"),
        ((5, 4), (2, 4, 3), [5], {}, "2 experts"),
        ((5, 4), (2, 3, 3), [2, 3], {}, "features"),
        ((5,), (2, 4, 3), [2, 3], {}, "2-D"),
        ((5, 4), (4, 3), [2, 3], {}, "3-D"),
        ((5, 4), (2, 4, 3), [2, 3], {"backend": "cuda_magic"}, "unknown backend"),
        ((5, 4), (2, 4, 3), [2, 3], {"backend": "grouped_mm"}, "not available"),  # float64
        ((5, 4), (2, 4, 3), [2, 3], {"backend": "npu"}, "not available"),
    ],
)
def test_validation_errors(x_shape, w_shape, counts, kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        grouped_linear(torch.zeros(x_shape, dtype=torch.float64), torch.zeros(w_shape, dtype=torch.float64),
                       torch.tensor(counts), **kw)


def test_validation_dtypes() -> None:
    with pytest.raises(ValueError, match="integer"):
        grouped_linear(torch.zeros(2, 4), torch.zeros(1, 4, 3), torch.tensor([2.0]))
    with pytest.raises(ValueError, match="cast"):
        grouped_linear(torch.zeros(2, 4), torch.zeros(1, 4, 3, dtype=torch.float64), torch.tensor([2]))
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        grouped_linear(torch.zeros(2, 4), torch.zeros(1, 4, 3), torch.tensor([2]), backend="grouped_mm")


# ---- Ascend: the npu_grouped_matmul calls against a fake torch_npu with the documented semantics -------

class _FakeTorchNpu:
    """torch_npu.npu_grouped_matmul as documented (torch_npu 7.0 API reference, ptaoplist_000524; the
    forms MindSpeed's gmm uses): x, weight lists of one tensor; group_type 0 groups the rows M of x [M, K]
    against weight [E, K, N] (y [M, N], split_item 2), 2 groups the shared K of x [K_x, K] (a transposed
    view) and weight [K, N] (y [E, K_x, N], split_item 3); group_list a device int64 tensor, rows per
    group (group_list_type 1) or their cumulative sum (0). Anything else raises."""

    def __init__(self):
        self.calls = []

    def npu_grouped_matmul(self, x, weight, *, bias=None, group_list=None, split_item=0, group_type=-1,
                           group_list_type=0, **unused):
        assert isinstance(x, list) and isinstance(weight, list) and len(x) == len(weight) == 1
        assert bias is None
        assert isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64
        assert group_list_type in (0, 1)
        (a,), (b,) = x, weight
        counts = group_list if group_list_type == 1 else torch.diff(group_list,
                                                                    prepend=group_list.new_zeros(1))
        assert bool((counts >= 0).all())
        bounds = [0, *torch.cumsum(counts, 0).tolist()]
        self.calls.append((group_type, split_item))
        if group_type == 0:
            assert split_item == 2 and a.dim() == 2 and b.dim() == 3 and b.shape[0] == len(counts)
            assert bounds[-1] == a.shape[0]
            return [torch.cat([a[bounds[e]:bounds[e + 1]] @ b[e] for e in range(len(counts))])]
        assert group_type == 2 and split_item == 3 and a.dim() == b.dim() == 2 and bounds[-1] == a.shape[1]
        assert a.stride(0) == 1  # x as the transposed view [D, M]
        return [torch.stack([a[:, bounds[e]:bounds[e + 1]] @ b[bounds[e]:bounds[e + 1]]
                             for e in range(len(counts))])]


@pytest.mark.parametrize("counts", [[3, 0, 2, 5], [0, 0, 4, 0], [0, 0, 0, 0]])
def test_npu_backend_matches_loop_with_a_fake_torch_npu(monkeypatch, counts) -> None:
    fake = _FakeTorchNpu()
    monkeypatch.setattr(gl_mod, "_npu_module", lambda: fake)
    g = torch.Generator().manual_seed(0)
    M, D, F = sum(counts), 4, 3
    x = torch.randn(M, D, generator=g, dtype=torch.float64)
    w = torch.randn(len(counts), D, F, generator=g, dtype=torch.float64)
    ct = torch.randn(M, F, generator=g, dtype=torch.float64)
    for c in (torch.tensor(counts), counts):  # device counts, or host ints only
        npu = gl_mod.Grouped(gl_mod._group_counts(c, x.device, "npu", "t"), "npu")
        loop = gl_mod.Grouped(gl_mod.Counts(tuple(counts)), "loop")
        assert torch.equal(npu.fwd(x, w), loop.fwd(x, w))
        assert torch.equal(npu.dx(ct, w), loop.dx(ct, w))
        assert torch.equal(npu.dw(x, ct), loop.dw(x, ct))  # one K-grouped call, not a loop over experts
    assert fake.calls == [(0, 2), (0, 2), (2, 3)] * 2
