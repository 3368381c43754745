"""Donated buffers (fmoe/ops/_donate.py): swiglu_packed(donate=True), unpermute(donate=True) and
grouped_linear(donate=True) write a gradient over the donated input's memory, with the values of the
undonated op (bit for bit, the grouped dx to rounding) and of a float64 oracle; nothing is donated under
torch.func or a create_graph backward; a node that saved the donated tensor and runs later fails loudly;
the MoE layer donates on CPU.

Legend (docs/moe.md): X rows, F features, Z = 2 F (gate | up), T tokens, K slots, R layout rows, D width.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.capacity import drop_layout
from fmoe.config import MoEConfig
from fmoe.layer import init_moe
from fmoe.model import moe
from fmoe.ops import (
    grouped_linear,
    sort_layout,
    swiglu_packed,
    swiglu_packed_grouped_linear,
    unpermute,
)
from fmoe.transforms.testing import assert_close

dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float64])


@pytest.fixture(autouse=True)
def every_new_buffer_faults(monkeypatch):
    """The ops that avoid new buffers do so only at sizes where one faults for sure (32 MiB on the CPU,
    fmoe.ops._donate.ALWAYS_MAPPED_BYTES), and the glue runs as its Functions only from a size where their
    host cost pays (fmoe.ops._host_bound.HOST_BOUND_BYTES); these tests take both sizes down to their
    shapes."""
    monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", 0)
    monkeypatch.setattr("fmoe.ops._host_bound.HOST_BOUND_BYTES", 0)


def swiglu_oracle(gate_up_XZ: torch.Tensor, ct_XF: torch.Tensor) -> torch.Tensor:
    a = gate_up_XZ.double().requires_grad_()
    g, u = a[:, : a.shape[1] // 2], a[:, a.shape[1] // 2:]
    return torch.autograd.grad(g / (1 + torch.exp(-g)) * u, a, ct_XF.double())[0]


def packed_grad(gate_up_XZ: torch.Tensor, ct_XF: torch.Tensor, donate: bool) -> tuple[torch.Tensor, ...]:
    leaf = gate_up_XZ.clone().requires_grad_()
    mine = leaf * 1  # a non-leaf the caller owns, as the experts' product output is
    h = swiglu_packed(mine, donate=donate)
    (d,) = torch.autograd.grad(h, mine, ct_XF)
    return h.detach(), d, mine.detach()


@settings(max_examples=20, deadline=None)
@example(rows=0, F=2, dtype=torch.float32, seed=0)
@example(rows=1, F=1, dtype=torch.bfloat16, seed=1)
@example(rows=5, F=3, dtype=torch.float64, seed=2)
@given(rows=st.integers(0, 6), F=st.integers(1, 4), dtype=dtypes, seed=st.integers(0, 2**31 - 1))
def test_donated_swiglu_gradient_is_the_undonated_one_in_the_donated_memory(rows, F, dtype, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * F, generator=g, dtype=torch.float64) * 3).to(dtype)
    ct = torch.randn(rows, F, generator=g, dtype=torch.float64).to(dtype)
    h0, d0, kept = packed_grad(gate_up, ct, donate=False)
    h1, d1, donated = packed_grad(gate_up, ct, donate=True)
    assert torch.equal(h0, h1) and torch.equal(d0, d1)
    assert torch.equal(kept, gate_up)  # not donated: the input is left as it was
    if rows:
        assert d1.data_ptr() == donated.data_ptr() and torch.equal(donated, d1)
    assert_close(d1, swiglu_oracle(gate_up, ct), dtype=dtype, scale=2.0)


def unpermute_grads(y_RD, p_TK, layout, ct_TD, donate):
    y = y_RD.clone().requires_grad_()
    mine = y * 1
    p = None if p_TK is None else p_TK.clone().requires_grad_()
    out = unpermute(mine, p, layout, donate=donate)
    grads = torch.autograd.grad(out, [mine] + ([] if p is None else [p]), ct_TD)
    return out.detach(), grads, mine.detach()


@settings(max_examples=20, deadline=None)
@example(T=0, K=2, weighted=True, dropped=False, dtype=torch.float32, seed=0)
@example(T=3, K=1, weighted=False, dropped=False, dtype=torch.bfloat16, seed=1)
@example(T=6, K=3, weighted=True, dropped=True, dtype=torch.float64, seed=2)
@given(T=st.integers(0, 7), K=st.integers(1, 3), weighted=st.booleans(), dropped=st.booleans(), dtype=dtypes,
       seed=st.integers(0, 2**31 - 1))
def test_donated_unpermute_gradient_is_the_undonated_one_in_the_donated_memory(T, K, weighted, dropped, dtype,
                                                                               seed) -> None:
    E, D = 3, 4
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.int64)
    probs_TK = torch.rand(T, K, generator=g, dtype=torch.float64)
    layout = drop_layout(ids_TK, probs_TK, E, max(1, T * K // E), "probs", False)[0] if dropped else \
        sort_layout(ids_TK, E)
    y_RD = torch.randn(layout.num_rows, D, generator=g, dtype=torch.float64).to(dtype)
    p_TK = probs_TK.to(dtype) if weighted else None
    ct_TD = torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype)
    out0, grads0, kept = unpermute_grads(y_RD, p_TK, layout, ct_TD, donate=False)
    out1, grads1, donated = unpermute_grads(y_RD, p_TK, layout, ct_TD, donate=True)
    assert torch.equal(out0, out1)
    assert all(torch.equal(a, b) for a, b in zip(grads0[1:], grads1[1:]))  # dprobs: the same kernel
    # dy: the same values in fp32 / fp64; in bf16 the donated product rounds once to nearest (exactly the
    # oracle's rounding below), where the CPU bag kernel may round the last place differently
    if dtype == torch.bfloat16:
        assert_close(grads1[0], grads0[0], dtype=dtype)
    else:
        assert torch.equal(grads0[0], grads1[0])
    assert torch.equal(kept, y_RD)
    if layout.num_rows:
        assert grads1[0].data_ptr() == donated.data_ptr() and torch.equal(donated, grads1[0])
    # the oracle: row r takes its pair's cotangent times its gate weight (zero for padding rows)
    src_R = layout.row_src_R
    expect = torch.zeros(layout.num_rows, D, dtype=torch.float64)
    for r in range(layout.num_rows):
        n = int(src_R[r])
        if n < T * K:
            expect[r] = ct_TD[n // K].double() * (1.0 if p_TK is None else p_TK.reshape(-1)[n].double())
    assert torch.equal(grads1[0], expect.to(dtype))  # one product per row, rounded once


def grouped_grads(x_MD, w_EDF, counts, ct_MF, donate, retain=False):
    mine = x_MD.clone().requires_grad_() * 1  # a non-leaf the caller owns, as the dispatcher's rows are
    w = w_EDF.clone().requires_grad_()
    y = grouped_linear(mine, w, counts, donate=donate)
    dx, dw = torch.autograd.grad(y, [mine, w], ct_MF, retain_graph=retain)
    return y, dx, dw, mine


def grouped_oracle(x_MD, w_EDF, counts, ct_MF):
    """float64 loop: dx rows of e = ct @ w[e]^T, dw[e] = x^T ct over e's rows."""
    dx, dw = torch.zeros(x_MD.shape, dtype=torch.float64), torch.zeros(w_EDF.shape, dtype=torch.float64)
    start = 0
    for e, c in enumerate(counts):
        rows = slice(start, start + c)
        dx[rows] = ct_MF[rows].double() @ w_EDF[e].double().T
        dw[e] = x_MD[rows].double().T @ ct_MF[rows].double()
        start += c
    return dx, dw


@settings(max_examples=20, deadline=None)
@example(counts=[0, 3], D=8, F=8, dtype=torch.float32, seed=0)  # a zero-token expert, grouped_mm
@example(counts=[4], D=8, F=3, dtype=torch.bfloat16, seed=1)  # one expert, the loop
@example(counts=[0, 0], D=3, F=8, dtype=torch.float64, seed=2)  # no rows at all
@example(counts=[2, 0, 5], D=1, F=1, dtype=torch.float32, seed=3)
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=4), D=st.sampled_from([1, 3, 8]),
       F=st.sampled_from([1, 3, 8]), dtype=dtypes, seed=st.integers(0, 2**31 - 1))
def test_donated_grouped_linear_gradients_are_the_undonated_ones_with_dx_in_the_rows_memory(
        counts, D, F, dtype, seed) -> None:
    """dx written over x's rows, expert by expert, after dw has read them: the undonated values (both
    backends, chosen by shape: grouped_mm where D and F are 16-byte multiples in fp32 / bf16), and the
    float64 loop's."""
    g = torch.Generator().manual_seed(seed)
    M, E = sum(counts), len(counts)
    x = torch.randn(M, D, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(E, D, F, generator=g, dtype=torch.float64).to(dtype)
    ct = torch.randn(M, F, generator=g, dtype=torch.float64).to(dtype)
    y0, dx0, dw0, kept = grouped_grads(x, w, counts, ct, donate=False)
    y1, dx1, dw1, donated = grouped_grads(x, w, counts, ct, donate=True)
    assert torch.equal(y0, y1) and torch.equal(dw0, dw1)
    assert_close(dx1, dx0, dtype=dtype)
    assert torch.equal(kept.detach(), x)  # not donated: the input is left as it was
    if M and D:
        assert dx1.data_ptr() == donated.data_ptr() and torch.equal(donated.detach(), dx1)
    dx_ref, dw_ref = grouped_oracle(x, w, counts, ct)
    assert_close(dx1, dx_ref, dtype=dtype, scale=float(max(F, 1)))
    assert_close(dw1, dw_ref, dtype=dtype, scale=float(max(max(counts), 1)))


def blocked_oracle(gu_MZ, w_EFD, counts, ct_MD):
    """float64: y = loop(silu(gate) * up, w); returns (y, d gate_up, dw)."""
    F = w_EFD.shape[1]
    a, w = gu_MZ.double().requires_grad_(), w_EFD.double().requires_grad_()
    h = torch.nn.functional.silu(a[:, :F]) * a[:, F:]
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    y = torch.cat([h[bounds[e]:bounds[e + 1]] @ w[e] for e in range(len(counts))])
    return (y.detach(), *torch.autograd.grad(y, [a, w], ct_MD.double()))


@settings(max_examples=20, deadline=None)
@example(counts=[0, 3], F=8, D=8, dtype=torch.float32, seed=0, wants="both")  # a zero-token expert
@example(counts=[4], F=3, D=8, dtype=torch.bfloat16, seed=1, wants="dx")  # one expert, the loop
@example(counts=[0, 0], F=8, D=3, dtype=torch.float64, seed=2, wants="dw")  # no rows at all
@example(counts=[1, 0, 2], F=1, D=1, dtype=torch.float32, seed=3, wants="both")
@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=4), F=st.sampled_from([1, 3, 8]),
       D=st.sampled_from([1, 3, 8]), dtype=dtypes, seed=st.integers(0, 2**31 - 1),
       wants=st.sampled_from(["both", "dx", "dw"]))
def test_the_blocked_swiglu_down_product_matches_the_oracle_with_its_gradient_over_gate_up(
        counts, F, D, dtype, seed, wants) -> None:
    """The CPU's blocked SwiGLU + down product (one expert's rows at a time, donate=True): y, the gate | up
    gradient written over gate_up's memory, and dw, against float64; with either gradient alone."""
    g = torch.Generator().manual_seed(seed)
    M, E = sum(counts), len(counts)
    gu = (torch.randn(M, 2 * F, generator=g, dtype=torch.float64) * 2).to(dtype)
    w = torch.randn(E, F, D, generator=g, dtype=torch.float64).to(dtype)
    ct = torch.randn(M, D, generator=g, dtype=torch.float64).to(dtype)
    mine = gu.clone().requires_grad_() * 1 if wants != "dw" else gu.clone()
    wl = w.clone().requires_grad_(wants != "dx")
    y = swiglu_packed_grouped_linear(mine, wl, counts, donate=True)
    grads = torch.autograd.grad(y, ([mine] if wants != "dw" else []) + ([wl] if wants != "dx" else []), ct)
    y_ref, dgu_ref, dw_ref = blocked_oracle(gu, w, counts, ct)
    assert_close(y, y_ref, dtype=dtype, scale=float(F))
    if wants != "dw":
        assert_close(grads[0], dgu_ref, dtype=dtype, scale=2.0 * D)
        assert (not M) or grads[0].data_ptr() == mine.data_ptr()  # written over gate_up
    else:
        assert torch.equal(mine, gu)  # no gate | up gradient asked for: gate_up left as it was
    if wants != "dx":
        assert_close(grads[-1], dw_ref, dtype=dtype, scale=2.0 * max(max(counts), 1))


def test_the_blocked_swiglu_down_product_donates_nothing_to_a_retained_graph() -> None:
    g = torch.Generator().manual_seed(5)
    counts = [2, 0, 3]
    gu, w = torch.randn(5, 8, generator=g), torch.randn(3, 4, 6, generator=g)
    ct = torch.randn(5, 6, generator=g)
    mine = gu.clone().requires_grad_() * 1
    y = swiglu_packed_grouped_linear(mine, w, counts, donate=True)
    (d1,) = torch.autograd.grad(y, mine, ct, retain_graph=True)
    assert torch.equal(mine.detach(), gu) and d1.data_ptr() != mine.data_ptr()
    (d2,) = torch.autograd.grad(y, mine, ct)
    assert torch.equal(d1, d2) and d2.data_ptr() == mine.data_ptr()
    assert_close(d1, blocked_oracle(gu, w, counts, ct)[1].float())


def test_below_the_size_that_faults_nothing_is_donated_and_no_block_loop_runs(monkeypatch) -> None:
    """At the CPU's own size rule a small buffer is paged in already: the products run as before (the
    rows keep their values, the SwiGLU's h is saved)."""
    monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", 32 * 2**20)
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 8, generator=g), torch.randn(2, 8, 4, generator=g)
    ct = torch.randn(5, 4, generator=g)
    mine = x.clone().requires_grad_() * 1
    (dx,) = torch.autograd.grad(grouped_linear(mine, w, [2, 3], donate=True), mine, ct)
    assert torch.equal(mine.detach(), x) and dx.data_ptr() != mine.data_ptr()
    gu = torch.randn(5, 8, generator=g).requires_grad_() * 1
    y = swiglu_packed_grouped_linear(gu, torch.randn(2, 4, 6, generator=g), [2, 3], donate=True)
    assert "SwiGLUDownBlocked" not in type(y.grad_fn).__name__
    monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", 5 * 8 * 4)  # x's own size: donated
    mine = x.clone().requires_grad_() * 1
    (dx,) = torch.autograd.grad(grouped_linear(mine, w, [2, 3], donate=True), mine, ct)
    assert dx.data_ptr() == mine.data_ptr()


def test_grouped_linear_donates_nothing_to_a_retained_graph_or_torch_func() -> None:
    g = torch.Generator().manual_seed(4)
    counts = [3, 0, 2]
    x = torch.randn(5, 8, generator=g)
    w = torch.randn(3, 8, 4, generator=g)
    ct = torch.randn(5, 4, generator=g)
    mine = x.clone().requires_grad_() * 1
    wl = w.clone().requires_grad_()
    y = grouped_linear(mine, wl, counts, donate=True)
    (d1,) = torch.autograd.grad(y, mine, ct, retain_graph=True)
    assert torch.equal(mine.detach(), x) and d1.data_ptr() != mine.data_ptr()
    (d2,) = torch.autograd.grad(y, mine, ct)  # the graph freed after this one: donated
    assert torch.equal(d1, d2) and d2.data_ptr() == mine.data_ptr()
    _, vjp_fn = torch.func.vjp(lambda a: grouped_linear(a, w, counts, donate=True), x.clone())
    assert_close(vjp_fn(ct)[0], d1)
    assert_close(d1, grouped_oracle(x, w, counts, ct)[0].float())


def test_nothing_is_donated_under_torch_func_or_a_create_graph_backward() -> None:
    g = torch.Generator().manual_seed(0)
    gate_up, ct = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g,
                                                                                 dtype=torch.float64)
    before = gate_up.clone()
    _, vjp_fn = torch.func.vjp(lambda a: swiglu_packed(a, donate=True), gate_up)
    (d_func,) = vjp_fn(ct)
    assert torch.equal(gate_up, before)
    leaf = gate_up.clone().requires_grad_()
    mine = leaf * 1
    (d_cg,) = torch.autograd.grad(swiglu_packed(mine, donate=True), mine, ct, create_graph=True)
    assert torch.equal(mine.detach(), before) and d_cg.data_ptr() != mine.data_ptr()
    assert_close(d_func, swiglu_oracle(before, ct))
    assert_close(d_cg.detach(), swiglu_oracle(before, ct))


def test_a_retained_graph_donates_nothing_and_backwards_again_to_the_same_gradients() -> None:
    """retain_graph keeps the saved tensors for another backward: nothing is written over them then."""
    g = torch.Generator().manual_seed(3)
    leaf = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mine = leaf * 1
    before = mine.detach().clone()
    h = swiglu_packed(mine, donate=True)
    ct = torch.randn(5, 4, generator=g, dtype=torch.float64)
    (d1,) = torch.autograd.grad(h, mine, ct, retain_graph=True)
    assert torch.equal(mine.detach(), before) and d1.data_ptr() != mine.data_ptr()
    (d2,) = torch.autograd.grad(h, mine, ct)  # the graph freed after this one: donated
    assert torch.equal(d1, d2) and d2.data_ptr() == mine.data_ptr()
    assert_close(d1, swiglu_oracle(before, ct))


def test_a_node_that_saved_the_donated_tensor_fails_loudly_if_it_runs_later() -> None:
    leaf = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mine = leaf * 1
    other = mine.pow(2).sum()  # saves `mine`; made first, so its backward runs after the donation
    h = swiglu_packed(mine, donate=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (h.sum() + other).backward()


@pytest.mark.parametrize("remat", [False, True])
def test_the_moe_layer_donates_its_rows_and_the_experts_buffers_on_cpu(remat: bool, monkeypatch) -> None:
    """fmoe.moe's backward on CPU, in three steps (permute, experts, unpermute: fmoe.ops.local_experts,
    which makes none of these rows, refused; tests/test_ops_local_experts.py), writes over the experts'
    gate | up rows [M, 2F], the rows the experts got [M, D] (not under remat, whose recompute reads them
    again) and the rows its combine got [R, D] (what the layer saved, checked against copies taken when
    saved); its gradients are unchanged (tests/test_moe_layer.py holds them to the loop oracle)."""
    monkeypatch.setattr("fmoe.phases.local_experts_pay", lambda *a: False)
    cfg = MoEConfig(d_model=4, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=0.0)  # M 12, 2F 16, F 8, D 4
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    x_TD = torch.randn(6, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 2 and t.shape[0] == 12 and t.is_floating_point():
            saved.append((t, t.detach().clone()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y_TD, _ = moe(params, x_TD, cfg, remat=remat)
    y_TD.sum().backward()
    changed = sorted(tuple(t.shape) for t, copy in saved if not torch.equal(t, copy))
    # under remat the experts' buffers are made again inside the backward (out of these hooks' sight) and
    # their rows, which the recompute reads, are not donated: the combine's rows only. Otherwise the
    # experts' rows, gate | up and the combine's rows; silu(gate) and h [M, F] live one expert's block at a
    # time (the blocked SwiGLU + down product): nothing of that shape is saved
    assert changed == ([(12, 4)] if remat else [(12, 4), (12, 4), (12, 16)]), changed
    assert remat or all(tuple(t.shape) != (12, 8) for t, _ in saved)


def test_the_donated_buffers_benchmark_runs_and_its_two_sides_agree(capsys) -> None:
    """benchmarks/donated.py at a small shape: it checks both sides equal before timing them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import donated

    assert donated.main(["--rows", "64", "--d", "8", "--f", "4", "--experts", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert all(case in out for case in ("swiglu backward", "unpermute dy", "experts dx", "swiglu + down"))


@pytest.mark.parametrize("probs_in_expert", [False, True])
@pytest.mark.parametrize("remat", [False, True])
def test_the_layer_takes_the_same_gradients_with_and_without_the_cpu_buffer_paths(
        monkeypatch, probs_in_expert, remat) -> None:
    """fmoe.moe with every CPU-only path on (the donated rows and h, the blocked SwiGLU + down) against the
    same layer with them off (the size rule at its real 32 MiB): the same output and gradients, with the
    gate weights at the combine or inside the experts, with and without remat."""
    cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=0.01,
                    probs_in_expert=probs_in_expert)
    params = init_moe(cfg, torch.Generator().manual_seed(0))
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    ct = torch.randn(10, 8, generator=torch.Generator().manual_seed(2))

    def run(size: int) -> list[torch.Tensor]:
        monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", size)
        leaves = [p.detach().clone().requires_grad_() for p in (params["router"]["w"],
                                                                 params["experts"]["w_gate_up"],
                                                                 params["experts"]["w_down"])]
        p = {"router": {"w": leaves[0]}, "experts": {"w_gate_up": leaves[1], "w_down": leaves[2]}}
        x_TD = x.clone().requires_grad_()
        y, aux = moe(p, x_TD, cfg, remat=remat)
        grads = torch.autograd.grad((y * ct).sum() + aux.loss, [x_TD, *leaves])
        return [y.detach(), *grads]

    on, off = run(0), run(32 * 2**20)
    for a, b in zip(on, off):
        assert_close(a, b, dtype=torch.float32)


@pytest.mark.parametrize("fused", [False, True])
def test_a_pipeline_stage_run_whole_takes_the_cpu_buffer_paths_and_the_oracle_gradients(
        fused: bool, monkeypatch) -> None:
    """The executor runs a 1F1B stage with nothing to overlap whole, under split_vjp(defer=False): plain
    autograd, so at sizes that fault the CPU paths run inside it: `fused`, fmoe.ops.local_experts (the
    layer is local), else the three steps' (rows and gate | up taking their gradients, the blocked SwiGLU
    + down). One rank's step against gpt_loss differentiated by torch.func.vjp (where nothing is donated
    and nothing fused), in float64."""
    import fmoe.ops._grouped_linear as grouped
    import fmoe.ops._mlp_products as products
    import fmoe.phases as phases
    from fmoe import GPTConfig, gpt_loss, init_gpt, init_gpt_state
    from fmoe import schedule as S
    from fmoe.pipeline import gpt_pipeline_step, gpt_program

    ran = {"rows": 0, "blocks": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            ran[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(grouped, "_dx_over", counted("rows", grouped._dx_over))
    monkeypatch.setattr(products, "packed_swiglu_grad_over",
                        counted("blocks", products.packed_swiglu_grad_over))
    ran["fused"] = 0
    monkeypatch.setattr(phases, "local_experts", counted("fused", phases.local_experts))
    if not fused:
        monkeypatch.setattr(phases, "local_experts_pay", lambda *a: False)
    moe_cfg = MoEConfig(d_model=8, d_ff=8, num_experts=4, top_k=2, aux_loss_coef=1e-2)
    cfg = GPTConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, moe=moe_cfg)
    params = init_gpt(cfg, torch.Generator().manual_seed(0), torch.float64)
    state = init_gpt_state(cfg)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 16, (2, 6), generator=g) for _ in range(3)]
    batches = [(s[:, :-1], s[:, 1:]) for s in seqs]
    step = gpt_pipeline_step(gpt_program(cfg, S.build("1f1b", 1, 3), 0), params, state, batches)
    # the paths ran inside the executor
    assert (ran["fused"] > 0 and ran["rows"] == ran["blocks"] == 0) if fused else (
        ran["fused"] == 0 and ran["rows"] > 0 and ran["blocks"] > 0)
    monkeypatch.undo()  # the oracle: torch.func, where neither runs
    monkeypatch.setattr("fmoe.ops._donate.ALWAYS_MAPPED_BYTES", 0)
    monkeypatch.setattr("fmoe.ops._host_bound.HOST_BOUND_BYTES", 0)

    def mean_loss(p):
        return sum(gpt_loss(p, ids, t, cfg, state)[0] for ids, t in batches) / 3

    loss, vjp = torch.func.vjp(mean_loss, params)
    (want,) = vjp(torch.ones((), dtype=torch.float64))
    assert float(step.loss) == pytest.approx(float(loss), rel=1e-12)
    got, expect = (dict(torch.utils._pytree.tree_flatten_with_path(t)[0]) for t in (step.grads, want))
    assert got.keys() == expect.keys()
    for path, g in expect.items():
        torch.testing.assert_close(got[path], g, rtol=1e-9, atol=1e-12, msg=str(path))
