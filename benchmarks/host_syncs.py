"""Host syncs per MoE layer per microbatch on the tiny preset (fmoe/sync_count.py counts them on CPU).

    .venv/bin/python benchmarks/host_syncs.py          # a table: forward / dx / dw per path

Rows: the layer function `fmoe.moe` under plain autograd; the block under split_vjp (forward, dx pass,
deferred dw pass); on 2 gloo ranks (ep 2, 4 local experts each) the block with the synchronous
all-to-all and all-gather dispatchers, and the block run as the pipeline runs it (its phases,
fmoe.phases.moe_layer, through the executor: F, then I with the transposed exchanges, then W). "cpu" is
the code path CPU tensors take (where the host is the device, reading counts costs nothing and fmoe
does); "device" forces the accelerator path on CPU tensors (fmoe.ops._grouped_linear.HOST_READS_FREE
emptied; on code without it, the grouped-GEMM offsets uncached, as a device builds them). Each count
is taken after one warm-up run (first-call probes and caches excluded).

Legend (docs/moe.md): B sequences, S positions, D width, E experts, L local experts.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fmoe.block import init_block  # noqa: E402
from fmoe.parallel.local_ranks import failures, run_ranks  # noqa: E402
from fmoe.sync_count import block_syncs, moe_syncs, phased_block_syncs  # noqa: E402
from fmoe.train.config import TrainConfig  # noqa: E402


@contextlib.contextmanager
def device_path(on: bool) -> Iterator[None]:
    """Run fmoe's accelerator code path on CPU tensors when `on` (module docstring)."""
    import fmoe.ops._grouped_linear as gl

    if not on:
        yield
        return
    if hasattr(gl, "HOST_READS_FREE"):
        old, gl.HOST_READS_FREE = gl.HOST_READS_FREE, ()
        try:
            yield
        finally:
            gl.HOST_READS_FREE = old
    else:  # the code before HOST_READS_FREE: a device uploads the offsets at every product
        old = gl._cpu_offsets
        gl._cpu_offsets = old.__wrapped__
        try:
            yield
        finally:
            gl._cpu_offsets = old


def setup(rank: int = 0, world: int = 1) -> tuple:
    """The tiny preset's block (routed experts of this rank only) and one microbatch."""
    tc = TrainConfig.from_sources("tiny", None, {})
    cfg = tc.model()
    params = init_block(cfg, torch.Generator().manual_seed(0))
    L = cfg.moe.num_experts // world
    experts = params["moe"]["experts"]
    params["moe"]["experts"] = {k: v[rank * L:(rank + 1) * L].clone() for k, v in experts.items()}
    x_BSD = torch.randn(tc.micro_batch_size, tc.seq_length, cfg.d_model,
                        generator=torch.Generator().manual_seed(1 + rank))
    return cfg, params, x_BSD


def measure(fn, *args) -> dict:
    """fn(*args) twice (the first warms up); the second's counts."""
    fn(*args)
    return fn(*args)


def single_rank() -> dict[str, dict]:
    """{row name: counts} on one process."""
    cfg, params, x = setup()
    out = {}
    for dev in (False, True):
        tag = "device" if dev else "cpu"
        with device_path(dev):
            x_TD = x.reshape(-1, cfg.d_model)
            out[f"moe() autograd, 1 rank, {tag}"] = measure(moe_syncs, params["moe"], x_TD, cfg.moe)
            out[f"block split_vjp, 1 rank, {tag}"] = measure(block_syncs, params, x, cfg)
    return out


def _rank(rank: int, world: int) -> dict[str, dict]:
    from fmoe.parallel import AllGatherDispatcher, AllToAllDispatcher, CommGroup

    cfg, params, x = setup(rank, world)
    comm = CommGroup(dist.group.WORLD)
    out = {}
    for dev in (False, True):
        tag = "device" if dev else "cpu"
        with device_path(dev):
            for name, d in (("alltoall", AllToAllDispatcher(comm, cfg.moe.num_experts)),
                            ("allgather", AllGatherDispatcher(comm, cfg.moe.num_experts))):
                out[f"block split_vjp, ep2 {name}, {tag}"] = measure(block_syncs, params, x, cfg, d)
                out[f"phased (pipeline), ep2 {name}, {tag}"] = measure(phased_block_syncs, params, x, cfg, d)
    return out


def two_ranks(timeout_s: float = 300.0) -> dict[str, dict]:
    """{row name: counts} of rank 0 on 2 gloo ranks (ranks agree on the counts' kinds)."""
    results = run_ranks(_rank, 2, timeout_s=timeout_s, pg_timeout_s=60, stop_on_error=True)
    if failures(results):
        raise RuntimeError(failures(results))
    return results[0].value


def main() -> None:
    rows = {**single_rank(), **two_ranks()}
    print(f"{'path':48s} {'forward':>7s} {'dx':>4s} {'dw':>4s}")
    for name, r in rows.items():
        dx = r.get("dx", r.get("backward"))
        dw = r.get("dw", "-")
        print(f"{name:48s} {r['forward']:>7} {dx:>4} {dw:>4}")
    if "-v" in sys.argv:
        for name, r in rows.items():
            print(name, r["where"])


if __name__ == "__main__":
    main()
