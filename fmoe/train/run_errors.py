"""`RunError`: a failure that every rank of `fmoe train` meets alike and that one line explains (ranks
started with different inputs, an fp16 run that cannot go on); `CheckpointError`, one for a checkpoint.
The launcher prints either as `fmoe train: error: ...` and exits 1, instead of a traceback per rank."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run-wide failure; its message is one line."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded (missing, another model, damaged, unsafe); its message
    is one line (newlines folded), what `fmoe train` prints."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))


def raised_run_error(traceback_text: str) -> str | None:
    """The message of a RunError that ended a spawned rank (the last line of its formatted traceback),
    else None."""
    lines = traceback_text.rstrip().splitlines()
    prefix = f"{RunError.__module__}.{RunError.__name__}: "
    return lines[-1][len(prefix):] if lines and lines[-1].startswith(prefix) else None
