"""Host syncs per MoE layer per microbatch: at most one in the forward (the counts that size an
all-to-all), none in the backward, counted on CPU by fmoe.sync_count (a new sync fails here).

"cpu" runs the code path of CPU tensors (the host is the device there, so reading counts is free and
fmoe reads them once per layer); "device" empties fmoe.ops._grouped_linear.HOST_READS_FREE, so CPU tensors
take the accelerator path (counts and grouped-GEMM offsets stay on the device). Figures: BENCHMARKS.md
("Host syncs"), from benchmarks/host_syncs.py.

Legend (docs/moe.md): B sequences, S positions, T tokens, D width, E experts.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import spawn

import fmoe.ops._grouped_linear as gl
from fmoe.block import init_block
from fmoe.config import GPTConfig, MoEConfig
from fmoe.ops import linear
from fmoe.sync_count import block_syncs, count_syncs, moe_syncs, phased_block_syncs
from fmoe.transforms import split_vjp

# ---- the counter ----------------------------------------------------------------------------------

def test_counter_sees_each_kind() -> None:
    x = torch.arange(6)
    with count_syncs() as c:
        x.sum().item()
        x.tolist()
        bool(x.sum() > 0)
        int(x[0])
        float(x[1])
        torch.bincount(x)
        torch.nonzero(x)
        x.unique()
        torch.repeat_interleave(x, x)
        torch.tensor([1, 2])
        x[x > 2]
        x.cpu()
        x.to("cpu")
    assert c.by_kind() == {"item": 4, "tolist": 1, "bincount": 1, "nonzero": 1, "unique": 1,
                           "repeat_interleave": 1, "upload": 1, "bool_index": 1, "cpu": 2}
    assert all("test_host_syncs.py" in where for _, where in c.events)


def test_counter_ignores_what_does_not_sync() -> None:
    x = torch.arange(6)
    with count_syncs() as c:
        torch.repeat_interleave(x, x, output_size=15)
        torch.nonzero_static(x, size=5)
        torch.cumsum(x, 0).to(torch.int32)
        torch.zeros(3).index_add_(0, x[:3], torch.ones(3))
        torch.sort(x, stable=True)
    assert c.total == 0


def test_counter_sees_inside_vjp_and_autograd_backward() -> None:
    """Syncs inside a custom Function's forward and backward, under torch.func (split_vjp) and under the
    autograd engine: a TorchFunctionMode would see none of the backward ones."""
    class Sync(torch.autograd.Function):
        @staticmethod
        def forward(x):
            x.sum().item()
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            g.sum().tolist()
            return g * 2

    w = torch.randn(3, 3)
    for run in ("split_vjp", "autograd"):
        x = torch.randn(2, 3, requires_grad=run == "autograd")
        with count_syncs() as fwd:
            if run == "split_vjp":
                y, vjp_dx = split_vjp(lambda p, x: linear(Sync.apply(x), p), w, x)
            else:
                y = linear(Sync.apply(x), w)
        with count_syncs() as bwd:
            if run == "split_vjp":
                vjp_dx(torch.ones_like(y))[1]()
            else:
                y.sum().backward()
        assert (fwd.by_kind(), bwd.by_kind()) == ({"item": 1}, {"tolist": 1}), run


# ---- one MoE layer --------------------------------------------------------------------------------

def _tiny(num_local: int | None = None, rank: int = 0, **moe_kw) -> tuple:
    """A small block (D 32, E 8, K 2, a shared expert) and one microbatch of 4 x 16 tokens."""
    moe = MoEConfig(d_model=32, d_ff=32, num_experts=8, top_k=2, aux_loss_coef=0.01, num_shared_experts=1,
                    **moe_kw)
    cfg = GPTConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, moe=moe)
    params = init_block(cfg, torch.Generator().manual_seed(0))
    if num_local is not None:
        lo = rank * num_local
        experts = params["moe"]["experts"]
        params["moe"]["experts"] = {k: v[lo:lo + num_local].clone() for k, v in experts.items()}
    return cfg, params, torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1 + rank))


@pytest.fixture(params=["cpu", "device"])
def path(request, monkeypatch) -> str:
    if request.param == "device":
        monkeypatch.setattr(gl, "HOST_READS_FREE", ())
    return request.param


def _allowed(path: str) -> int:
    """Forward syncs allowed on one rank: the counts read once where that is free (CPU), else none."""
    return 1 if path == "cpu" else 0


MODES = {"dropless": {}, "in_expert": dict(probs_in_expert=True),
         "pad": dict(capacity_factor=1.0, pad_to_capacity=True)}


@pytest.mark.parametrize("mode", list(MODES))
def test_single_rank_block(path, mode) -> None:
    cfg, params, x = _tiny(**MODES[mode])
    block_syncs(params, x, cfg)  # warm up: first-call probes and caches
    got = block_syncs(params, x, cfg)
    assert got["forward"] <= _allowed(path) and got["dx"] == got["dw"] == 0, got


def test_single_rank_moe_autograd(path) -> None:
    cfg, params, x = _tiny()
    moe_syncs(params["moe"], x.reshape(-1, 32), cfg.moe)
    got = moe_syncs(params["moe"], x.reshape(-1, 32), cfg.moe)
    assert got["forward"] <= _allowed(path) and got["backward"] == 0, got


# ---- expert parallel, 2 gloo ranks ------------------------------------------------------------------

def _ep_rank(rank: int, world: int, device: bool) -> dict:
    import torch.distributed as dist

    from fmoe.parallel import AllGatherDispatcher, AllToAllDispatcher, CommGroup

    if device:
        gl.HOST_READS_FREE = ()
    comm = CommGroup(dist.group.WORLD)
    cfg, params, x = _tiny(num_local=8 // world, rank=rank)
    out = {}
    for name, d in (("alltoall", AllToAllDispatcher(comm, 8)), ("allgather", AllGatherDispatcher(comm, 8))):
        for how, fn in (("sync", block_syncs), ("phased", phased_block_syncs)):
            fn(params, x, cfg, d)
            out[f"{name} {how}"] = fn(params, x, cfg, d)
    return out


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "device"])
def test_expert_parallel_one_sync_forward_none_backward(device) -> None:
    for r in spawn(_ep_rank, 2, device, timeout_s=180):
        for name, got in r.value.items():
            assert (got["forward"], got["dx"], got["dw"]) == (1, 0, 0), (r.rank, name, got)
