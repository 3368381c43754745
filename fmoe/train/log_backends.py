"""Where rank 0's metrics go besides the JSON lines: TensorBoard (--tensorboard-dir) and Weights & Biases
(--wandb-project, --wandb-exp-name, --wandb-save-dir), Megatron's flags.

    backends = LogBackends.open(tc, first_step)     # rank 0 only; nothing opened without the flags
    backends.log(metrics)                           # one step's metrics (eval ones on evaluation steps)
    backends.close()

With --moe-per-layer-logging each MoE layer's tokens per expert (and the aux-loss-free expert bias) go to
both as histograms with one bar per expert ("moe/expert_load/KEY", "moe/expert_bias/KEY"). Both get the
same scalars under the same tags (TAGS: "train/loss", "train/lr", "eval/main_loss", ...) at
the step number of the metrics. TensorBoard: torch.utils.tensorboard's SummaryWriter (the `tensorboard`
package, `pip install 'fmoe[tensorboard]'`), opened with purge_step = the run's first step, so that, as the
metrics file does, a fresh run hides an earlier run's points in the same directory and a resumed run the
steps its crashed predecessor made past the checkpoint. W&B: `wandb.init(project, name, dir, config)`, one
W&B run per launch, `wandb.log(scalars, step=step)`. A flag whose package is not installed fails before
launch (`backends_problem`), not in rank 0 after the model is built.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fmoe.train.run_errors import RunError

if TYPE_CHECKING:
    from fmoe.train.config import TrainConfig

TAGS = {"loss": "train/loss", "main_loss": "train/main_loss", "balance_loss": "train/balance_loss",
        "mtp_loss": "train/mtp_loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s", "step_s": "train/step_s",
        "exposed_comm_frac": "train/exposed_comm_frac", "max_over_mean_load": "train/max_over_mean_load",
        "dropped": "train/dropped", "loss_scale": "train/loss_scale", "eval_loss": "eval/loss",
        "eval_main_loss": "eval/main_loss", "eval_s": "eval/seconds"}


def installed(name: str) -> bool:
    """Whether module `name` can be imported (one already in sys.modules counts; None there means not)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def backends_problem(tc: TrainConfig) -> str | None:
    """One line saying why the logging flags cannot work, or None (checked before launch)."""
    # --wandb-exp-name / --wandb-save-dir without --wandb-project: fmoe.train.modifiers
    if tc.wandb_project is not None and not tc.wandb_project:
        return "--wandb-project must not be empty"
    elif tc.wandb_project is not None and not installed("wandb"):
        return "--wandb-project logs to Weights & Biases, but wandb is not installed (pip install wandb)"
    if tc.tensorboard_dir is not None and not installed("tensorboard"):
        return ("--tensorboard-dir writes TensorBoard events, but tensorboard is not installed "
                "(pip install 'fmoe[tensorboard]')")
    return None


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics under their TAGS (the keys a step has; bools and non-numbers left out)."""
    return {tag: float(metrics[k]) for k, tag in TAGS.items()
            if isinstance(metrics.get(k), (int, float)) and not isinstance(metrics.get(k), bool)}


@contextmanager
def _tensorboard_named(directory: str | None) -> Iterator[None]:
    """An OSError writing TensorBoard's events (a full disk, a path through a file) as one RunError line
    naming --tensorboard-dir."""
    try:
        yield
    except OSError as exc:
        raise RunError(f"--tensorboard-dir {directory}: cannot write ({exc.strerror or exc}): free space "
                       "there or give another folder") from None


def _rank_import(module: str, flag: str, package: str) -> Any:
    """`module` imported in rank 0; RunError when it cannot be although the launcher found it (checked
    before launch): the ranks run with another Python path or environment."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RunError(f"{flag}: rank 0 cannot import {module} ({exc}), though the launcher could: the ranks "
                       f"run another Python environment or path; pip install {package} there") from None


def per_expert(metrics: dict[str, Any]) -> dict[str, list[float]]:
    """The per-expert values of a --moe-per-layer-logging step under their tags: "moe/expert_load/KEY"
    (tokens per expert of MoE layer KEY) and "moe/expert_bias/KEY"; {} without them."""
    return {f"moe/{name}/{layer}": values for name in ("expert_load", "expert_bias")
            for layer, values in metrics.get(name, {}).items()}


def _tensorboard_bars(writer: Any, tag: str, values: list[float], step: int) -> None:
    """Tokens per expert as one bar per expert: a raw TensorBoard histogram whose bucket e (edges e - 0.5,
    e + 0.5) holds expert e's count, so the histogram view reads as the layer's per-expert chart; a bias
    (signed) as the histogram of its values over the experts."""
    if "/expert_bias/" in tag:
        import numpy as np

        writer.add_histogram(tag, np.asarray(values), step)
        return
    counts = values
    total = sum(counts)
    writer.add_histogram_raw(tag, min=0, max=len(values) - 1, num=total,
                             sum=sum(e * c for e, c in enumerate(counts)),
                             sum_squares=sum(e * e * c for e, c in enumerate(counts)),
                             bucket_limits=[e + 0.5 for e in range(len(values))], bucket_counts=counts,
                             global_step=step)


class LogBackends:
    """The open backends of a run (none, TensorBoard, W&B or both)."""

    def __init__(self, writer: Any = None, wandb_run: Any = None, tensorboard_dir: str | None = None):
        self.writer, self.wandb_run, self.tensorboard_dir = writer, wandb_run, tensorboard_dir

    @classmethod
    def open(cls, tc: TrainConfig, first_step: int) -> LogBackends:
        """Opens what the flags ask for; `first_step` is the step the run starts after (0, or the
        checkpoint's)."""
        writer = run = None
        if tc.tensorboard_dir is not None:
            SummaryWriter = _rank_import("torch.utils.tensorboard", "--tensorboard-dir",
                                         "'fmoe[tensorboard]'").SummaryWriter
            with _tensorboard_named(tc.tensorboard_dir):
                writer = SummaryWriter(log_dir=tc.tensorboard_dir, purge_step=first_step + 1, flush_secs=10)
        if tc.wandb_project is not None:
            wandb = _rank_import("wandb", "--wandb-project", "wandb")

            save_dir = tc.wandb_save_dir or (os.path.join(tc.save, "wandb") if tc.save else None)
            if save_dir is not None:
                os.makedirs(save_dir, exist_ok=True)
            run = wandb.init(project=tc.wandb_project, name=tc.wandb_exp_name, dir=save_dir,
                             config=tc.as_dict())
        return cls(writer, run, tc.tensorboard_dir)

    def log(self, metrics: dict[str, Any]) -> None:
        """Writes one step's scalars to every open backend, and with --moe-per-layer-logging each MoE
        layer's tokens per expert and expert bias as histograms (`per_expert`)."""
        if self.writer is None and self.wandb_run is None:
            return
        step, values = int(metrics["step"]), scalars(metrics)
        experts = per_expert(metrics)
        if self.writer is not None:
            with _tensorboard_named(self.tensorboard_dir):
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)
                for tag, counts in experts.items():
                    _tensorboard_bars(self.writer, tag, counts, step)
        if self.wandb_run is not None:
            import wandb

            bars = {tag: wandb.Histogram(np_histogram=(counts, list(range(len(counts) + 1))))
                    for tag, counts in experts.items()}
            self.wandb_run.log({**values, **bars}, step=step)

    def close(self) -> None:
        """Flushes and closes every open backend."""
        if self.writer is not None:
            writer, self.writer = self.writer, None
            with _tensorboard_named(self.tensorboard_dir):
                writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
