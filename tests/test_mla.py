"""Multi-head latent attention (fmoe/mla.py) against an independent per-head oracle, in fp64.

Oracle: a plain loop over sequences and heads in torch: its own RMSNorm, RoPE as a complex rotation of
(x[i], x[i + r/2]) by pos * theta^(-2i/r), and a causal softmax with an explicit mask, nothing of fmoe's.
`self_attention` (cfg.mla) and the oracle are differentiated by torch.func.vjp with one cotangent; values
and every parameter and input gradient must agree. The whole gpt_loss with MLA (dense and MoE blocks,
MTP) is checked by central finite differences along random directions. Under tensor parallelism (2 gloo
ranks, with and without sequence parallelism) each rank's output, input gradient and weight-shard
gradients must equal the one-process run's (fmoe.tp_layout.shard_block cut). The train config's MLA flags
and presets are checked without building a large model.

Legend (the package's, docs/moe.md; MLA's in fmoe/mla.py): B sequences, S positions, D model width,
H heads, d / r non-rotary / rotary qk dims, e value dim, C kv latent width.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import spawn
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.block import init_attention, init_block, self_attention
from fmoe.config import GPTConfig, MoEConfig
from fmoe.model import gpt_loss, init_gpt, init_gpt_state
from fmoe.parallel import CommGroup
from fmoe.parallel.context import ParallelContext
from fmoe.structure import Absent, block_params_spec, check_block
from fmoe.tp_layout import check_shard, shard_block, split_units
from fmoe.transforms.testing import assert_close

DT = torch.float64
EPS = 1e-6


def _cfg(D: int = 8, H: int = 2, d: int = 4, r: int = 2, e: int = 3, C: int = 5, Q: int = 6,
         **kw) -> GPTConfig:
    moe = MoEConfig(d_model=D, d_ff=4, num_experts=4, top_k=2, num_shared_experts=1, aux_loss_coef=0.01)
    return GPTConfig(vocab_size=16, d_model=D, n_layers=2, n_heads=H, moe=moe, head_dim=d, q_lora_rank=Q,
                     kv_lora_rank=C, qk_rope_head_dim=r, v_head_dim=e, norm_eps=EPS, **kw)


# --- the oracle --------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w


def _rope(x_Sr: torch.Tensor, theta: float) -> torch.Tensor:
    """One head's rotary features [S, r]: (x[i], x[i + r/2]) rotated by pos * theta^(-2i/r)."""
    S, r = x_Sr.shape
    half = r // 2
    ang = torch.outer(torch.arange(S, dtype=DT), theta ** (-torch.arange(half, dtype=DT) * 2 / r))
    z = torch.complex(x_Sr[:, :half], x_Sr[:, half:]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], -1)


def _oracle(p: dict, x_BSD: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """x + MLA(x), one sequence and one head at a time."""
    H, d, r, e, C = cfg.n_heads, cfg.head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    outs = []
    for x_SD in x_BSD:
        S = x_SD.shape[0]
        h = _rms(x_SD, p["attn_norm"])
        q_all = _rms(h @ p["w_q_a"], p["q_a_norm"]) @ p["w_q_b"] if "w_q_a" in p else h @ p["w_q"]
        kv_a = h @ p["w_kv_a"]
        kv = _rms(kv_a[:, :C], p["kv_a_norm"]) @ p["w_kv_b"]
        k_rope = _rope(kv_a[:, C:], cfg.rope_theta)  # shared by every head
        future = torch.ones(S, S).triu(1).bool()
        heads = []
        for i in range(H):
            q = q_all[:, i * (d + r):(i + 1) * (d + r)]
            q = torch.cat([q[:, :d], _rope(q[:, d:], cfg.rope_theta)], -1)
            k = torch.cat([kv[:, i * (d + e):i * (d + e) + d], k_rope], -1)
            v = kv[:, i * (d + e) + d:(i + 1) * (d + e)]
            scores = (q @ k.T / math.sqrt(d + r)).masked_fill(future, -math.inf)
            heads.append(torch.softmax(scores, -1) @ v)
        outs.append(x_SD + torch.cat(heads, -1) @ p["w_o"])
    return torch.stack(outs)


def _vjp(f, p: dict, x: torch.Tensor, ct: torch.Tensor) -> tuple:
    y, vjp = torch.func.vjp(f, p, x)
    return y, *vjp(ct)


def _compare(cfg: GPTConfig, B: int, S: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    p = init_attention(cfg, g, DT)
    # gains off one, so that their gradients are tested in general position
    p = {k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=DT) if v.dim() == 1 else v
         for k, v in p.items()}
    x = torch.randn(B, S, cfg.d_model, generator=g, dtype=DT)
    ct = torch.randn(B, S, cfg.d_model, generator=g, dtype=DT)
    got = _vjp(lambda p_, x_: self_attention(p_, x_, cfg), p, x, ct)
    want = _vjp(lambda p_, x_: _oracle(p_, x_, cfg), p, x, ct)
    assert_close(got, want)


# --- one process -------------------------------------------------------------------------------------


@pytest.mark.parametrize("Q", [0, 6])
def test_self_attention_with_mla_equals_the_oracle(Q: int) -> None:
    _compare(_cfg(Q=Q), B=2, S=5, seed=Q)


@settings(max_examples=12, derandomize=True, deadline=None)
@given(B=st.integers(1, 2), S=st.integers(1, 5), H=st.integers(1, 3), d=st.integers(1, 4),
       r=st.sampled_from([2, 4]), e=st.integers(1, 4), C=st.integers(1, 5), Q=st.integers(0, 4),
       seed=st.integers(0, 99))
@example(B=1, S=1, H=1, d=1, r=2, e=1, C=1, Q=0, seed=0)
@example(B=2, S=4, H=1, d=2, r=2, e=3, C=2, Q=0, seed=1)
def test_mla_property(B: int, S: int, H: int, d: int, r: int, e: int, C: int, Q: int, seed: int) -> None:
    _compare(_cfg(D=6, H=H, d=d, r=r, e=e, C=C, Q=Q), B, S, seed)


@pytest.mark.parametrize("Q", [0, 6])
def test_init_matches_the_spec_and_checks(Q: int) -> None:
    cfg = _cfg(Q=Q)
    for dense in (False, True):
        p = init_block(cfg, torch.Generator().manual_seed(0), DT, dense=dense)
        check_block(p, cfg, dense=dense)
        spec = block_params_spec(cfg, dense)
        assert {k for k, v in spec.items() if not isinstance(v, Absent)} == set(p)
    p = init_attention(cfg)
    with pytest.raises(ValueError, match="w_kv_b has shape"):
        check_block({**p, "w_kv_b": p["w_kv_b"][:, 1:]}, cfg, dense=True, paths=(("w_kv_b",),))
    with pytest.raises(ValueError, match="w_k is not in the config"):
        check_block({**p, "w_k": p["w_kv_b"]}, cfg, dense=True, paths=(("w_k",),))
    with pytest.raises(ValueError, match="w_q_b is missing" if Q else "w_q is missing"):
        self_attention({k: v for k, v in p.items() if k not in ("w_q", "w_q_b")}, torch.zeros(1, 2, 8), cfg)
    # the gains are ones, the projections N(0, 1/fan_in)
    assert torch.equal(p["kv_a_norm"], torch.ones(cfg.kv_lora_rank))
    big = init_attention(_cfg(D=64, H=4, d=32, r=8, e=32, C=64, Q=Q))
    assert abs(big["w_kv_b"].std().item() - 64 ** -0.5) < 0.01


def test_config_ranges() -> None:
    with pytest.raises(ValueError, match="qk_rope_head_dim must be positive and even"):
        _cfg(r=3)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be positive and even"):
        _cfg(r=0)
    with pytest.raises(ValueError, match="n_kv_heads"):
        _cfg(n_kv_heads=1)
    with pytest.raises(ValueError, match="qk_norm"):
        _cfg(qk_norm=True)
    with pytest.raises(ValueError, match="q_lora_rank is multi-head latent attention's"):
        _cfg(C=0, r=0, e=None, d=4, Q=3)
    with pytest.raises(ValueError, match="kv_lora_rank must be"):
        _cfg(C=-1)
    cfg = _cfg(e=None, d=3)  # odd d is fine: only the rotary part is rotated
    assert cfg.mla and cfg.v_head_dim == 3 and cfg.qk_head_dim == 5
    assert not _cfg(C=0, r=0, e=None, Q=0).mla


def test_gpt_loss_with_mla_matches_finite_differences() -> None:
    """The whole model (a dense block, an MoE block, MTP) through torch.func.vjp: the gradient's
    projection on random directions equals central differences of the loss."""
    cfg = _cfg(num_dense_layers=1, mtp=True)
    g = torch.Generator().manual_seed(5)
    params = init_gpt(cfg, g, DT)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 6), generator=g)
    state = init_gpt_state(cfg)

    def loss(p: dict) -> torch.Tensor:
        return gpt_loss(p, ids, targets, cfg, state)[0]

    value, vjp = torch.func.vjp(loss, params)
    (grad,) = vjp(torch.ones((), dtype=value.dtype))
    leaves, spec = torch.utils._pytree.tree_flatten(params)
    grads = torch.utils._pytree.tree_leaves(grad)
    assert grads[1].abs().sum() > 0 and all(torch.isfinite(t).all() for t in grads)
    h = 1e-6
    for k in range(3):
        dirs = [torch.randn(t.shape, generator=g, dtype=DT) for t in leaves]
        moved = [torch.utils._pytree.tree_unflatten([t + s * h * v for t, v in zip(leaves, dirs)], spec)
                 for s in (1, -1)]
        fd = (loss(moved[0]) - loss(moved[1])) / (2 * h)
        exact = sum((gr * v).sum() for gr, v in zip(grads, dirs))
        assert abs(fd - exact) <= 1e-5 * max(1.0, abs(exact)), (k, fd, exact)


# --- tensor and sequence parallelism -----------------------------------------------------------------

B, S = 2, 4


def _tp_data(Q: int) -> tuple[GPTConfig, dict]:
    cfg = _cfg(Q=Q)
    g = torch.Generator().manual_seed(11 + Q)
    p = init_block(cfg, g, DT, dense=True)
    p = {k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=DT) if k != "mlp" and v.dim() == 1 else v
         for k, v in p.items()}
    return cfg, {"params": p, "x": torch.randn(B, S, 8, generator=g, dtype=DT),
                 "ct": torch.randn(B, S, 8, generator=g, dtype=DT)}


def _positions(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[1] // size
    return t[:, rank * n:(rank + 1) * n]


def _pack(tree: object) -> object:
    return torch.utils._pytree.tree_map(lambda v: (tuple(v.shape), v.flatten().tolist()), tree)


def _tp_rank(rank: int, world: int) -> dict:
    comm = CommGroup(torch.distributed.group.WORLD)
    out = {}
    for Q in (0, 6):
        cfg, d = _tp_data(Q)
        mine = shard_block(d["params"], cfg, rank, world)
        mine = {k: v for k, v in mine.items() if k != "mlp"}
        for sp in (False, True):
            x, ct = d["x"], d["ct"]
            if sp:  # this rank's positions
                x, ct = _positions(x, rank, world), _positions(ct, rank, world)
            y, vjp = torch.func.vjp(lambda p_, x_, sp=sp, cfg=cfg: self_attention(
                p_, x_, cfg, parallel=ParallelContext(tp=comm, sequence_parallel=sp)), mine, x)
            dp, dx = vjp(ct)
            out[f"{Q}_{sp}"] = _pack({"y": y, "dx": dx, "dp": dp})
    return out


def _back(v: tuple) -> torch.Tensor:
    return torch.tensor(v[1], dtype=DT).reshape(v[0])


def test_mla_under_tp_and_sp_equals_one_process() -> None:
    world = 2
    out = spawn(_tp_rank, world, timeout_s=120)
    for Q in (0, 6):
        cfg, d = _tp_data(Q)
        attn = {k: v for k, v in d["params"].items() if k != "mlp"}
        y, vjp = torch.func.vjp(lambda p_, x_, cfg=cfg: self_attention(p_, x_, cfg), attn, d["x"])
        dp, dx = vjp(d["ct"])
        for rank, r in enumerate(out):
            for sp in (False, True):
                got = torch.utils._pytree.tree_map(_back, r.value[f"{Q}_{sp}"],
                                                   is_leaf=lambda v: isinstance(v, tuple) and len(v) == 2
                                                   and isinstance(v[1], list))
                cut = (lambda t, rank=rank: _positions(t, rank, world)) if sp else (lambda t: t)
                assert_close(got["y"], cut(y), msg=f"Q={Q} sp={sp} rank {rank}")
                assert_close(got["dx"], cut(dx), msg=f"Q={Q} sp={sp} rank {rank}")
                assert_close(got["dp"], shard_block(dp, cfg, rank, world), msg=f"Q={Q} sp={sp} rank {rank}")


@pytest.mark.parametrize("Q", [0, 6])
def test_tp_layout_of_mla(Q: int) -> None:
    cfg = _cfg(Q=Q)
    H, k, e = cfg.n_heads, cfg.qk_head_dim, cfg.v_head_dim
    assert split_units(cfg, ("w_q_b",) if Q else ("w_q",)) == (1, H, k)
    assert split_units(cfg, ("w_kv_b",)) == (1, H, cfg.head_dim + e)
    assert split_units(cfg, ("w_o",)) == (0, H, e)
    with pytest.raises(ValueError, match="no split weight"):
        split_units(cfg, ("w_k",))
    full = init_block(cfg, torch.Generator().manual_seed(0), DT, dense=True)
    half = shard_block(full, cfg, 1, 2)
    # rank 1 holds head 1 whole: its q columns, its [k_nope, v] columns and its output rows
    assert torch.equal(half["w_kv_b"], full["w_kv_b"][:, cfg.head_dim + e:])
    assert torch.equal(half["w_o"], full["w_o"][e:])
    assert half["w_kv_a"] is full["w_kv_a"]  # replicated
    check_shard(half, cfg, 2, tuple((p,) for p in half if p != "mlp"))
    with pytest.raises(ValueError, match="w_kv_b"):
        check_shard(full, cfg, 2, (("w_kv_b",),))
    with pytest.raises(ValueError, match="3 heads do not split"):
        shard_block(init_block(_cfg(H=3, Q=Q), dense=True), _cfg(H=3, Q=Q), 0, 2)


# --- fmoe train ----------------------------------------------------------------------------------------


def test_train_config_mla_flags_and_presets() -> None:
    from fmoe.train.config import TrainConfig

    tc = TrainConfig.from_sources(overrides={
        "multi_latent_attention": True, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_head_dim": 8,
        "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "num_layers": 2, "pp": 1, "ep": 1, "mtp": True})
    assert tc.problem() is None
    cfg = tc.model()
    assert cfg.mla and (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.qk_rope_head_dim,
                        cfg.v_head_dim) == (8, 8, 8, 4, 8)
    assert not TrainConfig.from_sources(overrides={"q_lora_rank": 8}).model().mla  # flags need the switch
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    loss, _ = gpt_loss(params, ids, ids, cfg)
    assert torch.isfinite(loss)
    for name, hidden, vocab in (("deepseek-v3", 7168, 129280), ("pangu-ultra-moe", 7680, 153376)):
        tc = TrainConfig.from_sources(preset=name)
        cfg = tc.model()  # a config only: 671B weights are never built
        assert (cfg.d_model, cfg.vocab_size, cfg.n_heads, cfg.kv_lora_rank, cfg.q_lora_rank) == (
            hidden, vocab, 128, 512, 1536)
        assert cfg.mla and cfg.num_dense_layers == 3 and cfg.moe.num_experts == 256 and cfg.mtp
        assert tc.problem(tc.world_size) is None, tc.problem(tc.world_size)
    bad = TrainConfig.from_sources(preset="deepseek-v3", overrides={"tp": 4, "num_attention_heads": 6})
    assert "6 heads do not split" in (bad.problem(bad.world_size) or "")
    bad = TrainConfig.from_sources(overrides={"multi_latent_attention": True, "kv_channels": 16})
    assert "--kv-channels" in (bad.problem() or "")


def test_a_checkpoint_names_mla_sizes_that_differ_and_older_ones_read_as_gqa() -> None:
    """head_dim 4 + rope 2 and head_dim 2 + rope 4 give w_q_b one shape: the recorded sizes must say it."""
    import dataclasses

    from fmoe.train.checkpoint import architecture_diff
    from fmoe.train.config import TrainConfig

    tc = TrainConfig.build({"multi_latent_attention": True, "kv_lora_rank": 8, "qk_head_dim": 4,
                            "qk_pos_emb_head_dim": 2, "v_head_dim": 4})
    swapped = dataclasses.asdict(dataclasses.replace(tc.model(), head_dim=2, qk_rope_head_dim=4))
    named = [d.split(":")[0] for d in architecture_diff(swapped, tc.as_dict())]
    assert named == ["head_dim", "qk_rope_head_dim"]
    gqa = TrainConfig()
    older = {k: v for k, v in dataclasses.asdict(gqa.model()).items()
             if k not in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")}
    assert architecture_diff(older, gqa.as_dict()) == []
    assert architecture_diff(older, tc.as_dict())  # an older (GQA) checkpoint into an MLA run: refused
