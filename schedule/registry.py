"""Generators by name, for the CLI and benchmarks: build(name, pp, m, v) -> Schedule.

Legend: pp ranks, m microbatches, v chunks per rank (only the interleaved schedules use it).
"""

from __future__ import annotations

from fmoe.schedule.gen_1f1b import combined_1f1b, gpipe, interleaved_1f1b, one_f_one_b
from fmoe.schedule.gen_dualpipe import dualpipe, dualpipev
from fmoe.schedule.gen_zb import zb_h1, zbv
from fmoe.schedule.ir import Schedule, ScheduleError

NAMES = ("gpipe", "1f1b", "interleaved", "interleaved+extra", "zb_h1", "zbv", "dualpipe", "dualpipev",
         "dualpipev+dw_detach")
SINGLE_RANK = ("combined_1f1b",)  # pp = 1 only
ALL_NAMES = NAMES + SINGLE_RANK


def build(name: str, pp: int, m: int, v: int = 2) -> Schedule:
    """Returns the schedule called `name` (one of ALL_NAMES) for pp ranks and m microbatches."""
    table = {
        "gpipe": lambda: gpipe(pp, m),
        "1f1b": lambda: one_f_one_b(pp, m),
        "interleaved": lambda: interleaved_1f1b(pp, m, v),
        "interleaved+extra": lambda: interleaved_1f1b(pp, m, v, extra_warmup=True),
        "zb_h1": lambda: zb_h1(pp, m),
        "zbv": lambda: zbv(pp, m),
        "dualpipe": lambda: dualpipe(pp, m),
        "dualpipev": lambda: dualpipev(pp, m),
        "dualpipev+dw_detach": lambda: dualpipev(pp, m, dw_detach=True),
        "combined_1f1b": lambda: combined_1f1b(m),
    }
    if name in SINGLE_RANK and pp != 1:
        raise ScheduleError(f"{name} runs on one pipeline rank (pp = 1), got pp={pp}")
    if name not in table:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(ALL_NAMES)}")
    return table[name]()
