"""Everything `fmoe train` checks before any process starts: the config's own fields
(`TrainConfig.problem`), then what needs the job's other parts: the LR schedule and logging flags, the
validation split, the --save directory, the output files' paths and the checkpoint a --resume continues from.

    problem = preflight.problem(tc, world_size=None)     # None, or one line saying what is wrong

Why a module of its own: the config is plain data that the checkpoint, the schedule, the splits and the
logging read; they cannot be what the config imports back (docs/CONTRIBUTING.md: imports flow one way).
"""

from __future__ import annotations

from fmoe.train import checkpoint
from fmoe.train.config import TrainConfig
from fmoe.train.log_backends import backends_problem
from fmoe.train.lr_schedule import schedule_problem
from fmoe.train.run_outputs import clash as output_clash
from fmoe.train.save_dir import check as check_save_dir
from fmoe.train.splits import eval_problem


def problem(tc: TrainConfig, world_size: int | None = None) -> str | None:
    """Returns one line saying what is wrong with run `tc` before any process starts, or None.
    `world_size`: the ranks a launcher gives (torchrun); None when `fmoe train` spawns them itself."""
    first = tc.problem(world_size)
    if first is not None:
        return first
    try:
        for found in (schedule_problem(tc), backends_problem(tc), eval_problem(tc),
                      check_save_dir(tc.save, resume=tc.resume, overwrite=tc.overwrite_save, load=tc.load),
                      output_clash(tc), _trace_problem(tc)):
            if found is not None:
                return found
    except (ValueError, TypeError, checkpoint.CheckpointError) as exc:
        return str(exc).splitlines()[0]
    return None


def _trace_problem(tc: TrainConfig) -> str | None:
    # a --resume run's first step is its checkpoint's: a trace step before it would write nothing
    if not (tc.trace and tc.resume and tc.save):
        return None
    last = checkpoint.latest(tc.save)
    done = checkpoint.read_meta(last)["step"] if last is not None else 0
    if tc.trace_step <= done:
        return (f"--trace-step {tc.trace_step} was run before the checkpoint --resume continues from (step "
                f"{done}): --trace would write nothing")
    return None
