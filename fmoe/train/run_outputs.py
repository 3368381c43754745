"""The files a run writes besides its checkpoints: --metrics, --loss-curve, --trace and the trace's PNG.
Each is the run's own, as --save is: no two on one path, none on a file of --save or a logging folder
(checked before launch), and each locked while the run lives (fmoe/train/run_lock.py, --save's rule).

    problem = clash(tc)      # None, or one line: two outputs on one path, or an output on --save's files
    held = claim(tc)         # Held: the locks; held.release() when the run ends

A second run given a live run's metrics file fails at claim, before it starts a rank, and leaves that
file as it was (it is opened without truncating; the run truncates it only once the lock is its own).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from fmoe.train.run_errors import RunError
from fmoe.train.run_lock import Busy, hold

if TYPE_CHECKING:
    from fmoe.train.config import TrainConfig

# what a save writes into --save (fmoe/train/save_dir.py's entries and lock): an output there would be
# overwritten by the next save, or overwrite it
_SAVE_ENTRY = re.compile(r"(step_\d+(\.partial)?|latest|\.latest\.tmp|\.fmoe-train\.lock)$")


def output_files(tc: TrainConfig) -> dict[str, str]:
    """The files the run writes besides checkpoints: what the user gave (e.g. "--metrics") -> path."""
    out = {f"--{name.replace('_', '-')}": getattr(tc, name) for name in ("metrics", "loss_curve", "trace")
           if getattr(tc, name)}
    if tc.trace:
        out["--trace's PNG"] = str(Path(tc.trace).with_suffix(".png"))
    return out


def _folders(tc: TrainConfig) -> dict[str, str]:
    names = {"--save": tc.save, "--tensorboard-dir": tc.tensorboard_dir,
             "--wandb-save-dir": tc.wandb_save_dir}
    return {flag: path for flag, path in names.items() if path}


def clash(tc: TrainConfig) -> str | None:
    """One line naming the first output that shares its path with another output, is a folder of the
    run (--save, --tensorboard-dir) or one of --save's checkpoint entries (latest, step_N); else None."""
    seen: dict[str, str] = {}
    folders = {os.path.realpath(p): flag for flag, p in _folders(tc).items()}
    save = os.path.realpath(tc.save) if tc.save else None
    for what, path in output_files(tc).items():
        real = os.path.realpath(path)
        if real in seen:
            return (f"{what} {path} is also {seen[real]}'s file: one would overwrite the other; give each "
                    "output its own path")
        if real in folders:
            return f"{what} {path} is the {folders[real]} folder: give a file path"
        if save is not None and os.path.dirname(real) == save and _SAVE_ENTRY.match(os.path.basename(real)):
            return (f"{what} {path} is a checkpoint entry of --save {tc.save}: the next save would overwrite "
                    "it; give another path")
        if os.path.isdir(real):
            return f"{what} {path} is a directory: give a file path"
        seen[real] = what
    return None


@dataclass
class Held:
    """The locks on a run's outputs; `created`: files the claim made (removed if the run left them empty,
    so a run that failed early leaves no empty PNG behind)."""

    handles: list[TextIO] = field(default_factory=list)
    created: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Drops the locks (and the empty files the claim created)."""
        for path in self.created:
            if os.path.isfile(path) and os.path.getsize(path) == 0:
                os.unlink(path)
        for handle in self.handles:
            handle.close()
        self.handles, self.created = [], []


def claim(tc: TrainConfig) -> Held:
    """Locks every output file of `tc` (their folders made); returns the held locks. RunError in one line
    when another live run holds one (nothing of it is changed) or a file cannot be opened."""
    held = Held()
    try:
        for what, path in output_files(tc).items():
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            existed = os.path.exists(path)
            held.handles.append(hold(path, f"{what} {path}", keep_holder=False))
            if not existed:
                held.created.append(path)
    except (Busy, OSError) as exc:
        held.release()
        raise RunError(str(exc)) from None
    return held
