"""The learning-rate schedule of `fmoe train`: Megatron-LM's OptimizerParamScheduler as a pure function of
the step, so a resumed run needs no scheduler state.

    sched = LRSchedule.of(tc)            # a TrainConfig, or a checkpoint's recorded config (a dict)
    lr = sched.at(step)                  # step: 0-based, the steps done before this one

With n the steps done, W = lr_warmup_iters, D = lr_decay_iters (default: steps), exactly as Megatron's
`get_lr` with num_steps = n (megatron/core/optimizer_param_scheduler.py):
    warmup      W > 0 and n <= W:   lr_warmup_init + (lr - lr_warmup_init) * n / W
    constant    after the warmup:   lr
    after D     n > D:              min_lr
    inverse-square-root:            max(min_lr, lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))
    otherwise   r = (n - W) / (D - W), lr = min_lr + c * (lr - min_lr) with
                linear c = 1 - r, cosine c = (1 + cos(pi r)) / 2, WSD: c = 1 up to the anneal start
                A = D - Wd (Wd = lr_wsd_decay_iters), then with q = (n - A) / Wd by lr_wsd_decay_style:
                linear 1 - q, cosine (1 + cos(pi q)) / 2, exponential 2 * 0.5**q - 1, minus_sqrt 1 - sqrt(q).
So the first step of a run with warmup trains at lr_warmup_init (0), as Megatron's iteration 1 does, and the
LR reaches min_lr at n = D (the last step of a run with D = steps trains just above it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fmoe.train.config import TrainConfig

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
# what a pre-Megatron-schedule checkpoint recorded: `warmup` steps, then cosine to min_lr at `steps`
_OLD_DEFAULTS = {"lr_decay_style": "cosine", "lr_warmup_init": 0.0, "lr_decay_iters": None,
                 "lr_wsd_decay_iters": None, "lr_wsd_decay_style": "exponential"}


@dataclass(frozen=True)
class LRSchedule:
    """The schedule's values, resolved (decay_iters filled in from steps). Field names are the flags'."""

    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_iters: int
    lr_decay_style: str
    lr_warmup_init: float = 0.0
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"

    @classmethod
    def of(cls, config: Any) -> LRSchedule:
        """Returns the schedule of a TrainConfig or of a config dict (a checkpoint's `meta["config"]`; one
        written before these flags existed has `warmup` and means the cosine, so it resolves alike)."""
        c = config if isinstance(config, Mapping) else config.as_dict()
        get = lambda k: c[k] if k in c else _OLD_DEFAULTS[k]  # noqa: E731
        warmup = c["lr_warmup_iters"] if "lr_warmup_iters" in c else c.get("warmup", 0)
        decay = get("lr_decay_iters")
        return cls(lr=float(c["lr"]), min_lr=float(c["min_lr"]), lr_warmup_iters=int(warmup),
                   lr_decay_iters=int(c["steps"] if decay is None else decay),
                   lr_decay_style=get("lr_decay_style"), lr_warmup_init=float(get("lr_warmup_init")),
                   lr_wsd_decay_iters=get("lr_wsd_decay_iters"), lr_wsd_decay_style=get("lr_wsd_decay_style"))

    def at(self, step: int) -> float:
        """Returns the learning rate of the step after `step` steps (Megatron's get_lr, num_steps = step)."""
        n, W, D = step, self.lr_warmup_iters, self.lr_decay_iters
        if W > 0 and n <= W:
            return self.lr_warmup_init + (self.lr - self.lr_warmup_init) * float(n) / float(W)
        if self.lr_decay_style == "constant":
            return self.lr
        if n > D:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(self.min_lr, self.lr * max(W, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - W) / float(D - W)  # here W < n <= D, or W = 0 <= n <= D with D >= 1
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif self.lr_decay_style == "WSD":
            coeff = self._wsd(n)
        else:
            raise ValueError(f"unknown --lr-decay-style {self.lr_decay_style!r}")
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def _wsd(self, n: int) -> float:
        wd = self.lr_wsd_decay_iters or 0
        start = self.lr_decay_iters - wd  # the anneal starts here; before it the LR stays at lr
        if wd <= 0 or n <= start:
            return 1.0
        q = float(n - start) / float(wd)
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - q
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * q) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, q) - 1.0
        if style == "minus_sqrt":
            return 1.0 - math.sqrt(q)
        raise ValueError(f"unknown --lr-wsd-decay-style {style!r}")

    def compared(self) -> dict[str, Any]:
        """The values a resumed run must keep (the LR of a step depends on them): the WSD ones only for
        WSD, --lr-warmup-init only with a warmup, the decay ones not for constant."""
        out: dict[str, Any] = {"lr": self.lr, "lr_warmup_iters": self.lr_warmup_iters,
                               "lr_decay_style": self.lr_decay_style}
        if self.lr_warmup_iters > 0:
            out["lr_warmup_init"] = self.lr_warmup_init
        if self.lr_decay_style != "constant":
            out.update(min_lr=self.min_lr, lr_decay_iters=self.lr_decay_iters)
        if self.lr_decay_style == "WSD":
            out.update(lr_wsd_decay_iters=self.lr_wsd_decay_iters, lr_wsd_decay_style=self.lr_wsd_decay_style)
        return out


def schedule_problem(tc: TrainConfig) -> str | None:
    """One line saying what is wrong with the LR flags of TrainConfig `tc`, or None (checked before
    launch). Megatron's asserts, plus: a WSD anneal fits after the warmup, and the WSD flags need WSD."""
    s = LRSchedule.of(tc)
    if s.lr_decay_style not in DECAY_STYLES:
        return f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {s.lr_decay_style!r}"
    if s.lr_wsd_decay_style not in WSD_DECAY_STYLES:
        return (f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}, got "
                f"{s.lr_wsd_decay_style!r}")
    if s.lr_warmup_iters < 0:
        return f"--lr-warmup-iters must be >= 0, got {s.lr_warmup_iters}"
    if not 0 <= s.lr_warmup_init <= s.lr:
        return f"--lr-warmup-init must lie in [0, --lr {s.lr}], got {s.lr_warmup_init}"
    if tc.lr_decay_iters is not None:
        if tc.lr_decay_iters < 1:
            return f"--lr-decay-iters must be a positive integer, got {tc.lr_decay_iters}"
        if tc.lr_decay_iters <= s.lr_warmup_iters:  # Megatron asserts lr_warmup_steps < lr_decay_steps
            return (f"--lr-decay-iters ({tc.lr_decay_iters}) must exceed --lr-warmup-iters "
                    f"({s.lr_warmup_iters})")
    if s.lr_decay_style != "WSD":  # the WSD flags without WSD: fmoe.train.modifiers
        return None
    wd, room = s.lr_wsd_decay_iters, s.lr_decay_iters - s.lr_warmup_iters
    if wd is None:
        return "--lr-decay-style WSD needs --lr-wsd-decay-iters (the steps of the final anneal)"
    if not 1 <= wd <= room:
        return (f"--lr-wsd-decay-iters ({wd}) must lie in [1, {room}]: the anneal ends at --lr-decay-iters "
                f"({s.lr_decay_iters}, --steps unless given) and starts after the {s.lr_warmup_iters} warmup "
                "steps")
    return None
