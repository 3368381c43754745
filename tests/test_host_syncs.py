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
        # "sync": the model's block (its phases in order, autograd); "phased": the same phases run by the
        # pipeline executor (split backward: F, then I with the transposed exchanges, then W)
        for how, fn in (("sync", block_syncs), ("phased", phased_block_syncs)):
            fn(params, x, cfg, d)
            out[f"{name} {how}"] = fn(params, x, cfg, d)
    return out


def _ep_both(rank: int, world: int) -> dict:
    """`_ep_rank` on the CPU path, then on the device path (HOST_READS_FREE emptied, then put back): one
    start of the 2 ranks for both (a rank's start costs seconds)."""
    cpu = _ep_rank(rank, world, False)
    free = gl.HOST_READS_FREE
    try:
        return {False: cpu, True: _ep_rank(rank, world, True)}
    finally:
        gl.HOST_READS_FREE = free


@pytest.fixture(scope="module")
def ep_runs() -> list:
    """Each of the 2 ranks' RankResult of `_ep_both`."""
    return spawn(_ep_both, 2, timeout_s=180)


@pytest.mark.parametrize("device", [False, True], ids=["cpu", "device"])
def test_expert_parallel_one_sync_forward_none_backward(device, ep_runs: list) -> None:
    for r in ep_runs:
        for name, got in r.value[device].items():
            assert (got["forward"], got["dx"], got["dw"]) == (1, 0, 0), (r.rank, name, got)
            # the one sync: the dispatcher's plan reads its split sizes in one read (fmoe.parallel.host_read)
            (where,) = got["where"]["forward"]
            assert where.startswith("tolist at parallel/host_read.py:"), (r.rank, name, got)


# ---- determinism (issue 29, item 10) ----------------------------------------------------------------

_ATOMIC = {torch.ops.aten.index_add.default, torch.ops.aten.index_add_.default,
           torch.ops.aten.scatter_add.default, torch.ops.aten.scatter_add_.default,
           torch.ops.aten.scatter_reduce.two, torch.ops.aten.scatter_reduce_.two,
           torch.ops.aten.embedding_dense_backward.default}


class _FloatAtomics(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that sum floats by atomic adds on CUDA (nondeterministic order there): scatter /
    index adds and index_put with accumulate=True on a floating tensor. Integer ones are exact in any
    order (expert_counts). A scatter_add whose every destination receives at most one value is a
    placement, exact in any order: the backward of the router's gather of each token's K distinct
    experts (scatter_add into [T, E] zeros, one value per (t, e)) is recorded separately."""

    def __init__(self):
        super().__init__()
        self.seen, self.placements = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        acc = func in (torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default) and (
            kwargs.get("accumulate", len(args) > 3 and args[3]))
        if (func in _ATOMIC or acc) and args[0].is_floating_point():
            placement = func is torch.ops.aten.scatter_add.default and _distinct_per_row(args[2])
            (self.placements if placement else self.seen).append(str(func))
        return func(*args, **kwargs)


def _distinct_per_row(index_TK: torch.Tensor) -> bool:
    """True when no row of a 2-D scatter index names one column twice."""
    return index_TK.dim() == 2 and bool((index_TK.sort(1).values.diff(dim=1) != 0).all())


@pytest.mark.parametrize("mode", list(MODES))
def test_layer_is_deterministic_by_construction(monkeypatch, mode) -> None:
    """On the accelerator path the MoE block's forward, dx and dw run under
    torch.use_deterministic_algorithms(True) and sum no float by atomic adds: the permute's backward is a
    gather by the inverse permutation, so the bitwise claims hold on CUDA with no tolerance."""
    monkeypatch.setattr(gl, "HOST_READS_FREE", ())
    cfg, params, x = _tiny(**MODES[mode])
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with _FloatAtomics() as mode_:
            block_syncs(params, x, cfg)
    finally:
        torch.use_deterministic_algorithms(was)
    assert mode_.seen == [] and mode_.placements == ["aten.scatter_add.default"]


def test_embedding_and_loss_range_checks_do_not_sync_on_a_device(monkeypatch) -> None:
    """On an accelerator the ids' and targets' range checks are device-side asserts: no host sync, and a
    bad id still fails (on CPU tensors the assert raises at once)."""
    from fmoe.ops import cross_entropy, embedding

    monkeypatch.setattr(gl, "HOST_READS_FREE", ())
    table_VD, ids_X = torch.randn(5, 3), torch.tensor([0, 4, 2])
    with count_syncs() as c:
        cross_entropy(embedding(ids_X, table_VD), ids_X.remainder(3))
    assert c.total == 0, c.events
    for bad in (torch.tensor([0, 5]), torch.tensor([-1, 1])):
        with pytest.raises(RuntimeError, match="ids must lie in"):
            embedding(bad, table_VD)
    with pytest.raises(RuntimeError, match="targets must lie in"):
        cross_entropy(torch.randn(2, 3), torch.tensor([0, 3]))
    assert cross_entropy(torch.randn(2, 3), torch.tensor([0, -100]), ignore_index=-100).isfinite()


# ---- the split sizes' read on a device: a side stream, not the compute stream (issue 45, C6) ------------

class _StreamModel:
    """The streams of a device, modelled on CPU: which stream is current, what waits for what. A
    `torch.Stream` is a context manager making it current; `order_stream` (c10d's work.wait()) makes the
    current stream wait for the exchange; an event's `synchronize` blocks the host on its stream."""

    def __init__(self):
        self.current, self.log = "compute", []
        model = self

        class Event:
            def __init__(self, stream: str):
                self.stream = stream

            def synchronize(self) -> None:
                model.log.append(("host waits", self.stream))

        class Side:
            def __enter__(self):
                model.current = "side"

            def __exit__(self, *exc):
                model.current = "compute"

            def record_event(self):
                return Event("side")

        self.side = Side()
        self.Event = Event


def _dispatcher_plan_under_the_stream_model(monkeypatch, kind: str) -> tuple[list, dict]:
    import torch.distributed as dist

    import fmoe.parallel.host_read as hr
    from fmoe.parallel import AllGatherDispatcher, AllToAllDispatcher, CommGroup
    from fmoe.parallel.async_comm import CommHandle

    model = _StreamModel()
    monkeypatch.setattr(hr, "on_host", lambda device: False)
    monkeypatch.setattr(hr, "side_stream", lambda device: model.side)
    monkeypatch.setattr(hr, "pinned_like", torch.empty_like)
    order = CommHandle.order_stream

    def ordered(self):
        model.log.append(("waits the exchange", model.current))
        order(self)

    monkeypatch.setattr(CommHandle, "order_stream", ordered)
    real_tolist = torch.Tensor.tolist

    def tolist(self):  # a read of a device tensor: the host waits for the stream it was made on
        model.log.append(("host reads", model.current))
        return real_tolist(self)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = CommGroup(dist.group.WORLD)
        d = AllToAllDispatcher(comm, 4) if kind == "alltoall" else AllGatherDispatcher(comm, 4)
        counts_E = torch.tensor([2, 0, 3, 1])
        d.start_plan_rows(counts_E, 6).wait() if kind == "alltoall" else d._agree_once(counts_E)
        model.log.clear()  # a first plan (the all-gather's agreement reads on the host once)
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        with count_syncs() as c:
            plan = d.start_plan_rows(counts_E, 6).wait()
        monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
        return model.log, {"counts_L": list(plan.counts_L.host), "syncs": c.by_caller()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["alltoall", "allgather"])
def test_split_sizes_are_read_from_a_side_stream_after_the_count_exchange(monkeypatch, kind) -> None:
    log, got = _dispatcher_plan_under_the_stream_model(monkeypatch, kind)
    # the side stream waits for the count exchange, the sizes are made and copied there, the host waits
    # for that stream's event, then reads host memory; the compute stream is never waited on
    assert log == [("waits the exchange", "side"), ("host waits", "side"), ("host reads", "compute")], log
    assert got["counts_L"] == [2, 0, 3, 1]
    (where,) = got["syncs"]  # the one read: of the pinned host copy
    assert where.startswith("tolist at parallel/host_read.py:"), got


# ---- fp32 and bf16 through torch._grouped_mm on CUDA (issue 45, C5) --------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_automatic_backend_never_takes_a_grouped_mm_that_syncs_per_product(monkeypatch, dtype) -> None:
    """torch._grouped_mm on CUDA (sm90) modelled on CPU tensors: its own kernel for bf16, and for every other
    dtype its fallback, which copies the offsets to the host at every call (`offs.cpu()`, counted). The
    automatic choice must not take that path: the block's fp32 forward then reads the counts once (the loop
    backend, one read for all its products), not once per product (9 with grouped_mm), and bf16 none."""
    real = gl.grouped_mm

    def cuda_grouped_mm(a, b, *, offs):  # sm90's: a host read of the offsets outside bf16
        if a.dtype != torch.bfloat16:
            offs.cpu()
        return real(a, b, offs=offs)

    monkeypatch.setattr(gl, "HOST_READS_FREE", ())  # the accelerator path
    monkeypatch.setattr(gl, "grouped_mm", cuda_grouped_mm)
    monkeypatch.setattr(gl, "grouped_mm_syncs", lambda dt, device: dt != torch.bfloat16,  # sm90 CUDA's rule
                        raising=False)
    gl._backend_choice.cache_clear()
    try:
        cfg, params, x = _tiny()
        params = torch.utils._pytree.tree_map(lambda t: t.to(dtype), params)
        block_syncs(params, x.to(dtype), cfg)
        got = block_syncs(params, x.to(dtype), cfg)
    finally:
        gl._backend_choice.cache_clear()
    most = 1 if dtype == torch.float32 else 0
    assert got["forward"] <= most and got["dx"] == got["dw"] == 0, got
