"""Small glue as aten ops (fmoe/ops/_host_bound.py): under tape autograd on the CPU, permute, permute_probs,
unpermute and swiglu_packed move rows under HOST_BOUND_BYTES with aten's own differentiable ops (no Python
autograd node), with the values and gradients of their Functions (the device path, run here with the size
rule at 0) and of python loops; larger rows, half precision, torch.func and a device without the rule keep
the Functions.

Legend (docs/moe.md): T tokens, D features, E experts, K top-k slots, R layout rows, Z = 2 F (gate | up).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.capacity import drop_layout
from fmoe.ops import _host_bound, permute, permute_probs, sort_layout, swiglu_packed, unpermute
from fmoe.transforms.testing import assert_close

FUNCTION_NODES = {"_PermuteBackward", "_UnpermuteBackward", "_SwiGLUPackedBackward"}


def nodes(t: torch.Tensor) -> set[str]:
    """The type names of every autograd node behind t."""
    seen, stack, names = set(), [t.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


def glue(x_TD, p_TK, gate_up_XZ, layout, weighted):
    """Every glue op once, summed into one scalar with fixed weights (so each gradient is tested)."""
    x_RD = permute(x_TD, layout)
    y_TD = unpermute(x_RD * 1.5, p_TK if weighted else None, layout)
    p_R = permute_probs(p_TK, layout)
    h_XF = swiglu_packed(gate_up_XZ)
    w = torch.arange(1, 1 + y_TD.numel(), dtype=y_TD.dtype).view_as(y_TD) / y_TD.numel()
    return (y_TD * w).sum() + (p_R * p_R).sum() + (h_XF * h_XF).sum(), [y_TD, p_R, h_XF, x_RD]


def run(x_TD, p_TK, gate_up_XZ, layout, weighted):
    """(outputs, gradients of x, p and gate_up, autograd node names) under tape autograd."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x_TD, p_TK, gate_up_XZ)]
    loss, outs = glue(*leaves, layout, weighted)
    names = set().union(*(nodes(o) for o in outs))
    return [o.detach() for o in outs], torch.autograd.grad(loss, leaves), names


@settings(max_examples=20, deadline=None)
@example(T=0, E=3, K=2, dropped=False, weighted=True, dtype=torch.float32, seed=0)  # no tokens
@example(T=5, E=1, K=1, dropped=False, weighted=True, dtype=torch.float64, seed=1)  # one expert
@example(T=4, E=3, K=3, dropped=True, weighted=False, dtype=torch.float32, seed=2)  # top-k = E, drops
@given(T=st.integers(0, 9), E=st.integers(1, 5), K=st.integers(1, 5), dropped=st.booleans(),
       weighted=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**31 - 1))
def test_small_glue_runs_as_aten_ops_with_the_functions_values_and_gradients(T, E, K, dropped, weighted,
                                                                            dtype, seed) -> None:
    K = min(K, E)
    g = torch.Generator().manual_seed(seed)
    ids_TK = (torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T
              else torch.zeros(0, K, dtype=torch.int64))
    p_TK = torch.rand(T, K, generator=g, dtype=dtype)
    layout = (drop_layout(ids_TK, p_TK, E, max(1, T * K // (2 * E)), "probs", False)[0] if dropped
              else sort_layout(ids_TK, E))
    x_TD = torch.randn(T, 3, generator=g, dtype=dtype)
    gate_up_XZ = torch.randn(layout.num_rows, 4, generator=g, dtype=dtype) * 3

    aten_outs, aten_grads, aten_nodes = run(x_TD, p_TK, gate_up_XZ, layout, weighted)
    assert not aten_nodes & FUNCTION_NODES, aten_nodes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_host_bound, "HOST_BOUND_BYTES", 0)  # every size: the Functions
        fn_outs, fn_grads, fn_nodes = run(x_TD, p_TK, gate_up_XZ, layout, weighted)
    if T:
        assert {"_PermuteBackward", "_UnpermuteBackward", "_SwiGLUPackedBackward"} <= fn_nodes, fn_nodes
    assert_close(aten_outs, fn_outs)
    assert_close(aten_grads, fn_grads)
    # and the loops: token t's K rows, weighted, where its pairs were kept
    kept_TK = layout.row_dst_N.view(T, K) < layout.num_rows
    expect_TD = torch.zeros(T, 3, dtype=dtype)
    for t in range(T):
        for k in range(K):
            if kept_TK[t, k]:
                expect_TD[t] += 1.5 * (p_TK[t, k] if weighted else 1) * x_TD[t]
    assert_close(aten_outs[0], expect_TD)


def test_large_rows_half_precision_torch_func_and_a_device_keep_the_functions(monkeypatch) -> None:
    """The rule's edges: rows of HOST_BOUND_BYTES or more, bf16 (whose bag sums accumulate in fp32),
    torch.func (which reads the Functions' rules) and a device outside ATEN_GLUE_DEVICES (CUDA's
    index_add adds with atomics) run the Functions; just under the size, aten's ops."""
    ids_TK = torch.tensor([[0, 1], [1, 0], [1, 1]])
    layout = sort_layout(ids_TK, 2)
    D = -(-_host_bound.HOST_BOUND_BYTES // (4 * layout.num_rows))  # fp32 rows at the limit, D - 1 under it
    x_TD = torch.randn(3, D, requires_grad=True)
    assert "_PermuteBackward" in nodes(permute(x_TD, layout))
    assert "_PermuteBackward" not in nodes(permute(x_TD[:, :-1], layout))
    assert "_PermuteBackward" in nodes(permute(x_TD.detach().bfloat16().requires_grad_(), layout))
    small = torch.randn(3, 4, requires_grad=True)
    assert "_PermuteBackward" not in nodes(permute(small, layout))
    monkeypatch.setattr(_host_bound, "ATEN_GLUE_DEVICES", ())
    assert "_PermuteBackward" in nodes(permute(small, layout))
    monkeypatch.undo()

    seen = []
    real = _host_bound.host_bound

    def spy(x, rows_numel):
        seen.append(real(x, rows_numel))
        return seen[-1]

    monkeypatch.setattr("fmoe.ops._permute.host_bound", spy)
    torch.func.grad(lambda x: permute(x, layout).sum())(small.detach())
    assert seen == [False]  # under torch.func: the Function


@pytest.mark.parametrize("donate", [False, True])
def test_small_swiglu_packed_takes_one_gradient_for_gate_and_up(donate) -> None:
    """The aten form of swiglu_packed makes gate | up's gradient as one [X, 2F] tensor (one split node,
    no sum of two slice gradients), with the oracle's values; `donate` changes nothing there."""
    gate_up_XZ = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    h_XF = swiglu_packed(gate_up_XZ, donate=donate)
    assert "SplitBackward0" in nodes(h_XF) and "SliceBackward0" not in nodes(h_XF)
    (grad,) = torch.autograd.grad(h_XF.sum(), gate_up_XZ)
    a, u = gate_up_XZ.detach()[:, :3], gate_up_XZ.detach()[:, 3:]
    s = torch.sigmoid(a)
    assert_close(grad, torch.cat([u * s * (1 + a * (1 - s)), a * s], -1))
