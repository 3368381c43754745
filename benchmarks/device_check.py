"""The device check: what only an accelerator can show, in one run of under 8 minutes on one GPU or NPU.

    python benchmarks/device_check.py --out device_check_out     # every part; figures in OUT/
    python benchmarks/device_check.py --parts ops,optim           # some of them
    python benchmarks/device_check.py --device cpu                # a dry run on CPU (what CI can do)

Each part runs in a process of its own under a timeout, so a part that crashes its device context or hangs
costs only itself; the run keeps to `--budget-s`. Parts:
- env: torch, its device build, the device, fmoe's grouped-GEMM backends for fp32 and bf16;
- ops: each fmoe op (linear, rms_norm, swiglu, attention, embedding, cross_entropy, the MoE layer) on the
  device in fp32 (TF32 off) against float64 on the CPU, output and every gradient; the MoE layer in bf16
  too (loose tolerance);
- optim: fmoe train's AdamW (fused on a device) for three steps against the same optimizer on the CPU;
- comm: a 1-rank NCCL / HCCL group: fmoe's async all-to-all, all-gather, reduce-scatter and all-reduce,
  and that a wait leaves the host free (the host returns from wait() while the device is still busy);
- syncs: host syncs of one MoE block's forward, dx and dw passes on the device (fmoe.sync_count), and
  CUDA's own sync debug mode's warnings by fmoe line: the block in bf16 (none), fp32 (automatic: the
  loop backend on CUDA, grouped_mm's fallback syncing per product; at most 1) and fp32 through the loop
  backend (at most 1), a 1-rank all-to-all plan (at most 1) and its row chunks (none);
- bench: the bf16 MoE layer's forward + backward TFLOP/s against a dense bf16 matmul of the same FLOPs in
  the same run (medians of timed iterations);
- train: `fmoe train` on one device for a few steps in fp32 (TF32 off) against the same run on the CPU
  (per-step losses), and a bf16-mixed run (the device default) for tokens/s.
and the MoE layer's parts of benchmarks/device_parts.py (not in the default run; name them in --parts):
grouped, exec1, gloo_ep2, profile, glue, ceiling, train_big.
Writes OUT/device_check.json (every part's figures and checks) and OUT/summary.txt; exit code 1 when a
check failed or a part did not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _device import _leaves, _median_s, _rel, _sync, _to, pick_device  # noqa: E402  (after the path)

PARTS = ("env", "ops", "optim", "comm", "syncs", "bench", "compile", "train")
# the MoE layer's parts (issue 45), in benchmarks/device_parts.py: the default run leaves them out (two
# runs of their own: grouped,syncs,exec1,gloo_ep2 then profile,glue,ceiling,train_big)
LAYER_PARTS = ("grouped", "exec1", "gloo_ep2", "profile", "glue", "ceiling", "train_big")
TIMEOUT_S = {"env": 60, "ops": 90, "optim": 60, "comm": 90, "syncs": 90, "bench": 120, "compile": 240,
             "train": 200,
             "grouped": 60, "exec1": 150, "gloo_ep2": 150, "profile": 120, "glue": 60, "ceiling": 60,
             "train_big": 150}


# ---- parts -------------------------------------------------------------------------------------------

def part_env(dev: torch.device) -> dict:
    from fmoe.ops import available_backends

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(dev),
           "backends_fp32": available_backends(torch.float32, dev),
           "backends_bf16": available_backends(torch.bfloat16, dev)}
    if dev.type == "cuda":
        out["name"] = torch.cuda.get_device_name(dev)
        out["capability"] = list(torch.cuda.get_device_capability(dev))
        out["memory_gib"] = torch.cuda.get_device_properties(dev).total_memory / 2 ** 30
    return {"figures": out, "checks": {}}


def _op_cases(g: torch.Generator) -> dict[str, tuple[Callable[..., Any], tuple, float]]:
    """name -> (fn(*args) -> tensor or tuple, float64 CPU args, tolerance of fp32 against fp64)."""
    import fmoe
    from fmoe import ops

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    cfg = fmoe.MoEConfig(d_model=64, d_ff=32, num_experts=8, top_k=2)
    moe_params = _to(fmoe.init_moe(cfg, torch.Generator().manual_seed(0)), torch.device("cpu"), torch.float64)
    ids = torch.randint(0, 100, (2, 16), generator=g)
    targets = torch.randint(0, 100, (32,), generator=g)
    return {
        "linear": (lambda x, w: ops.linear(x, w), (r(64, 96), r(96, 128) / 10), 1e-5),
        "rms_norm": (lambda x, s: ops.rms_norm(x, s), (r(64, 96), r(96)), 1e-5),
        "swiglu": (lambda a, b: ops.swiglu(a, b), (r(64, 128), r(64, 128)), 1e-5),
        "attention": (lambda q, k, v: ops.attention(q, k, v),  # grouped-query: 4 heads over 2 kv heads
                      (r(2, 16, 4, 32), r(2, 16, 2, 32), r(2, 16, 2, 32)), 1e-4),
        "embedding": (lambda t: ops.embedding(ids.to(t.device), t), (r(100, 32),), 1e-6),
        "cross_entropy": (lambda x: ops.cross_entropy(x, targets.to(x.device)), (r(32, 100),), 1e-5),
        "moe": (lambda p, x: fmoe.moe(p, x, cfg)[0], (moe_params, r(64, 64)), 1e-4),
    }


def part_ops(dev: torch.device) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 against fp64: TF32 would be the error measured
    torch.backends.cudnn.allow_tf32 = False
    checks, figures = {}, {}
    for dtype, cases in ((torch.float32, None), (torch.bfloat16, ("moe",))):
        for name, (fn, args, tol) in _op_cases(torch.Generator().manual_seed(0)).items():
            if cases is not None and name not in cases:
                continue
            tol = tol if dtype == torch.float32 else 3e-2
            want, vjp = torch.func.vjp(fn, *args)
            ct = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
            want_grads = vjp(ct)
            got, vjp_dev = torch.func.vjp(fn, *_to(args, dev, dtype))
            got_grads = vjp_dev(ct.to(dev, got.dtype))
            errs = [_rel(got, want)] + [_rel(a, b) for a, b in zip(_leaves(got_grads), _leaves(want_grads))]
            label = f"{name}_{str(dtype).split('.')[-1]}"
            figures[label] = max(errs)
            checks[label] = {"ok": max(errs) <= tol, "why": f"max rel err {max(errs):.2e} (tol {tol:g})"}
    return {"figures": figures, "checks": checks}


def part_optim(dev: torch.device) -> dict:
    from fmoe.train.config import TrainConfig
    from fmoe.train.optim import LeafOptimizer
    from fmoe.train.shards import Leaf

    leaves = [Leaf("w", ("w",), False, 0, True, True, 0), Leaf("b", ("b",), False, 0, True, False, 0)]
    g = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in init.items()} for _ in range(3)]
    finals = {}
    for where in (torch.device("cpu"), dev):
        tensors = {k: v.clone().to(where) for k, v in init.items()}
        opt = LeafOptimizer(TrainConfig(pp=1, ep=1), leaves, tensors)
        for step in grads:
            for k, t in tensors.items():
                t.grad = step[k].to(where)
            opt.step()
        _sync(where)
        finals[where.type] = tensors
    err = max(_rel(finals[dev.type][k], finals["cpu"][k]) for k in init)
    state = opt.state_of("w")
    placed = all(v.device == dev for v in state.values())
    return {"figures": {"adamw_rel_err": err},
            "checks": {"adamw_matches_cpu": {"ok": err < 1e-5, "why": f"rel err {err:.2e}"},
                       "adamw_state_on_device": {"ok": placed or dev.type == "cpu",
                                                 "why": str({k: str(v.device) for k, v in state.items()})}}}


def part_comm(dev: torch.device) -> dict:
    import torch.distributed as dist

    from fmoe.parallel.collectives import (
        CommGroup,
        all_gather_async,
        all_reduce_async,
        all_to_all_async,
        reduce_scatter_async,
    )

    backend = {"cuda": "nccl", "npu": "hccl"}.get(dev.type, "gloo")
    store = tempfile.mktemp(prefix="fmoe_device_check_")
    kw = {"device_id": dev} if dev.type != "cpu" else {}
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, **kw)
    checks, figures = {}, {}
    try:
        comm = CommGroup(dist.group.WORLD)
        x = torch.randn(256, 64, device=dev)
        # NCCL sets up a communicator's point-to-point connections on the first send / receive (an
        # all-to-all is built of them) and holds the host until the device is idle: on an H200 the first
        # all-to-all blocked 105 ms behind a 100 ms kernel, also after an all-reduce, and a later one
        # 0.5 ms. One of each first, untimed, so the checks time the collectives and not that setup
        for warm in (all_to_all_async, all_reduce_async):
            warm(x.clone(), comm)[1].wait()
        _sync(dev)
        for name, issue, want in (("all_to_all", lambda: all_to_all_async(x, comm), x),
                                  ("all_gather", lambda: all_gather_async(x, comm), x),
                                  ("reduce_scatter", lambda: reduce_scatter_async(x[None], comm), x),
                                  ("all_reduce", lambda: all_reduce_async(x, comm), x)):
            if dev.type == "cuda":
                torch.cuda._sleep(int(2e8))  # ~0.1 s of device work queued ahead of the collective
            t = time.perf_counter()
            out, handle = issue()
            handle.wait()
            host_s = time.perf_counter() - t
            _sync(dev)
            device_s = time.perf_counter() - t
            err = _rel(out.reshape(want.shape), want)
            figures[f"{name}_host_wait_ms"] = 1e3 * host_s
            figures[f"{name}_until_done_ms"] = 1e3 * device_s
            checks[f"{name}_result"] = {"ok": err == 0.0, "why": f"rel err {err:.2e}"}
            if dev.type == "cuda":  # the host must not have waited for the sleeping device
                checks[f"{name}_wait_leaves_host_free"] = {
                    "ok": host_s < 0.5 * device_s,
                    "why": f"host {1e3 * host_s:.1f} ms, device {1e3 * device_s:.1f} ms"}
    finally:
        dist.destroy_process_group()
    return {"figures": figures, "checks": checks}


def part_syncs(dev: torch.device) -> dict:
    from fmoe.block import init_block
    from fmoe.sync_count import block_syncs
    from fmoe.train.config import TrainConfig

    gcfg = TrainConfig.from_sources("tiny", None, {}).model()
    params = _to(init_block(gcfg, torch.Generator().manual_seed(0)), dev, torch.float32)
    x = torch.randn(4, 64, gcfg.d_model, device=dev)
    block_syncs(params, x, gcfg)  # warm-up: first-call probes and caches
    counted = block_syncs(params, x, gcfg)
    figures = {f"fmoe_count_{k}": v for k, v in counted.items() if k != "where"}
    checks = {"at_most_one_forward_none_backward": {
        "ok": counted["forward"] <= 1 and counted["dx"] == 0 and counted["dw"] == 0,
        "why": f"forward {counted['forward']}, dx {counted['dx']}, dw {counted['dw']}: {counted['where']}"}}
    # CUDA's sync debug mode, each warning by the fmoe line that caused it: the block in bf16 (training's
    # path: none), fp32 through grouped_mm and through the loop backend; the all-to-all plan (its split
    # sizes read from a side stream) and its row chunks (one non-blocking upload)
    from device_parts import a2a_sync_warnings, block_sync_warnings

    cases = (("bf16", torch.bfloat16, None, 0), ("fp32", torch.float32, None, 1),
             ("fp32_loop", torch.float32, "loop", 1))
    for label, dtype, backend, most in cases:
        n, where, counted = block_sync_warnings(dev, dtype, backend)
        figures[f"block_{label}"] = {"cuda_sync_warnings": n, "where": where, "fmoe_counter": counted}
        if dev.type == "cuda" and most is not None:
            checks[f"block_{label}_sync_warnings"] = {"ok": n <= most,
                                                      "why": f"{n} (at most {most}): {where}"}
    a2a = a2a_sync_warnings(dev)
    figures["a2a_plan"], figures["a2a_row_chunks"] = a2a["plan"], a2a["row_chunks"]
    if dev.type == "cuda":
        checks["a2a_plan_at_most_one_sync"] = {"ok": a2a["plan"][0] <= 1, "why": str(a2a["plan"])}
        checks["row_chunks_no_sync"] = {"ok": a2a["row_chunks"][0] == 0, "why": str(a2a["row_chunks"])}
    return {"figures": figures, "checks": checks}


def part_bench(dev: torch.device) -> dict:
    import fmoe

    # a DeepSeek-like expert shape on a device; a small one for the CPU dry run
    T, D, F, E, K = (8192, 2048, 1024, 64, 8) if dev.type != "cpu" else (512, 256, 128, 8, 2)
    cfg = fmoe.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)
    params = _to(fmoe.init_moe(cfg, torch.Generator().manual_seed(0)), dev, torch.bfloat16)
    leaves = [t.requires_grad_() for t in _leaves(params)]
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def layer() -> None:
        y, aux = fmoe.moe(params, x, cfg)
        torch.autograd.grad((y.float().sum() + aux.loss,), [x, *leaves], allow_unused=True)

    flops = 3 * (3 * 2 * T * K * D * F)  # three expert GEMMs, forward + dx + dw
    a = torch.randn(T * K, D, device=dev, dtype=torch.bfloat16)
    b = torch.randn(D, F, device=dev, dtype=torch.bfloat16)
    dense_s = _median_s(lambda: a @ b, dev) * 9  # the same FLOPs: nine [T*K, D] x [D, F] products
    moe_s = _median_s(layer, dev)
    ratio = dense_s / moe_s
    return {"figures": {"moe_tflops": flops / moe_s / 1e12, "dense_tflops": flops / dense_s / 1e12,
                        "moe_over_dense": ratio, "shape": [T, D, F, E, K]},
            "checks": {}}


def part_compile(dev: torch.device) -> dict:
    """The bf16 MoE layer compiled (torch.compile fullgraph, inductor on a device; aot_eager for the CPU
    dry run, which only checks that it traces) against eager and against the dense matmul ceiling,
    forward + backward; the compile time of the first call apart."""
    import fmoe

    T, D, F, E, K = (8192, 2048, 1024, 64, 8) if dev.type != "cpu" else (256, 128, 64, 8, 2)
    cfg = fmoe.MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)
    params = _to(fmoe.init_moe(cfg, torch.Generator().manual_seed(0)), dev, torch.bfloat16)
    leaves = [t.requires_grad_() for t in _leaves(params)]
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def forward(p, x_TD):
        return fmoe.moe(p, x_TD, cfg)[0]

    backend = "inductor" if dev.type != "cpu" else "aot_eager"
    compiled = torch.compile(forward, fullgraph=True, backend=backend)

    def step(fn) -> Callable[[], Any]:
        return lambda: torch.autograd.grad((fn(params, x).float().sum(),), [x, *leaves])

    t = time.perf_counter()
    got = step(compiled)()
    _sync(dev)
    compile_s = time.perf_counter() - t
    want = step(forward)()
    err = max(_rel(g.float(), w.float()) for g, w in zip(got, want))
    flops = 3 * (3 * 2 * T * K * D * F)
    a = torch.randn(T * K, D, device=dev, dtype=torch.bfloat16)
    b = torch.randn(D, F, device=dev, dtype=torch.bfloat16)
    reps = {"warmup": 1, "iters": 2} if dev.type == "cpu" else {}  # the dry run only checks it runs
    dense_s = _median_s(lambda: a @ b, dev, **reps) * 9
    eager_s, compiled_s = _median_s(step(forward), dev, **reps), _median_s(step(compiled), dev, **reps)
    figures = {"compile_s": compile_s, "eager_tflops": flops / eager_s / 1e12,
               "compiled_tflops": flops / compiled_s / 1e12, "compiled_over_eager": eager_s / compiled_s,
               "compiled_over_dense": dense_s / compiled_s, "shape": [T, D, F, E, K]}
    return {"figures": figures,
            "checks": {"compiled_equals_eager": {"ok": err < 2e-2, "why": f"max rel. err. {err:.1e} (bf16)"}}}


def part_train(dev: torch.device, out: str) -> dict:
    base = [sys.executable, "-m", "fmoe.cli.main", "train", "--pp", "1", "--ep", "1", "--steps", "4",
            "--global-batch-size", "8", "--micro-batch-size", "4", "--seq-length", "64", "--no-progress"]
    runs = {"cpu_fp32": ["--device", "cpu"], "device_fp32": ["--device", dev.type, "--no-bf16", "--no-tf32"],
            "device_default": ["--device", dev.type, "--steps", "20"]}
    losses, figures = {}, {}
    for name, flags in runs.items():
        metrics = os.path.join(out, f"train_{name}.jsonl")
        if os.path.exists(metrics):  # fmoe train appends to a metrics file
            os.remove(metrics)
        t = time.perf_counter()
        proc = subprocess.run([*base, *flags, "--metrics", metrics], capture_output=True, text=True,
                              timeout=150)
        figures[f"{name}_s"] = time.perf_counter() - t
        if proc.returncode != 0:
            figures[f"{name}_error"] = (proc.stderr or proc.stdout)[-2000:]
            continue
        rows = [json.loads(line) for line in open(metrics)]
        losses[name] = [row["loss"] for row in rows if "loss" in row]
        tok = [row.get("tokens_per_s") for row in rows if row.get("tokens_per_s")]
        if tok:
            figures[f"{name}_tokens_per_s"] = statistics.median(tok[2:] or tok)
    figures["losses"] = losses
    checks = {}
    if "cpu_fp32" in losses and "device_fp32" in losses:
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses["device_fp32"], losses["cpu_fp32"]))
        checks["fp32_losses_match_cpu"] = {"ok": diff < 1e-3 and len(losses["device_fp32"]) == 4,
                                           "why": f"max rel loss diff {diff:.2e}"}
    checks["every_run_finished"] = {"ok": len(losses) == len(runs), "why": f"finished {sorted(losses)}"}
    return {"figures": figures, "checks": checks}


# ---- driver ------------------------------------------------------------------------------------------

def run_part(name: str, dev: torch.device, out: str) -> dict:
    """Runs part `name` in this process; returns {"figures", "checks"}."""
    if name in LAYER_PARTS:
        import device_parts

        fn = getattr(device_parts, f"part_{name}")
    else:
        fn = globals()[f"part_{name}"]
    return fn(dev, out) if name in ("train", "grouped", "exec1", "train_big") else fn(dev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "device_check_out"))
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "npu", "cpu"))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS + LAYER_PARTS)}")
    ap.add_argument("--budget-s", type=float, default=450.0)
    ap.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part, write its JSON
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = pick_device(args.device)
    if args.part:
        result = run_part(args.part, dev, args.out)
        with open(os.path.join(args.out, f"{args.part}.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
        return 0
    report, start, failed = {"device": str(dev)}, time.monotonic(), False
    unknown = [p for p in args.parts.split(",") if p not in PARTS + LAYER_PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}: give some of {', '.join(PARTS + LAYER_PARTS)}")
    for name in args.parts.split(","):
        left = args.budget_s - (time.monotonic() - start)
        if left < 20:
            report[name] = {"status": "skipped (budget)"}
            failed = True
            continue
        t = time.monotonic()
        cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--out", args.out,
               "--device", args.device]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=min(TIMEOUT_S[name], left))
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, log = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
        with open(os.path.join(args.out, f"{name}.log"), "w") as f:
            f.write(str(log))
        path = os.path.join(args.out, f"{name}.json")
        part = json.load(open(path)) if rc == 0 and os.path.exists(path) else {"error": str(log)[-1500:]}
        part.update(status="ok" if rc == 0 else f"failed ({rc})", seconds=round(time.monotonic() - t, 1))
        failed |= rc != 0 or not all(c["ok"] for c in part.get("checks", {}).values())
        report[name] = part
        bad = [k for k, c in part.get("checks", {}).items() if not c["ok"]]
        print(f"{name:6s} {part['status']:12s} {part['seconds']:6.1f} s  checks "
              f"{len(part.get('checks', {})) - len(bad)}/{len(part.get('checks', {}))} ok"
              + (f"  FAILED: {', '.join(bad)}" if bad else ""), flush=True)
    with open(os.path.join(args.out, "device_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, "summary.txt"), "w") as f:
        for name, part in report.items():
            if isinstance(part, dict):
                figures = json.dumps(part.get("figures", {}), default=str)[:600]
                f.write(f"{name}: {part.get('status')} {figures}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
