"""`fmoe train --compile` against eager `fmoe train` on the tiny job (`make run`'s layout: pp 2 x ep 2,
DualPipeV with fb overlap), side by side.

    .venv/bin/python benchmarks/train_compile.py [--steps 30] [--rounds 2] [--warmup 5]

Each round runs the eager job and the compiled one (inductor) for `--steps` steps, the order alternating.
Per run: the median tokens/s of the steps after `--warmup` (the first steps compile), the compile time
`fmoe train` prints ("compiled: ... in X s": tracing the phases and compiling their forward, dx and dw
graphs, rank 0), and the peak resident memory of the run's processes (each one's VmHWM, summed). The
first compiled run starts from an empty inductor cache (TORCHINDUCTOR_CACHE_DIR, a fresh directory), the
later ones reuse it: their compile time is the cached one. The losses of each compiled run are compared
with the eager run's step by step (largest relative difference).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _procs import descendants, hwm_kib


def run(tmp: Path, name: str, steps: int, compiled: bool, cache: Path) -> dict:
    """One `fmoe train` run; returns its metrics lines, stdout and peak RSS (MiB, its processes' summed)."""
    metrics = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "fmoe.cli.main", "train", "--no-progress", "--steps", str(steps),
           "--metrics", str(metrics)] + (["--compile"] if compiled else [])
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak: dict[int, int] = {}

    def poll() -> None:
        while proc.poll() is None:
            for pid in [proc.pid, *descendants(proc.pid)]:
                peak[pid] = max(peak.get(pid, 0), hwm_kib(pid))
            time.sleep(0.2)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=1800)
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out}\n{err[-3000:]}")
    lines = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    got = re.search(r"compiled: .* in ([0-9.]+) s; traces after step 2: ([0-9]+)", out)
    return {"metrics": lines, "compile_s": float(got.group(1)) if got else None,
            "late_traces": int(got.group(2)) if got else None,
            "peak_mib": sum(peak.values()) / 1024,
            "stdout": out}


def tokens_per_s(res: dict, warmup: int) -> float:
    return statistics.median(m["tokens_per_s"] for m in res["metrics"][warmup:])


def loss_gap(a: dict, b: dict, steps: int | None = None) -> float:
    """The largest relative difference of two runs' losses over their first `steps` steps (None: all)."""
    pairs = list(zip(a["metrics"], b["metrics"], strict=True))[:steps]
    return max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the tokens/s median")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp, cache = Path(d), Path(d) / "inductor-cache"
        runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            order = ["eager", "compiled"] if r % 2 == 0 else ["compiled", "eager"]
            for name in order:
                res = run(tmp, f"{name}{r}", args.steps, name == "compiled", cache)
                runs[name].append(res)
                print(f"round {r} {name}: {tokens_per_s(res, args.warmup):.0f} tokens/s after step "
                      f"{args.warmup}, peak RSS {res['peak_mib']:.0f} MiB"
                      + (f", compile {res['compile_s']:.1f} s, traces after step 2: {res['late_traces']}"
                         if res["compile_s"] is not None else ""),
                      flush=True)
    tok = {n: statistics.median(tokens_per_s(x, args.warmup) for x in v) for n, v in runs.items()}
    mem = {n: statistics.median(x["peak_mib"] for x in v) for n, v in runs.items()}
    gaps = [loss_gap(c, e) for c, e in zip(runs["compiled"], runs["eager"])]
    gaps20 = [loss_gap(c, e, 20) for c, e in zip(runs["compiled"], runs["eager"])]
    compile_s = [x["compile_s"] for x in runs["compiled"]]
    print(f"tokens/s (median of {args.rounds} runs, steps after {args.warmup}): eager {tok['eager']:.0f}, "
          f"compiled {tok['compiled']:.0f}, compiled / eager {tok['compiled'] / tok['eager']:.3f}")
    warm = statistics.median(compile_s[1:]) if len(compile_s) > 1 else None
    cached = "" if warm is None else f", cached {warm:.1f} s ({warm / compile_s[0]:.2f} of the first)"
    print(f"compile time: first (empty inductor cache) {compile_s[0]:.1f} s{cached}")
    print(f"peak RSS, all processes of a run: eager {mem['eager']:.0f} MiB, "
          f"compiled {mem['compiled']:.0f} MiB")
    print(f"losses, compiled against eager: largest relative difference over {args.steps} steps "
          f"{max(gaps):.2e}, over the first 20 {max(gaps20):.2e}")


if __name__ == "__main__":
    main()
