"""The `local` cluster: this machine, calibrated from fmoe's own measured costs and gloo collective times.

A device is a CPU process with one thread (as `fmoe train` splits the cores between its ranks); a node
is the machine (its cores). Measured, in this order, and cached in `$FMOE_LOCAL_CLUSTER` (default
~/.cache/fmoe/local-cluster.json, keyed by torch version and core count; delete it to measure again):
- GEMM FLOP/s of a 512^3 fp32 matmul (the peak; gemm_eff 1) and of a 32 x 64 x 64 one (gemm_half_dim);
- the causal attention kernel's FLOP/s at a small shape (attn_eff);
- AdamW's bytes per second over 2M fp32 parameters (hbm_bytes_per_s, 28 bytes per parameter);
- the latency and bandwidth of a gloo send between two processes (ping-pong at 8 B and 4 MiB; one
  machine: intra = inter), and a tiny all-to-all's cost beyond that latency (comm_overhead_s);
- op_overhead_s and base_mem_gib: `fmoe train`'s `tiny` preset through the executor on one process (1
  thread), minus what the planner predicts for it with no overhead, per layer and phase.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fmoe.plan.specs import ClusterSpec


def _cache_path() -> Path:
    return Path(os.environ.get("FMOE_LOCAL_CLUSTER", Path.home() / ".cache" / "fmoe" / "local-cluster.json"))


def _key() -> str:
    return f"torch {torch.__version__}, {os.cpu_count()} cores"


def local_cluster(recalibrate: bool = False) -> ClusterSpec:
    """Returns this machine's ClusterSpec, from the cache or (first use, or `recalibrate`) measured now
    (about half a minute)."""
    path = _cache_path()
    if not recalibrate and path.is_file():
        data = json.loads(path.read_text())
        if data.get("key") == _key():
            return ClusterSpec(**data["spec"])
    spec = calibrate()
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = {k: getattr(spec, k) for k in spec.__dataclass_fields__}
    path.write_text(json.dumps({"key": _key(), "spec": fields}, indent=1))
    return spec


def _median_s(fn: Callable[[], Any], reps: int = 15, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_rates() -> tuple[float, int]:
    big = [torch.randn(512, 512) for _ in range(2)]
    rate = 2 * 512**3 / _median_s(lambda: big[0] @ big[1])
    small = [torch.randn(32, 64), torch.randn(64, 64)]
    small_rate = 2 * 32 * 64 * 64 / _median_s(lambda: small[0] @ small[1], reps=200)
    eff = min(small_rate / rate, 0.999)
    return rate, max(1, int(64 * (1 / eff - 1)))  # eff(64) = 64 / (64 + half)


def _attention_rate(peak: float) -> float:
    q, k, v = (torch.randn(4, 4, 128, 32) for _ in range(3))
    t = _median_s(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    flops = 4 * 4 * 2 * 2 * 128 * 32 * 128 / 2  # B H (QK + PV), causal half
    return min(1.0, flops / t / peak)


def _adamw_bytes_per_s() -> float:
    p = [torch.nn.Parameter(torch.randn(2**21))]
    p[0].grad = torch.randn(2**21)
    opt = torch.optim.AdamW(p, foreach=True)
    return 28 * 2**21 / _median_s(opt.step, reps=10)


def _link_worker(rank: int, store: str, q: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    import fmoe.train.loop  # noqa: F401  (a rank's resident set includes the training code)

    out = {}
    for n in (1, 2**20):  # fp32 elements: 4 B and 4 MiB
        x = torch.zeros(n)
        reps = 50 if n == 1 else 10
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
        out[n] = (time.perf_counter() - t0) / (2 * reps)  # one way
    x = torch.zeros(2)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        dist.all_to_all_single(x, x.clone())
    out["a2a"] = (time.perf_counter() - t0) / 50
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put((out, rss_kib))


def _links() -> tuple[float, float, float]:
    """(latency s, bytes/s, extra seconds per collective call) between two spawned gloo processes: the
    one-way time of a 4-byte send, the bandwidth of a 4 MiB one, and what a tiny all-to-all costs beyond
    that latency (its host-side overhead)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = tempfile.mktemp(prefix="fmoe_plan_")
    procs = [ctx.Process(target=_link_worker, args=(r, store, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    out, rss_kib = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    latency = out[1]
    bandwidth = 4 * 2**20 / max(out[2**20] - latency, 1e-9)
    return latency, bandwidth, max(0.0, out["a2a"] - latency)


CALIBRATION_RUN = {"pp": 1, "ep": 1, "dp": 1, "schedule": "1f1b", "progress": False}  # tiny, one process


def _tiny_worker(store: str, q: Any) -> None:
    torch.set_num_threads(1)
    from fmoe.train.config import TrainConfig
    from fmoe.train.launch import _world
    from fmoe.train.loop import Trainer

    tc = TrainConfig.from_sources("tiny", None, CALIBRATION_RUN)
    trainer = Trainer(tc, _world(tc, 0, f"file://{store}", 0, 1))
    step_s = _median_s(trainer.step, reps=7, warm=2)
    with open("/proc/self/status") as f:
        hwm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    q.put((step_s, hwm_kib / 2**20))


def _tiny_run() -> tuple[float, float]:
    """(median step seconds, peak resident GiB) of `fmoe train`'s tiny preset through the executor on one
    process with one thread (CALIBRATION_RUN), run as one independent copy per core at once: a device of
    a job that fills the machine shares its memory bandwidth, caches and the host with the others."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_tiny_worker, args=(tempfile.mktemp(prefix="fmoe_plan_"), q), daemon=True)
        for _ in range(os.cpu_count() or 1)
    ]
    for p in procs:
        p.start()
    outs = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return statistics.median(o[0] for o in outs), max(o[1] for o in outs)


def calibrate() -> ClusterSpec:
    """Measures this machine (see the module docstring) and returns its ClusterSpec."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak, half = _gemm_rates()
        attn_eff = _attention_rate(peak)
        hbm = _adamw_bytes_per_s()
    finally:
        torch.set_num_threads(threads)
    latency, bandwidth, per_call = _links()
    cores = os.cpu_count() or 1
    with open("/proc/meminfo") as f:
        total_gib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal")) / 2**20
    spec = ClusterSpec(
        name="local",
        devices_per_node=cores,
        peak_flops={"fp32": peak},
        mem_gib=total_gib / cores,
        intra_bytes_per_s=bandwidth,
        inter_bytes_per_s=bandwidth,
        intra_latency_s=latency,
        inter_latency_s=latency,
        gemm_eff=1.0,
        attn_eff=attn_eff,
        gemm_half_dim=half,
        hbm_bytes_per_s=hbm,
        op_overhead_s=0.0,
        comm_overhead_s=per_call,
        base_mem_gib=0.0,
    )
    step_s, peak_gib = _tiny_run()
    return _fit(spec, step_s, peak_gib)


def _fit(spec: ClusterSpec, measured_s: float, peak_gib: float) -> ClusterSpec:
    """Returns `spec` with the per-layer-and-phase host overhead that makes the planner's prediction of
    CALIBRATION_RUN equal the measured step (the prediction is linear in it), and the process memory
    beyond what the planner counts for that run as base_mem_gib."""
    from fmoe.plan.estimate import Context, evaluate
    from fmoe.plan.layout import Layout
    from fmoe.plan.specs import load_model
    from fmoe.train.config import TrainConfig

    tc = TrainConfig.from_sources("tiny", None, CALIBRATION_RUN)
    model = load_model("tiny")
    lay = Layout(
        tp=1, pp=1, ep=1, dp=1, vpp=1, schedule="1f1b", overlap=False, micro_batch=tc.micro_batch_size
    )
    p0 = evaluate(Context(model, spec, 1, tc.global_batch_size), lay)
    t1 = evaluate(Context(model, spec.replace(op_overhead_s=1e-3), 1, tc.global_batch_size), lay).step_s
    overhead = max(0.0, (measured_s - p0.step_s) / (t1 - p0.step_s) * 1e-3)
    return spec.replace(op_overhead_s=overhead, base_mem_gib=max(0.0, peak_gib - p0.mem_gib))
