"""A research script on fmoe's pieces, without `fmoe train`: params from fmoe's init, a pipeline schedule
built by name or read from a file, and `fmoe.pipeline.gpt_pipeline_step` on every rank of a gloo group,
then plain SGD on the gradients each rank holds. One process per pipeline rank, started by torchrun:

    torchrun --nproc-per-node 2 docs/examples/pipeline_research.py --schedule 1f1b --steps 3
    torchrun --nproc-per-node 2 docs/examples/pipeline_research.py --schedule-file my_1f1b.txt

Rank 0 prints `step <k> loss <float>` per step (the loss of the batch before that step's update). The
model, data and learning rate are fixed below; change them, the schedule or the step. `train` runs in one
process too (pp 1, no group): tests/test_schedule_file.py compares the two.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from fmoe import GPTConfig, MoEConfig, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.parallel import close_default_group, exit_process
from fmoe.pipeline import gpt_pipeline_step, gpt_program, split_microbatches

LR = 0.05
SEQ, PER_MB, VOCAB = 16, 2, 64  # tokens per sequence, sequences per microbatch, vocabulary


def model_config() -> GPTConfig:
    """A small MoE GPT: 4 layers (the first dense), 4 experts top-2 and a shared expert."""
    moe = MoEConfig(d_model=32, d_ff=32, num_experts=4, top_k=2, num_shared_experts=1)
    return GPTConfig(vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=2, moe=moe, num_dense_layers=1)


def batches(step: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Step `step`'s m microbatches of (ids, targets), the same on every rank (random tokens)."""
    tokens = torch.randint(0, VOCAB, (PER_MB * m, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return split_microbatches(tokens[:, :-1], tokens[:, 1:], m)


def sgd(params: Any, grads: Any, lr: float) -> Any:
    """Returns `params` less lr x `grads` where this rank has a gradient (None or absent: kept)."""
    if isinstance(params, torch.Tensor):
        return params if grads is None else params - lr * grads
    if isinstance(params, dict):
        return {k: sgd(v, (grads or {}).get(k), lr) for k, v in params.items()}
    return [sgd(p, g, lr) for p, g in zip(params, grads or [None] * len(params), strict=True)]


def train(s: S.Schedule, rank: int, group: dist.ProcessGroup | None, steps: int) -> list[float]:
    """Runs `steps` steps of schedule `s` as pipeline rank `rank` of `group` (None: one process, pp 1);
    returns the losses (the same on every rank)."""
    cfg = model_config()
    params = init_gpt(cfg, torch.Generator().manual_seed(0))  # every rank the same; each uses its chunks
    state = init_gpt_state(cfg)
    losses = []
    for step in range(1, steps + 1):
        out = gpt_pipeline_step(gpt_program(cfg, s, rank), params, state, batches(step, s.m), group=group)
        params = sgd(params, out.grads, LR)
        losses.append(out.loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b", help="a built schedule (fmoe.schedule.registry.NAMES)")
    parser.add_argument("--schedule-file", default=None, help="a schedule in its printed form instead")
    parser.add_argument("--microbatches", "-m", type=int, default=4, help="with --schedule")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # env:// from torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    succeeded = False
    try:
        rank, pp = dist.get_rank(), dist.get_world_size()
        if args.schedule_file is not None:
            s = S.load_schedule(args.schedule_file)
        else:
            s = S.build(args.schedule, pp, args.microbatches)
        S.verify(s)  # the executor verifies too; here a bad file fails before any P2P
        if s.pp != pp:
            raise SystemExit(f"{s.name} runs on {s.pp} ranks; start {s.pp} processes, not {pp}")
        for step, loss in enumerate(train(s, rank, dist.group.WORLD if pp > 1 else None, args.steps), 1):
            if rank == 0:
                print(f"step {step} loss {loss!r}", flush=True)
        succeeded = True
    finally:
        close_default_group(succeeded)  # a barrier first when every rank got here
    exit_process(0)  # gloo's threads may still hold tensors: a finalizing interpreter would abort

if __name__ == "__main__":
    main()
