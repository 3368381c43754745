"""A schedule written in a file: the printed form (`str(schedule)`, read by fmoe.schedule.parse) with
the placement read off the text, so the file alone says what runs.

Legend: pp ranks (the file's rank lines), S stages, m microbatches (the largest id + 1).

    s = load_schedule("my_1f1b.txt")      # parsed, not verified: run `verify(s)`
    assert load_schedule_text(str(s)) == dataclasses.replace(s, name="schedule")

The text is `parse_schedule`'s (one line `r<k>: action ...` per rank k); a `#` starts a comment that
runs to the end of its line (the grammar has no `#`), so a file may explain itself. The placement is the
first of loop(pp), interleaved(pp, v) (v = S / pp, v >= 2), vshape(pp) and bidirectional(pp) (the
placements of `fmoe.schedule.stages`, which the executor and the model cut know) that
  1. places every stage the text names on the rank whose line names it, and
  2. has a path visiting exactly the stages of each microbatch;
else the first that fulfils 1 (verify then names the microbatch that misses a stage), else a
ScheduleError naming the stages each rank holds. vshape and bidirectional place stages alike and differ
in 2: a V microbatch visits all 2pp stages, a DualPipe one the pp stages of one copy. Each microbatch's
path is the first visiting every stage it appears on (`parse_schedule`'s rule).
"""

from __future__ import annotations

import os

from fmoe.schedule import stages
from fmoe.schedule.ir import Placement, Schedule, ScheduleError, ops_of
from fmoe.schedule.parse import parse_schedule

COMMENT = "#"


def strip_comments(text: str) -> str:
    """Returns `text` with every `#` and the rest of its line removed (lines kept, so line and column
    numbers in parse errors stay those of the file)."""
    return "\n".join(line.split(COMMENT, 1)[0] for line in text.splitlines())


def _candidates(pp: int, num_stages: int) -> list[Placement]:
    out = [stages.loop(pp)]
    if num_stages > pp and num_stages % pp == 0:
        out.append(stages.interleaved(pp, num_stages // pp))
    return out + [stages.vshape(pp), stages.bidirectional(pp)]


def infer_placement(s: Schedule) -> Placement:
    """Returns the placement `s`'s text implies (see the module rules), read from where its ops are:
    `s.placement` is ignored but for pp. Raises ScheduleError naming each rank's stages when no
    placement of `fmoe.schedule.stages` puts them there."""
    held: dict[int, set[int]] = {}  # rank -> stages its ops run
    visits: dict[int, set[int]] = {}  # mb -> stages it appears on
    for r, acts in enumerate(s.ranks):
        for a in acts:
            for op in ops_of(a):
                held.setdefault(r, set()).add(op.stage)
                visits.setdefault(op.mb, set()).add(op.stage)
    num_stages = 1 + max((st for sts in held.values() for st in sts), default=0)
    fits = [p for p in _candidates(s.pp, num_stages)
            if all(st < p.num_stages and p.stage_rank[st] == r for r, sts in held.items() for st in sts)]
    if not fits:
        where = "; ".join(f"r{r}: {' '.join(map(str, sorted(held.get(r, ()))))}" for r in range(s.pp))
        raise ScheduleError(f"{s.name}: no placement puts the stages where the text runs them ({where}); "
                            f"the placements are loop (stage s on rank s), interleaved (s on rank s % pp), "
                            f"vshape and bidirectional (rank r holds r and 2pp-1-r)")
    exact = [p for p in fits if all(any(v == set(path) for path in p.paths) for v in visits.values())]
    return (exact or fits)[0]


def load_schedule_text(text: str, name: str = "schedule") -> Schedule:
    """Returns the Schedule written in `text` (comments allowed), called `name`, on the placement the
    text implies (`infer_placement`). Raises ScheduleError, prefixed by `name`, for text that does not
    parse (naming the token, line and column) or fits no placement. Checks only the syntax: run
    `verify`."""
    bare = strip_comments(text)
    pp = sum(1 for line in bare.splitlines() if line.strip())
    if pp == 0:
        raise ScheduleError(f"{name}: no rank lines (one 'r<k>: action ...' line per pipeline rank)")
    try:
        first = parse_schedule(bare, stages.loop(pp), name=name)
        placement = infer_placement(first)
        return first if placement == first.placement else parse_schedule(bare, placement, name=name)
    except ScheduleError as exc:
        text = str(exc)
        raise ScheduleError(text if text.startswith(f"{name}: ") else f"{name}: {text}") from None


def load_schedule(path: str | os.PathLike[str]) -> Schedule:
    """Returns the Schedule written in the file at `path` (`load_schedule_text`), called by the path as
    given. Raises ScheduleError for a file that cannot be read (with the system's reason), does not parse
    or fits no placement, one line naming the path."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ScheduleError(f"{os.fspath(path)}: cannot read the schedule file: {why}") from None
    return load_schedule_text(text, os.fspath(path))
