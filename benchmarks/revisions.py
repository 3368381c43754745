"""One `fmoe train` job on two revisions of fmoe, side by side: did a change move the step time or memory?

    .venv/bin/python benchmarks/revisions.py --base 0ddf40d --rounds 6 -- --steps 20
    .venv/bin/python benchmarks/revisions.py --base HEAD~3 --head HEAD -- --schedule 1f1b --pp 2 --ep 1

Each revision's `fmoe/`, `schedule/` and `transforms/` are laid out as the installed package
(`git archive`; the working tree for `--head` left out) in a folder of their own, and the job runs from
there (PYTHONPATH, from a neutral directory, so the editable install is not picked up: its spawned ranks
inherit both). Rounds alternate the two and reverse their order every other round; each run's step time
is the median of its metrics' `step_s` after `--skip` warm-up steps; the ratio head / base is taken per
round and its median printed, beside the medians of each side. Peak memory: the largest peak RSS
(VmHWM) of one process of the job (the launcher and its ranks), read from /proc every 50 ms while it runs.
The job's flags after `--` go to `fmoe train` as they are (default: the tiny preset, `make run`'s job).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from _procs import descendants, hwm_kib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUT = {"fmoe": "fmoe", "schedule": "fmoe/schedule", "transforms": "fmoe/transforms"}


def package_of(rev: str | None, into: str) -> str:
    """Lays out revision `rev` (None: the working tree) as an importable `fmoe` package under `into`;
    returns `into`."""
    src = into + ".src"
    if rev is None:
        src = ROOT
    else:
        os.makedirs(src)
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev, *LAYOUT], capture_output=True,
                                 check=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(src, filter="data")
    for folder, where in LAYOUT.items():
        shutil.copytree(os.path.join(src, folder), os.path.join(into, where),
                        ignore=shutil.ignore_patterns("__pycache__"))
    return into


def run_job(package: str, flags: list[str], skip: int) -> tuple[float, float]:
    """Runs `fmoe train FLAGS` from `package`; returns (median step seconds after `skip` steps, the largest
    peak RSS of one process of the job in MiB)."""
    with tempfile.TemporaryDirectory() as work:
        metrics = os.path.join(work, "m.jsonl")
        env = {**os.environ, "PYTHONPATH": package}
        proc = subprocess.Popen([sys.executable, "-m", "fmoe.cli.main", "train", "--no-progress", *flags,
                                 "--metrics", metrics], cwd=work, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        peak: dict[int, int] = {}
        while proc.poll() is None:
            for pid in [proc.pid, *descendants(proc.pid)]:
                peak[pid] = max(peak.get(pid, 0), hwm_kib(pid))
            time.sleep(0.05)
        if proc.returncode != 0:
            raise RuntimeError(f"fmoe train from {package} failed: {proc.stderr.read()[-2000:]}")
        steps = [json.loads(line)["step_s"] for line in open(metrics)]
    return statistics.median(steps[skip:] or steps), max(peak.values(), default=0) / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare against")
    ap.add_argument("--head", default=None, help="git revision measured (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--skip", type=int, default=3, help="warm-up steps left out of each run's median")
    args, flags = ap.parse_known_args()
    flags = [f for f in flags if f != "--"] or ["--steps", "20"]
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"head": package_of(args.head, os.path.join(tmp, "head")),
                 "base": package_of(args.base, os.path.join(tmp, "base"))}
        times: dict[str, list[float]] = {k: [] for k in sides}
        peaks: dict[str, list[float]] = {k: [] for k in sides}
        ratios = []
        for r in range(args.rounds):
            order = ["head", "base"] if r % 2 == 0 else ["base", "head"]
            got = {}
            for side in order:
                got[side] = run_job(sides[side], flags, args.skip)
                times[side].append(got[side][0])
                peaks[side].append(got[side][1])
            ratios.append(got["head"][0] / got["base"][0])
            print(f"round {r}: head {1e3 * got['head'][0]:.1f} ms, base {1e3 * got['base'][0]:.1f} ms, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"fmoe train {' '.join(flags)}; head {args.head or 'working tree'} vs base {args.base}, "
          f"{args.rounds} rounds")
    for side in sides:
        print(f"  {side}: step {1e3 * statistics.median(times[side]):.1f} ms (median of run medians, "
              f"{1e3 * min(times[side]):.1f}-{1e3 * max(times[side]):.1f}), peak RSS per process "
              f"{statistics.median(peaks[side]):.0f} MiB")
    print(f"  head / base: {statistics.median(ratios):.3f} (median of per-round ratios, "
          f"{min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
