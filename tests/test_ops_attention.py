"""attention and rope against a float64 oracle: explicit softmax(QK^T/sqrt(d) + mask) V, hand-written RoPE.

Legend (docs/moe.md): B sequences, S positions, H query heads, G kv heads, d head dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.ops import attention, rope
from fmoe.transforms.testing import assert_close, check_vjp, float_dtypes


def rope_oracle(x_SHd, positions, theta):
    """Rotate pair (x[i], x[i + d/2]) by pos * theta^(-2i/d), one pair at a time."""
    S, H, d = x_SHd.shape
    out = x_SHd.clone()
    for t in range(S):
        for i in range(d // 2):
            a = float(positions[t]) * theta ** (-2.0 * i / d)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x_SHd[t, :, i], x_SHd[t, :, i + d // 2]
            out[t, :, i] = x1 * c - x2 * s
            out[t, :, i + d // 2] = x2 * c + x1 * s
    return out


def attention_oracle(q_BSHd, k_BSGd, v_BSGd, theta, causal, positions):
    B, S, H, d = q_BSHd.shape
    G = k_BSGd.shape[2]
    outs = []
    for b in range(B):
        q, k = rope_oracle(q_BSHd[b], positions, theta), rope_oracle(k_BSGd[b], positions, theta)
        heads = []
        for h in range(H):
            g = h // (H // G)
            s_SS = q[:, h] @ k[:, g].T / math.sqrt(d)
            if causal:
                s_SS = s_SS.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            heads.append(torch.softmax(s_SS, dim=-1) @ v_BSGd[b, :, g])
        outs.append(torch.stack(heads, dim=1))
    return torch.stack(outs)


@st.composite
def cases(draw):
    G = draw(st.integers(1, 2))
    return dict(B=draw(st.integers(1, 2)), S=draw(st.integers(1, 5)), H=G * draw(st.integers(1, 2)), G=G,
                d=draw(st.sampled_from([2, 4, 8])), dtype=draw(float_dtypes), causal=draw(st.booleans()),
                theta=draw(st.sampled_from([10000.0, 10.0])), seed=draw(st.integers(0, 2**31 - 1)))


def make(c):
    g = torch.Generator().manual_seed(c["seed"])

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(c["dtype"])

    return r(c["B"], c["S"], c["H"], c["d"]), r(c["B"], c["S"], c["G"], c["d"]), \
        r(c["B"], c["S"], c["G"], c["d"]), r(c["B"], c["S"], c["H"], c["d"])


def oracle_grads(q, k, v, ct, theta, causal, positions):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o = attention_oracle(q64, k64, v64, theta, causal, positions)
    return (o.detach(), *torch.autograd.grad(o, (q64, k64, v64), ct.double()))


@settings(max_examples=25, deadline=None)
@example(c=dict(B=1, S=1, H=1, G=1, d=2, dtype=torch.float64, causal=True, theta=10000.0, seed=0))
@example(c=dict(B=2, S=4, H=4, G=1, d=8, dtype=torch.float32, causal=True, theta=10000.0, seed=1))  # MQA
@example(c=dict(B=1, S=5, H=2, G=2, d=4, dtype=torch.bfloat16, causal=True, theta=10.0, seed=2))
@given(c=cases())
def test_matches_oracle(c) -> None:
    q, k, v, ct = make(c)
    positions = torch.arange(c["S"])
    def f(q, k, v):
        return attention(q, k, v, rope_theta=c["theta"], causal=c["causal"])

    out, vjp_fn = torch.func.vjp(f, q, k, v)
    assert out.shape == q.shape and out.dtype == c["dtype"]
    ref = oracle_grads(q, k, v, ct, c["theta"], c["causal"], positions)
    assert_close((out, *vjp_fn(ct)), ref, dtype=c["dtype"], scale=2.0)


@settings(max_examples=15, deadline=None)
@example(c=dict(B=1, S=1, H=1, G=1, d=2, dtype=torch.float64, causal=True, theta=10000.0, seed=0))
@example(c=dict(B=2, S=4, H=4, G=1, d=8, dtype=torch.float32, causal=False, theta=10000.0, seed=1))
@given(c=cases())
def test_tape_autograd_path_matches_oracle(c) -> None:
    """Outside torch.func the op runs as plain ops with sdpa's own backward: same values and grads."""
    q, k, v, ct = make(c)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, rope_theta=c["theta"], causal=c["causal"])
    grads = torch.autograd.grad(out, leaves, ct)
    ref = oracle_grads(q, k, v, ct, c["theta"], c["causal"], torch.arange(c["S"]))
    assert_close((out.detach(), *grads), ref, dtype=c["dtype"], scale=2.0)


def test_unbatched_positions_and_tape_autograd() -> None:
    c = dict(B=1, S=4, H=2, G=1, d=4, dtype=torch.float64, causal=True, theta=100.0, seed=3)
    q, k, v, ct = make(c)
    positions = torch.tensor([3, 5, 6, 10])
    q0, k0, v0 = (t[0].clone().requires_grad_() for t in (q, k, v))
    out = attention(q0, k0, v0, rope_theta=100.0, positions_S=positions)
    out.backward(ct[0])
    ref = oracle_grads(q, k, v, ct, 100.0, True, positions)
    assert_close((out.detach(), q0.grad, k0.grad, v0.grad), tuple(r[0] for r in ref))


def test_rope_matches_oracle_and_preserves_norm() -> None:
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64)
    pos = torch.arange(6) * 2
    got = rope(x, pos, 500.0)
    assert_close(got, torch.stack([rope_oracle(xb, pos, 500.0) for xb in x]))
    assert_close(got.norm(dim=-1), x.norm(dim=-1))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_finite_differences_float64(seed) -> None:
    q, k, v, _ = make(dict(B=1, S=3, H=2, G=1, d=4, dtype=torch.float64, seed=seed))
    check_vjp(attention, q, k, v)


def test_vmap() -> None:
    q, k, v, _ = make(dict(B=2, S=3, H=2, G=2, d=4, dtype=torch.float64, seed=0))
    assert_close(torch.func.vmap(attention)(q, k, v), attention(q, k, v))


@pytest.mark.parametrize(
    ("qs", "ks", "vs", "match"),
    [
        ((1, 3, 3, 4), (1, 3, 2, 4), (1, 3, 2, 4), "divide"),
        ((1, 3, 2, 3), (1, 3, 2, 3), (1, 3, 2, 3), "even"),
        ((1, 3, 2, 4), (1, 4, 2, 4), (1, 4, 2, 4), "agree"),
        ((1, 3, 2, 4), (1, 3, 2, 4), (1, 3, 1, 4), "one shape"),
        ((3, 4), (3, 4), (3, 4), r"\[B, S, heads, d\]"),
    ],
)
def test_errors(qs, ks, vs, match) -> None:
    with pytest.raises(ValueError, match=match):
        attention(torch.zeros(qs), torch.zeros(ks), torch.zeros(vs))
