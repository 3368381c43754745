"""When an --fp16 run stops instead of skipping steps forever.

A step whose gradients overflow is skipped and the dynamic loss scale backs off; that recovers a run
whose scale was too high, never one whose forward has gone bad. So, as fp32 and bf16 runs stop at a
non-finite gradient norm (fmoe/train/optim.py), an fp16 run stops with a RunError (one line) when:
  - the loss itself is not finite: the forward does not see the loss scale, so no backoff can help;
  - a step overflows at the dynamic scale's floor (--min-loss-scale) with its --hysteresis spent: the
    scale cannot go lower (DeepSpeed's loss scaler raises "Current loss scale already at minimum");
  - a static --loss-scale overflows MAX_SKIPPED_IN_A_ROW steps in a row (it never backs off).
The count of skipped steps in a row is not checkpointed: a resumed run counts from zero.
"""

from __future__ import annotations

import math

from fmoe.precision import LossScale
from fmoe.train.run_errors import RunError

MAX_SKIPPED_IN_A_ROW = 50


def check_fp16_step(step: int, loss: float, used: LossScale, finite: bool, skipped_in_a_row: int) -> None:
    """Raises RunError when the fp16 run cannot go on after step `step` (1-based): `loss` its loss, `used`
    the scaling state the step ran with, `finite` whether its gradients were, `skipped_in_a_row` the
    skipped steps ending with this one. The same on every rank (loss and norm are reduced over all)."""
    if not math.isfinite(loss):
        raise RunError(f"--fp16: the loss of step {step} is {loss} (not an overflow of the loss scale: the "
                       "forward itself diverged); stopping")
    if finite:
        return
    if used.dynamic and used.scale <= used.min_scale and used.hysteresis_left <= 1:
        raise RunError(f"--fp16: step {step} overflowed at the minimum loss scale {used.min_scale:g} "
                       f"(--min-loss-scale); stopping")
    if not used.dynamic and skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise RunError(f"--fp16: {skipped_in_a_row} steps in a row overflowed at the static loss scale "
                       f"{used.scale:g} (--loss-scale); stopping at step {step}")
