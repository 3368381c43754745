"""The `--save` directory belongs to one run: checked before launch, locked while the run lives.

    problem = check(save, resume=..., overwrite=..., load=...)  # None, or one line (before launch)
    handle = claim(save, resume=..., overwrite=..., load=...)   # the lock, held until handle.close()

Refused, each with one line: a fresh run (no --resume) whose --save holds checkpoints (another run's:
its saves would replace that run's steps and move `latest` back, and a later --resume would continue a
mix) unless --overwrite-save, which deletes them first; --resume where --save is absent or holds no
complete checkpoint (Megatron's --load starts afresh then; --resume asks to continue, so a typo must
not silently restart); a second run on a locked directory.

The lock is fcntl.flock on DIR/.fmoe-train.lock (fmoe/train/run_lock.py: the rule for every file a run
owns), taken by the process that outlives every rank of the job and that a second job's launcher meets
first: `fmoe train`'s own launcher when it spawns the ranks (a second one fails before it starts any),
global rank 0 under torchrun (the rank that moves `latest`). One lock per job, not per rank: the ranks of
one job share the directory. The kernel drops it when the holder dies, so a killed run leaves no stale
lock. The file holds the holder's pid and host, for the message. On NFS flock needs working NFS locks
(v4); on a file system without them it fails loudly.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path
from typing import TextIO

from fmoe.train.checkpoint import latest
from fmoe.train.run_errors import CheckpointError
from fmoe.train.run_lock import Busy, hold

LOCK = ".fmoe-train.lock"
# what a save writes into --save (the leftovers of a crashed save included); other files are not ours
_OURS = re.compile(r"(step_\d+(\.partial)?|latest|\.latest\.tmp)$")


def _ours(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if _OURS.match(p.name))


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root + os.sep)


def check(save: str | None, *, resume: bool, overwrite: bool, load: str | None) -> str | None:
    """Returns one line saying why this run must not use `save`, or None."""
    if save is None:
        return None
    root = Path(save)
    if root.exists() and not root.is_dir():
        return f"--save {save} is not a directory"
    if resume and overwrite:
        return "give --resume (continue the run in --save) or --overwrite-save (replace it), not both"
    if resume:
        if not root.is_dir():
            return (f"--resume: no such directory {save} (--save names the run to continue; leave out "
                    "--resume to start a fresh run)")
        if latest(root) is None:
            return f"--resume: no complete checkpoint in {save} (leave out --resume to start a fresh run)"
        return None
    found = _ours(root) if root.is_dir() else []
    if not found:
        return None
    if overwrite and load is not None and _inside(load, save):
        return f"--overwrite-save would delete --load {load} before it is read: give --resume to continue it"
    if not overwrite:
        last = latest(root)
        what = f"latest {last.name}" if last is not None else ", ".join(found[:3])
        return (f"--save {save} already holds checkpoints ({what}): give --resume to continue that run, "
                "--overwrite-save to delete them and start afresh, or another --save")
    return None


def clear(save: str) -> None:
    """Deletes what saves wrote into `save` (step_* directories, partial ones, `latest`); a symlink is
    removed itself, never followed; other files stay."""
    root = Path(save)
    for name in _ours(root):
        path = root / name
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()


def lock(save: str) -> TextIO:
    """Takes the exclusive lock of `save` (created if absent; fmoe.train.run_lock.hold, the rule every file
    of a run follows); returns the open lock file (closing it, or the process ending, releases the lock).
    CheckpointError naming the holder when another run has it."""
    os.makedirs(save, exist_ok=True)
    try:
        return hold(os.path.join(save, LOCK), f"--save {save}", keep_holder=True)
    except Busy as exc:
        raise CheckpointError(str(exc).replace("one run per file", "one run per directory")) from None
    except OSError as exc:
        raise CheckpointError(f"--save {save}: cannot open its lock file: {exc}") from None


def claim(save: str, *, resume: bool, overwrite: bool, load: str | None) -> TextIO:
    """Locks `save`, checks it again (another run may have written there since the check before launch)
    and, with --overwrite-save, clears it; returns the lock file. CheckpointError when refused."""
    handle = lock(save)
    try:
        problem = check(save, resume=resume, overwrite=overwrite, load=load)
        if problem is not None:
            raise CheckpointError(problem)
        if overwrite:
            clear(save)
    except BaseException:
        handle.close()
        raise
    return handle
