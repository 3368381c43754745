"""The device check's parts for the MoE layer at the device's rate (issue 45; run by
benchmarks/device_check.py, which imports them: `--parts grouped,syncs,exec1,gloo_ep2` then
`--parts profile,glue,ceiling,train_big`: two runs of at most 330 s, which fit 15 minutes of device time
with the machine's start):
- grouped: fmoe's Grouped fwd / dx / dw / dw_into and torch._grouped_mm's own autograd in bf16 and fp32
  against float64 on the CPU, on uneven, empty-expert, one-row and no-row counts; an empty expert's dw
  exactly 0 on both paths; no CUDA sync-debug warning per bf16 product;
- exec1: `fmoe train --pp 1 --ep 1` fp32 (TF32 off) through accumulate and through the executor (1f1b:
  split_vjp, deferred dw): losses within 1e-5;
- gloo_ep2: two processes on the one device over gloo (NCCL refuses two ranks on one device), ep 2, fp32,
  3 steps against the same two ranks on the CPU: losses within 1e-4;
- profile: device time per kernel class of the bf16 MoE layer, plain autograd and split_vjp, and the
  device's idle share of the wall time;
- glue: ms of router, layout, permute / unpermute forward + backward, swiglu at the bench shape;
- ceiling: the expert products through torch._grouped_mm (balanced and router counts) in TFLOP/s against
  a dense mm of the same FLOPs: the grouped kernel's own ceiling;
- train_big: `fmoe train` on a wider model (D 1024, 8 layers, 16 experts) in bf16: accumulate and 1f1b
  tokens/s.
Device_check's `syncs` part takes `block_sync_warnings` and `a2a_sync_warnings` from here. On the CPU
(the dry run) the shapes are small and the device-only checks are left out.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from _device import _leaves, _median_s, _rel, _sync, _to


def _event_s(fn: Callable[[], Any], dev: torch.device, iters: int = 10, warm: int = 3) -> float:
    """Median seconds of fn(): CUDA events around it on a GPU (no host sync between calls), the host
    clock with the device synchronised elsewhere (device_check's `_median_s`)."""
    if dev.type != "cuda":
        return _median_s(fn, dev, warm, iters)
    for _ in range(warm):
        fn()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


class SyncWarnings:
    """CUDA sync-debug warnings raised inside the block, each with the innermost fmoe frame (file:line)."""

    def __init__(self, dev: torch.device):
        self.dev, self.where = dev, []

    def __enter__(self):
        if self.dev.type != "cuda":
            return self
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("always")
        self._old = warnings.showwarning

        def hook(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1] if "/fmoe/" in f.filename
                      or "/transforms/" in f.filename or "/schedule/" in f.filename]
            f = frames[-1] if frames else None
            self.where.append(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}" if f else "?")

        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.dev.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = self._old
            self._cm.__exit__(*exc)
        return False

    @property
    def n(self) -> int:
        return len(self.where)

    def by_line(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for w in self.where:
            out[w] += 1
        return dict(out)


# ---- grouped ------------------------------------------------------------------------------------------

def part_grouped(dev: torch.device, out: str) -> dict:
    from fmoe._compat import grouped_mm
    from fmoe.ops import _grouped_linear as gl

    torch.backends.cuda.matmul.allow_tf32 = False
    # no_rows last and bf16 last: a device-side assert there kills the process, not the cases before it
    cases = {"uneven": [3, 0, 17, 1, 9, 0, 33, 5], "one_row": [0, 0, 1, 0, 0, 0, 0, 0],
             "skew": [300, 0, 5, 0, 0, 7, 0, 12], "no_rows": [0] * 8}
    D, F = 64, 48
    g = torch.Generator().manual_seed(0)
    figures, checks = {}, {}
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        dn = str(dtype).split(".")[-1]
        for name, counts in cases.items():
            M, E = sum(counts), len(counts)
            x = torch.randn(M, D, generator=g, dtype=torch.float64)
            w = torch.randn(E, D, F, generator=g, dtype=torch.float64) / 8
            ct = torch.randn(M, F, generator=g, dtype=torch.float64)
            ref = gl.Grouped(gl.Counts(tuple(counts)), "loop")
            want = (ref.fwd(x, w), ref.dx(ct, w), ref.dw(x, ct))
            xd, wd, cd = (t.to(dev, dtype) for t in (x, w, ct))
            prod = gl.Grouped(gl.Counts(None, torch.tensor(counts, device=dev)), "grouped_mm")
            with SyncWarnings(dev) as sw:
                got = (prod.fwd(xd, wd), prod.dx(cd, wd), prod.dw(xd, cd))
                into = prod.dw_into(torch.zeros(E, D, F, device=dev, dtype=dtype), xd, cd)
            _sync(dev)  # outside: torch.cuda.synchronize() itself counts as a sync in debug mode
            errs = [_rel(a, b) for a, b in zip(got, want)] + [_rel(into, want[2])]
            empty = [e for e, c in enumerate(counts) if c == 0]
            zero = all(bool((got[2][e] == 0).all()) and bool((into[e] == 0).all()) for e in empty)
            # torch's own autograd of _grouped_mm (the plain path fmoe takes outside split_vjp)
            xa, wa = xd.clone().requires_grad_(), wd.clone().requires_grad_()
            offs = torch.cumsum(torch.tensor(counts, device=dev), 0, dtype=torch.int32)
            if M:
                (grouped_mm(xa, wa, offs=offs) * cd).sum().backward()
                errs += [_rel(xa.grad, want[1]), _rel(wa.grad, want[2])]
                zero = zero and all(bool((wa.grad[e] == 0).all()) for e in empty)
            key = f"{dn}_{name}"
            figures[key] = {"max_rel_err": max(errs), "sync_warnings": sw.n}
            checks[f"{key}_values"] = {"ok": max(errs) <= tol, "why": f"max rel err {max(errs):.2e}"}
            checks[f"{key}_empty_dw_zero"] = {"ok": zero, "why": f"empty experts {empty}"}
            if dev.type == "cuda" and dtype == torch.bfloat16:
                checks[f"{key}_no_sync"] = {"ok": sw.n == 0, "why": f"{sw.n} sync warnings {sw.by_line()}"}
            _partial(out, "grouped", figures, checks)  # what ran so far survives a crash of the next case
    return {"figures": figures, "checks": checks}


def _partial(out: str, name: str, figures: dict, checks: dict) -> None:
    """Writes what part `name` found so far (OUT/<name>.partial.json), for the driver to keep if it dies."""
    with open(os.path.join(out, f"{name}.partial.json"), "w") as f:
        json.dump({"figures": figures, "checks": checks}, f, indent=1, default=str)


# ---- fmoe train runs --------------------------------------------------------------------------------------

def _train(dev: torch.device, out: str, name: str, flags: list[str]) -> tuple[list[float], dict]:
    metrics = os.path.join(out, f"train_{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    # 512 sequences of the Markov corpus: more than any run here reads, drawn in a fraction of the default's
    cmd = [sys.executable, "-m", "fmoe.cli.main", "train", "--no-progress", "--device", dev.type,
           "--markov-sequences", "512", "--metrics", metrics, *flags]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=140)
    fig = {"s": round(time.perf_counter() - t, 1)}
    if proc.returncode != 0:
        fig["error"] = (proc.stderr or proc.stdout)[-1500:]
        return [], fig
    rows = [json.loads(line) for line in open(metrics)]
    tok = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    fig["tokens_per_s"] = statistics.median(tok[2:] or tok) if tok else None
    return [r["loss"] for r in rows if "loss" in r], fig


def part_exec1(dev: torch.device, out: str) -> dict:
    base = ["--pp", "1", "--ep", "1", "--steps", "4", "--global-batch-size", "8", "--micro-batch-size", "4",
            "--seq-length", "64"]
    prec = ["--no-bf16", "--no-tf32"] if dev.type == "cuda" else []
    losses, figures = {}, {}
    for sch in ("accumulate", "1f1b"):
        losses[sch], figures[sch] = _train(dev, out, f"exec1_{sch}", [*base, *prec, "--schedule", sch])
    a, b = losses["accumulate"], losses["1f1b"]
    diff = max((abs(x - y) / abs(y) for x, y in zip(a, b)), default=float("inf"))
    figures["losses"] = losses
    ok = len(a) == len(b) == 4 and diff <= 1e-5
    checks = {"executor_equals_accumulate": {"ok": ok, "why": f"max rel {diff:.2e}"}}
    return {"figures": figures, "checks": checks}


def part_train_big(dev: torch.device, out: str) -> dict:
    model = ["--num-layers", "8", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
             "--moe-ffn-hidden-size", "704", "--num-experts", "16", "--moe-router-topk", "4",
             "--num-attention-heads", "8"] if dev.type != "cpu" else []
    steps = "8" if dev.type != "cpu" else "2"  # the CPU dry run: that both paths run
    base = ["--pp", "1", "--ep", "1", "--steps", steps, "--global-batch-size", "16",
            "--micro-batch-size", "4", "--seq-length", "1024" if dev.type != "cpu" else "64", *model]
    figures = {}
    # the CPU dry run: one of the two (each is a whole fmoe train start-up; both paths run elsewhere in tests)
    for sch in ("accumulate", "1f1b") if dev.type != "cpu" else ("1f1b",):
        _, figures[sch] = _train(dev, out, f"big_{sch}", [*base, "--schedule", sch])
    ok = all("error" not in f for f in figures.values())
    return {"figures": figures, "checks": {"both_ran": {"ok": ok, "why": json.dumps(figures)[:300]}}}


# ---- gloo_ep2: two ranks on one device ------------------------------------------------------------------

def _ep2_rank(rank: int, store: str, device: str, q: Any) -> None:
    import torch.distributed as dist

    from fmoe.parallel import ParallelLayout, Topology
    from fmoe.train.config import TrainConfig
    from fmoe.train.loop import Trainer, World

    try:
        torch.set_num_threads(2)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            torch.backends.cuda.matmul.allow_tf32 = False
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        tc = TrainConfig.from_sources("tiny", None, {
            "pp": 1, "ep": 2, "dp": 1, "steps": 3, "progress": False, "global_batch_size": 8,
            "micro_batch_size": 2, "seq_length": 32, "keep_host_memory": False, "bf16": False,
            "markov_sequences": 512})
        par = ParallelLayout(pp=1, ep=2, dp=1, topology=Topology(2, 2), device_type=dev.type)
        tr = Trainer(tc, World(rank, 2, par, dev))
        losses = [tr.step()["loss"] for _ in range(3)]
        q.put((rank, losses, None))
    except Exception:
        q.put((rank, None, traceback.format_exc()[-1500:]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ep2(device: str) -> tuple[list | None, str | None]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = tempfile.mktemp(prefix="fmoe_dp_ep2_")
    ps = [ctx.Process(target=_ep2_rank, args=(r, store, device, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = [q.get(timeout=130) for _ in ps]
    for p in ps:
        p.join(10)
    errs = [e for _, _, e in got if e]
    return (sorted(got)[0][1], None) if not errs else (None, errs[0])


def part_gloo_ep2(dev: torch.device) -> dict:
    ref, err_ref = _ep2("cpu")
    got, err = _ep2(str(dev)) if dev.type == "cuda" else (ref, err_ref)
    figures = {"cpu": ref, "device": got, "errors": [e for e in (err_ref, err) if e]}
    ok = ref is not None and got is not None and max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= 1e-4
    checks = {"ep2_on_one_device_matches_cpu": {"ok": ok, "why": str(figures)[:400]}}
    return {"figures": figures, "checks": checks}


# ---- performance -------------------------------------------------------------------------------------------

def _shape(dev: torch.device) -> tuple[int, int, int, int, int]:
    """(T, D, F, E, K): device_check's bench shape on a device, a small one for the CPU dry run."""
    return (512, 256, 128, 8, 2) if dev.type == "cpu" else (8192, 2048, 1024, 64, 8)


def _moe_setup(dev: torch.device):
    import fmoe

    T, D, F, E, K = _shape(dev)
    cfg = fmoe.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)
    params = _to(fmoe.init_moe(cfg, torch.Generator().manual_seed(0)), dev, torch.bfloat16)
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    return fmoe, cfg, params, x


def part_profile(dev: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from fmoe.transforms import split_vjp

    fmoe, cfg, params, x = _moe_setup(dev)
    leaves = [t.requires_grad_() for t in _leaves(params)]
    xg = x.clone().requires_grad_()

    def plain():
        y, aux = fmoe.moe(params, xg, cfg, check=False)
        torch.autograd.grad((y.float().sum() + aux.loss,), [xg, *leaves], allow_unused=True)

    plain_params = {k: {n: t.detach() for n, t in v.items()} for k, v in params.items()}

    def tape():
        y, vjp_dx = split_vjp(lambda p, a: fmoe.moe(p, a, cfg, check=False)[0], plain_params, x,
                              engine="autograd")
        _, vjp_dw = vjp_dx(torch.ones_like(y))
        vjp_dw()

    figures = {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for name, fn in (("plain", plain), ("tape", tape)):
        for _ in range(3):
            fn()
        _sync(dev)
        wall = _event_s(fn, dev, iters=5, warm=1)
        with profile(activities=acts) as prof:
            for _ in range(3):
                fn()
            _sync(dev)
        kern = defaultdict(float)
        spans = []
        try:
            for e in prof.events():
                if dev.type == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA:
                    kern[_kclass(e.name)] += e.device_time_total / 3 / 1e3  # ms per iteration
                    spans.append((e.time_range.start, e.time_range.end))
        except Exception as exc:  # a profiler API that moved: keep the wall time
            kern["error"] = repr(exc)[:200]
        busy = _merged(spans) / 3 / 1e3
        figures[name] = {"wall_ms": 1e3 * wall, "device_busy_ms": busy,
                         "idle_share": (1 - busy / (1e3 * wall)) if wall and busy else None,
                         "by_class_ms": dict(sorted(kern.items(), key=lambda kv: -kv[1])),
                         "top": [(a.key[:90], round(a.device_time_total / 3 / 1e3, 3))
                                 for a in sorted(prof.key_averages(),
                                                 key=lambda a: -a.device_time_total)[:15]]
                         if dev.type == "cuda" else []}
    return {"figures": figures, "checks": {}}


def _kclass(name: str) -> str:
    n = name.lower()
    for key, cls in (("grouped", "grouped_gemm"), ("cutlass", "grouped_gemm"), ("gemm", "gemm"),
                     ("sm90", "gemm"), ("nvjet", "gemm"), ("index", "gather/index"),
                     ("gather", "gather/index"), ("scatter", "scatter"),
                     ("sort", "sort"), ("radix", "sort"), ("reduce", "reduction"), ("copy", "copy/cast"),
                     ("memcpy", "memcpy"), ("memset", "memset"), ("elementwise", "elementwise"),
                     ("softmax", "softmax"), ("silu", "elementwise")):
        if key in n:
            return cls
    return "other"


def _merged(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -1.0
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def part_glue(dev: torch.device) -> dict:
    from fmoe.ops import permute, sort_layout, swiglu, unpermute
    from fmoe.router import route

    fmoe, cfg, params, x = _moe_setup(dev)
    T, D, F, E, K = _shape(dev)
    r = route(params["router"], x, cfg, check=False)
    layout = sort_layout(r.ids_TK, E, r.counts_E)
    xr = x.clone().requires_grad_()
    y_rows = torch.randn(T * K, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    probs = r.probs_TK.detach().clone().requires_grad_()
    g = torch.randn(T * K, F, device=dev, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(T * K, F, device=dev, dtype=torch.bfloat16, requires_grad=True)
    ct_rows, ct_tok, ct_f = torch.randn_like(y_rows), torch.randn_like(x), torch.randn_like(g)

    def _fwd_bwd(f, ins, ct):
        def run():
            out = f()
            torch.autograd.grad(out, ins, ct)
        return run

    pieces = {
        "router_fwd": lambda: route(params["router"], x, cfg, check=False),
        "layout": lambda: sort_layout(r.ids_TK, E, r.counts_E),
        "permute_fwd_bwd": _fwd_bwd(lambda: permute(xr, layout), [xr], ct_rows),
        "unpermute_fwd_bwd": _fwd_bwd(lambda: unpermute(y_rows, probs, layout), [y_rows, probs], ct_tok),
        "swiglu_fwd_bwd": _fwd_bwd(lambda: swiglu(g, u), [g, u], ct_f),
    }
    figures = {}
    for name, fn in pieces.items():
        figures[name] = {"ms": 1e3 * _event_s(fn, dev)}
    return {"figures": figures, "checks": {}}


def part_ceiling(dev: torch.device) -> dict:
    from fmoe._compat import grouped_mm
    from fmoe.router import route

    fmoe, cfg, params, x = _moe_setup(dev)
    T, D, F, E, K = _shape(dev)
    M = T * K
    skew = route(params["router"], x, cfg, check=False).counts_E
    bal = torch.full((E,), M // E, device=dev, dtype=torch.int64)
    a_MD = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
    a_MF = torch.randn(M, F, device=dev, dtype=torch.bfloat16)
    w_EDF = torch.randn(E, D, F, device=dev, dtype=torch.bfloat16)
    w_EFD = torch.randn(E, F, D, device=dev, dtype=torch.bfloat16)
    flops = 2 * M * D * F
    figures = {}
    for label, counts in (("balanced", bal), ("router", skew)):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        prods = {"fwd_DF": lambda o=offs: grouped_mm(a_MD, w_EDF, offs=o),
                 "fwd_FD": lambda o=offs: grouped_mm(a_MF, w_EFD, offs=o),
                 "dx_F_to_D": lambda o=offs: grouped_mm(a_MF, w_EDF.transpose(-2, -1), offs=o),
                 "dw_DF": lambda o=offs: grouped_mm(a_MD.t(), a_MF, offs=o)}
        figures[label] = {k: flops / _event_s(f, dev) / 1e12 for k, f in prods.items()}
        figures[label]["max_over_mean"] = float(counts.max()) / float(counts.double().mean())
    b = torch.randn(D, F, device=dev, dtype=torch.bfloat16)
    figures["dense_mm_TFLOPs"] = flops / _event_s(lambda: a_MD @ b, dev) / 1e12
    return {"figures": figures, "checks": {}}


# ---- syncs (device_check's part_syncs takes these) -------------------------------------------------------

def block_sync_warnings(dev: torch.device, dtype: torch.dtype, backend: str | None) -> tuple[int, dict, dict]:
    """CUDA sync-debug warnings of the tiny MoE block's forward, dx and dw (`block_syncs`) in `dtype`
    through grouped-linear `backend` (None: automatic): (count, by fmoe line, fmoe's own counter)."""
    import dataclasses

    from fmoe.block import init_block
    from fmoe.sync_count import block_syncs
    from fmoe.train.config import TrainConfig

    gcfg = TrainConfig.from_sources("tiny", None, {}).model()
    if backend is not None:
        gcfg = dataclasses.replace(gcfg, moe=dataclasses.replace(gcfg.moe, backend=backend))
    params = _to(init_block(gcfg, torch.Generator().manual_seed(0)), dev, dtype)
    x = torch.randn(4, 64, gcfg.d_model, device=dev, dtype=dtype)
    block_syncs(params, x, gcfg)  # warm-up (probes, caches)
    with SyncWarnings(dev) as sw:
        counted = block_syncs(params, x, gcfg)
    _sync(dev)
    return sw.n, sw.by_line(), {k: v for k, v in counted.items() if k != "where"}


def a2a_sync_warnings(dev: torch.device) -> dict:
    """CUDA sync-debug warnings of a 1-rank all-to-all plan (its split sizes read from a side stream,
    fmoe/parallel/host_read.py) and of its `row_chunks(plan, 2)` (one non-blocking upload)."""
    import torch.distributed as dist

    from fmoe.parallel import AllToAllDispatcher, CommGroup
    from fmoe.parallel.alltoall import row_chunks

    backend = {"cuda": "nccl", "npu": "hccl"}.get(dev.type, "gloo")
    store = tempfile.mktemp(prefix="fmoe_dc_")
    kw = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, **kw)
    try:
        disp = AllToAllDispatcher(CommGroup(dist.group.WORLD), 8)
        counts = torch.tensor([5, 0, 3, 9, 1, 0, 2, 4], device=dev)
        rows = int(counts.sum())
        disp.start_plan_rows(counts, rows).wait()  # warm: NCCL's first exchange sets up its communicator
        _sync(dev)
        with SyncWarnings(dev) as plan_w:
            plan = disp.start_plan_rows(counts, rows).wait()
        _sync(dev)
        with SyncWarnings(dev) as chunks_w:
            row_chunks(plan, 2, dev)
        _sync(dev)
    finally:
        dist.destroy_process_group()
    return {"plan": (plan_w.n, plan_w.by_line()), "row_chunks": (chunks_w.n, chunks_w.by_line())}
