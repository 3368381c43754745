"""What a pp 2 step holds of its point-to-point sends, and its peak memory: this tree against a base revision.

    .venv/bin/python benchmarks/send_buffers.py --base 9f36957        # before / after, side by side
    .venv/bin/python benchmarks/send_buffers.py                       # this tree only

Model and batch: benchmarks/pipeline.py's (MoE GPT, D 256, S 128, B 2, 8 microbatches, 2 gloo ranks), one
step of each schedule after a warm-up step, through gpt_pipeline_step. Per rank:
- sends: every tensor the executor hands to `dist.isend` is tracked by a weak reference; `held` = the most
  bytes of them alive at once (counted at each isend), against `sent` = the bytes of all of them;
- peak: the RSS rise during the step (glibc malloc set to return every block >= 64 KiB at once, so the
  rise is what the step holds at its peak: activations, gradients, buffers; benchmarks/_ranks.py).
`--base REV` runs the same measurement a second time on revision REV's fmoe (laid out as in
benchmarks/revisions.py, run from a neutral directory) and prints both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import weakref
from typing import Any

import _ranks
import pipeline as P
import torch
import torch.distributed as dist
from revisions import package_of

from fmoe import init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.parallel.shared_grads import SharedGrads
from fmoe.pipeline import gpt_pipeline_step, gpt_program, holders

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    _ranks.return_freed_memory()
    cfg = P.model_config(args)
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    state = init_gpt_state(cfg)
    data = P.batches(cfg, args)
    refs: list[tuple[weakref.ref, int]] = []
    held = 0
    isend = dist.isend

    def tracked(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        nonlocal held
        refs.append((weakref.ref(tensor), tensor.nbytes))
        held = max(held, sum(n for r, n in refs if r() is not None))
        return isend(tensor, *a, **k)

    dist.isend = tracked
    out = {}
    for name in args.only:
        s = S.build(name, world, args.microbatches)
        chunks = _ranks.even_chunks(cfg, len(set(s.placement.layer_chunk)))
        program = gpt_program(cfg, s, rank, chunks=chunks)
        shared = SharedGrads(holders(cfg, s.placement, chunks), None)

        def step(program=program, shared=shared) -> None:
            gpt_pipeline_step(program, params, state, data, shared=shared, check=False)

        step()
        refs.clear()
        held = 0
        dist.barrier()
        _, _, rise = _ranks.measure_rss(step)
        out[name] = {"held": held, "sent": sum(n for _, n in refs), "rise": rise}
    return out


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    return _ranks.spawn(_rank, 2, (args,), args.timeout, "send buffers", args.pg_timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ranks.add_model_arguments(p)
    p.add_argument("--only", nargs="+", default=list(SCHEDULES), choices=S.registry.NAMES)
    p.add_argument("--base", help="git revision to measure too (its fmoe, this script)")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one side, for --base
    args = p.parse_args(argv)
    if args.json:
        print(json.dumps(measure(args)))
        return 0
    sides = {"this tree": measure(args)}
    if args.base:
        with tempfile.TemporaryDirectory() as tmp:
            pkg = package_of(args.base, os.path.join(tmp, "base"))
            flags = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--base")
                     and a != args.base]
            got = subprocess.run([sys.executable, os.path.abspath(__file__), *flags, "--json"], cwd=tmp,
                                 env={**os.environ, "PYTHONPATH": pkg}, capture_output=True, text=True)
            if got.returncode != 0:
                raise RuntimeError(got.stderr[-3000:])
            sides[args.base] = json.loads(got.stdout.strip().splitlines()[-1])
    mib = 1 / 2 ** 20
    print(f"pp 2, {args.microbatches} microbatches of [B, S, D] = [{args.micro_batch}, {args.seq}, "
          f"{args.d_model}] fp32 ({args.micro_batch * args.seq * args.d_model * 4 * mib:.2f} MiB each)")
    print(f"{'schedule':12} {'fmoe':12} {'sends held MiB r0/r1':>22} {'of sent MiB':>14} "
          f"{'peak rise MiB':>14}")
    for name in args.only:
        for side, res in sides.items():
            held = "/".join(f"{r[name]['held'] * mib:.2f}" for r in res)
            sent = "/".join(f"{r[name]['sent'] * mib:.1f}" for r in res)
            rise = "/".join(f"{r[name]['rise']:.0f}" for r in res)
            print(f"{name:12} {side:12} {held:>22} {sent:>14} {rise:>14}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
