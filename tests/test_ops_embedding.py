"""embedding against a python-loop oracle: rows, table grad (vjp and deferred via split_vjp), FLOPs, errors.

Legend: V vocabulary rows, D features, N ids (any shape).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from fmoe.ops import _embedding as emb_mod
from fmoe.ops import embedding, linear
from fmoe.transforms.split_vjp import split_vjp
from fmoe.transforms.tape import WeightGradTape, active_tape
from fmoe.transforms.testing import assert_close, float_dtypes


def make(ids_shape, V, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, ids_shape, generator=g)
    table_VD = torch.randn(V, D, generator=g, dtype=torch.float64).to(dtype)
    ct = torch.randn(*ids_shape, D, generator=g, dtype=torch.float64).to(dtype)
    return ids, table_VD, ct


def oracle(ids, table_VD, ct):
    """(out, dtable) in float64 by explicit loops over every id."""
    flat = ids.reshape(-1).tolist()
    t64, c64 = table_VD.double(), ct.double().reshape(-1, table_VD.shape[1])
    out = torch.stack([t64[i] for i in flat]) if flat else t64.new_zeros(0, table_VD.shape[1])
    dtable = torch.zeros_like(t64)
    for n, i in enumerate(flat):
        dtable[i] += c64[n]
    return out.reshape(*ids.shape, table_VD.shape[1]), dtable


ids_shapes = st.lists(st.integers(0, 6), min_size=1, max_size=2).map(tuple)


@settings(max_examples=30, deadline=None)
@example(ids_shape=(0,), V=3, D=2, dtype=torch.float32, seed=0)
@example(ids_shape=(6,), V=1, D=3, dtype=torch.bfloat16, seed=0)  # every id repeated: accumulation
@example(ids_shape=(2, 3), V=5, D=1, dtype=torch.float64, seed=1)
@given(ids_shape=ids_shapes, V=st.integers(1, 6), D=st.integers(1, 5), dtype=float_dtypes,
       seed=st.integers(0, 2**31 - 1))
def test_matches_loop_oracle(ids_shape, V, D, dtype, seed) -> None:
    ids, table_VD, ct = make(ids_shape, V, D, dtype, seed)
    out_ref, dt_ref = oracle(ids, table_VD, ct)
    out, vjp_fn = torch.func.vjp(lambda t: embedding(ids, t), table_VD)
    assert out.dtype == dtype and out.shape == (*ids_shape, D)
    assert_close(out, out_ref, dtype=dtype)
    assert_close(vjp_fn(ct)[0], dt_ref, dtype=dtype)
    # plain tape autograd (aten's embedding on CPU for full-precision tables, the Function otherwise)
    t = table_VD.detach().requires_grad_(True)
    out_ag = embedding(ids, t)
    assert_close(out_ag, out_ref, dtype=dtype)
    assert_close(torch.autograd.grad(out_ag, t, ct)[0], dt_ref, dtype=dtype)

    calls = []
    real = emb_mod._table_grad
    with mock.patch.object(emb_mod, "_table_grad", lambda *a: calls.append(1) or real(*a)):
        _, vjp_dx = split_vjp(lambda p, ids: embedding(ids, p["table"]), {"table": table_VD}, ids)
        (dids,), vjp_dw = vjp_dx(ct)
        assert dids is None and calls == []
        assert_close(vjp_dw()["table"], dt_ref, dtype=dtype)
        assert calls == [1]


def test_tape_entry() -> None:
    ids, table_VD, ct = make((4,), 3, 2, torch.float64, 0)
    _, vjp_fn = torch.func.vjp(lambda t: embedding(ids, t), table_VD)
    tape = WeightGradTape([table_VD])
    with active_tape(tape):
        (now,) = vjp_fn(ct)
    assert len(tape) == 1 and torch.count_nonzero(now) == 0
    assert_close(tape.run()[0], oracle(ids, table_VD, ct)[1])


def test_flops_conserved_by_split() -> None:
    # FlopCounterMode has no formula for aten.index_add(_) (the scatter-add of the table grad), so count it
    # as one add per source element with custom_mapping; matmuls (the linear after it) count as usual.
    def index_add_flops(self_shape, dim, index_shape, source_shape, *args, out_shape=None, **kwargs):
        return torch.Size(source_shape).numel()  # FlopCounterMode passes shapes, not tensors

    # Keys are overload packets: FlopCounterMode looks ops up by func._overloadpacket.
    mapping = {torch.ops.aten.index_add_: index_add_flops, torch.ops.aten.index_add: index_add_flops}
    ids, table_VD, _ = make((7,), 5, 4, torch.float32, 0)
    w_DF = torch.randn(4, 3)
    ct = torch.randn(7, 3)

    def f(p, ids):
        return linear(embedding(ids, p["table"]), p["w"])

    def flops(fn):
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            fn()
        return counter.get_total_flops()

    _, vjp_fn = torch.func.vjp(lambda t, w: f({"table": t, "w": w}, ids), table_VD, w_DF)
    full = flops(lambda: vjp_fn(ct))
    _, vjp_dx = split_vjp(f, {"table": table_VD, "w": w_DF}, ids)
    held = {}
    dx_pass = flops(lambda: held.update(dw=vjp_dx(ct)[1]))
    dw_pass = flops(lambda: held["dw"]())
    assert dw_pass >= 7 * 4 + 2 * 7 * 4 * 3  # the table scatter-add and the linear weight grad
    assert dx_pass + dw_pass == full


def test_vmap_over_tables() -> None:
    ids = torch.tensor([0, 2, 2])
    tables = torch.randn(2, 3, 4, dtype=torch.float64)
    out = torch.func.vmap(lambda t: embedding(ids, t, check_range=False))(tables)
    assert_close(out, tables[:, ids])


@pytest.mark.parametrize(
    ("ids", "table", "match"),
    [
        (torch.tensor([0, 3]), torch.zeros(3, 2), r"\[0, 3\)"),
        (torch.tensor([-1]), torch.zeros(3, 2), "min -1"),
        (torch.tensor([0.0]), torch.zeros(3, 2), "integer"),
        (torch.tensor([0]), torch.zeros(3), r"\[V, D\]"),
        (torch.tensor([0]), torch.zeros(3, 2, dtype=torch.long), "floating"),
    ],
)
def test_errors(ids, table, match) -> None:
    with pytest.raises(ValueError, match=match):
        embedding(ids, table)


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_range_error_on_every_path(table_dtype) -> None:
    # aten's path (fp32 table, plain autograd), the Function (bf16 table) and torch.func: one ValueError.
    ids, table = torch.tensor([0, 3]), torch.zeros(3, 2, dtype=table_dtype)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        embedding(ids, table.requires_grad_(True))
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        torch.func.vjp(lambda t: embedding(ids, t), table.detach())
