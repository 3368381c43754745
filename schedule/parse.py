"""Parse the printed form of actions and schedules back into values: parse(str(x)) == x.

Grammar (INT = 0 | [1-9][0-9]*, so every text has one spelling and str(parse(text)) == text):
  schedule := line per rank, in rank order; blank lines are skipped
  line     := "r" RANK ":" action*          actions separated by whitespace
  action   := op | op "&" op                 an Overlap: forward & backward (B or I)
            | "s" WHAT STAGE "." MB ">r" PEER | "r" WHAT STAGE "." MB "<r" PEER   Send / Recv
  op       := KIND STAGE "." MB             KIND in F B I W
  WHAT     := "a" (activation) | "g" (input grad)
The printed schedule lists only the rank lines, so the placement is an argument; the microbatch count
and each microbatch's path follow from the text unless given.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from fmoe.schedule.ir import ACT, GRAD, Action, Op, Overlap, Placement, Recv, Schedule, ScheduleError, Send

_INT = r"(0|[1-9][0-9]*)"
_OP = re.compile(rf"([FBIW]){_INT}\.{_INT}")
_MSG = re.compile(rf"([sr])([ag]){_INT}\.{_INT}([<>])r{_INT}")
_WHAT = {"a": ACT, "g": GRAD}
_FORMS = "F|B|I|W<stage>.<mb>, <F op>&<B|I op>, s{a|g}<stage>.<mb>>r<peer> or r{a|g}<stage>.<mb><r<peer>"


def _bad(token: str, where: str, why: str = f"expected {_FORMS}") -> ScheduleError:
    return ScheduleError(f"malformed action {token!r} at {where}: {why}")


def _op(token: str, where: str) -> Op:
    m = _OP.fullmatch(token)
    if not m:
        raise _bad(token, where)
    return Op(m[1], int(m[2]), int(m[3]))


def _action(token: str, col: int, where: str) -> Action:
    # `col`: 1-based column of `token`; `where` prefixes it ("line 2, " or "") in messages
    if "&" in token:
        left, _, right = token.partition("&")
        f = _op(left, f"{where}column {col}")
        b = _op(right, f"{where}column {col + len(left) + 1}")
        try:
            return Overlap(f, b)
        except ScheduleError as e:
            raise _bad(token, f"{where}column {col}", str(e)) from None
    m = _MSG.fullmatch(token)
    if m:
        direction, what, stage, mb, arrow, peer = m.groups()
        if (direction == "s") != (arrow == ">"):
            raise _bad(token, f"{where}column {col}", "a send is s...>r<peer>, a receive r...<r<peer>")
        cls = Send if direction == "s" else Recv
        return cls(_WHAT[what], int(stage), int(mb), int(peer))
    return _op(token, f"{where}column {col}")


def parse_action(text: str) -> Action:
    """Returns the Action whose str() is `text` (an Op, Overlap, Send or Recv); ScheduleError naming
    the bad token and its 1-based column otherwise."""
    return _action(text, 1, "")


def _infer_path(placement: Placement, stages: set[int]) -> int:
    # the first path that visits every stage the microbatch appears on; else 0, and verify reports the
    # stage it does not visit
    return next((k for k, p in enumerate(placement.paths) if stages <= set(p)), 0)


def parse_schedule(text: str, placement: Placement, *, name: str = "parsed", m: int | None = None,
                   mb_path: Sequence[int] | None = None) -> Schedule:
    """Returns the Schedule whose str() is `text`, on `placement`, called `name`: one line
    `r<k>: action ...` per rank k in order (see the module grammar). `m` defaults to the largest
    microbatch id + 1, `mb_path[mb]` to the first path visiting every stage mb appears on. Raises
    ScheduleError naming the bad token and its line and column. Checks only the syntax: run `verify`."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if len(lines) != placement.pp:
        raise ScheduleError(f"expected {placement.pp} rank lines (placement pp={placement.pp}), "
                            f"got {len(lines)}")
    ranks = []
    for r, (n, line) in enumerate(lines):
        tokens = [(t.start() + 1, t.group()) for t in re.finditer(r"\S+", line)]
        col, label = tokens[0]
        if label != f"r{r}:":
            raise ScheduleError(f"malformed rank label {label!r} at line {n}, column {col}: expected 'r{r}:'")
        ranks.append(tuple(_action(tok, c, f"line {n}, ") for c, tok in tokens[1:]))
    seen: dict[int, set[int]] = {}  # mb -> stages it appears on
    for acts in ranks:
        for a in acts:
            for x in a.ops if isinstance(a, Overlap) else (a,):
                seen.setdefault(x.mb, set()).add(x.stage)
    m = max(seen, default=-1) + 1 if m is None else m
    if mb_path is None:
        mb_path = [_infer_path(placement, seen.get(j, set())) for j in range(m)]
    return Schedule(name, placement, m, tuple(mb_path), tuple(ranks))
