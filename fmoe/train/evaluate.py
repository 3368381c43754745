"""Held-out evaluation of `fmoe train` (--eval-interval N, --eval-iters K, Megatron's names).

    out = evaluate(trainer)   # collective: {"eval_loss", "eval_main_loss", "eval_s"}, alike on every rank

Every N steps and after the last one, the rank's current weights run forward over K global batches of the
validation split (fmoe/train/splits.py): batch i of the split's seeded stream for i = 0..K-1, sharded over
the data ranks as training batches are, so every evaluation reads the same sequences and its losses form
a curve. Forward only: under torch.no_grad(), with the training RNG states put back afterwards
(torch.random.fork_rng; nothing in the forward draws from them today, so this keeps it so), no gradient,
no optimizer or MoE state update (routing statistics are dropped), no data position moved.

- pp 1 x ep 1 ("accumulate"): each microbatch through `gpt_loss`, as training does.
- Every other layout: the stage programs of the run's schedule (the run's `GPTProgram`), run by
  `fmoe.schedule.forward_only` (GPipe's forward half over path 0, P2P between pipeline ranks, the expert
  exchanges as in training), since no schedule of the executor runs forwards without their backward.
The losses are those of training (mean over microbatches, then over data ranks): eval_loss is the total
(cross-entropy + balancing + weighted MTP), eval_main_loss the cross-entropy alone, comparable with the
Markov corpus floor.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fmoe.model import gpt_loss
from fmoe.pipeline.step import microbatch_meta
from fmoe.precision import cast_to_compute
from fmoe.schedule.forward_only import forward_only
from fmoe.train.data import microbatches

if TYPE_CHECKING:
    from fmoe.train.loop import Trainer

EVAL_KEYS = ("eval_loss", "eval_main_loss", "eval_s")


def due(tc: Any, step: int) -> bool:
    """Whether the run evaluates after step `step` (1-based): every eval_interval steps and after the
    last step."""
    return bool(tc.eval_interval) and (step % tc.eval_interval == 0 or step == tc.steps)


def evaluate(trainer: Trainer) -> dict[str, float]:
    """Returns the eval losses of `trainer`'s current weights and the seconds it took (module docstring).
    Collective over every rank of the run; changes nothing of the trainer."""
    tc, device = trainer.tc, trainer.world.device
    if trainer.valid is None:
        raise ValueError("evaluate: the run has no validation data (--eval-interval 0)")
    t0 = time.perf_counter()
    forked = [device] if device.type != "cpu" else []
    kind = device.type if device.type != "cpu" else "cuda"
    with torch.random.fork_rng(devices=forked, device_type=kind), torch.no_grad():
        policy = trainer.policy
        params = cast_to_compute(trainer.params, policy) if policy.mixed else trainer.params
        sums = torch.zeros(2, dtype=torch.float64)  # [total, cross-entropy], summed over microbatches
        count = 0
        for i in range(tc.eval_iters):
            batches = [(ids.to(device), t.to(device)) for ids, t in microbatches(
                trainer.valid, i, global_batch=tc.global_batch_size, micro_batch=tc.micro_batch_size,
                data_rank=trainer.data_rank, data_ranks=tc.data_ranks, seed=tc.seed)]
            sums += _accumulate(trainer, params, batches) if trainer.accumulate else _pipeline(
                trainer, params, batches)
            count += len(batches)
    vec = sums / count
    if trainer.world_group is not None:  # the loss lives on the last stage's rank of each data rank
        vec = vec.to(device)
        dist.all_reduce(vec, group=trainer.world_group)
        vec = vec.cpu()
    loss, main = (vec / (tc.data_ranks * tc.tp * tc.cp)).tolist()  # every tp / cp rank holds the loss
    return {"eval_loss": loss, "eval_main_loss": main, "eval_s": time.perf_counter() - t0}


def _accumulate(trainer: Trainer, params: dict, batches: list) -> torch.Tensor:
    out = torch.zeros(2, dtype=torch.float64)
    for ids, targets in batches:
        loss, aux = gpt_loss(params, ids, targets, trainer.cfg, trainer.state, parallel=trainer.parallel,
                             check=False, packing=trainer.packing(ids))
        out += torch.stack([loss.detach(), aux.main_loss.detach()]).double().cpu()
    return out


def _pipeline(trainer: Trainer, params: dict, batches: list) -> torch.Tensor:
    (B, S), = {tuple(ids.shape) for ids, _ in batches}
    programs = trainer.program.stage_programs(params, (B, S), params["embed"]["table"].dtype)
    data = microbatch_meta(batches, trainer.state, [trainer.packing(ids) for ids, _ in batches])
    sums = forward_only(trainer.schedule.placement, trainer.pp_rank, programs, lambda mb: data[mb],
                        len(batches), group=trainer.pp_group, device=trainer.world.device)
    if not sums:  # this rank holds no loss stage
        return torch.zeros(2, dtype=torch.float64)
    total = sum(sums.values())
    return torch.stack([total, sums.get("ce", torch.zeros_like(total))]).double().cpu()
