"""Generators by name, for the CLI, the planner and `fmoe train`: build(name, pp, m, v) -> Schedule.

Legend: pp ranks, m microbatches, v model chunks per rank (the virtual pipeline size, Megatron's vpp).

Only the interleaved schedules take v; every other schedule holds a fixed number of chunks per rank
(`CHUNKS`), and `build` refuses another v for it rather than ignore it: a planner that priced zb_h1 at
vpp 4 would rank a layout no executor runs. `chunks_per_rank` is that rule alone.
"""

from __future__ import annotations

from fmoe.schedule.gen_1f1b import combined_1f1b, gpipe, interleaved_1f1b, one_f_one_b
from fmoe.schedule.gen_dualpipe import check_dualpipev_layers, dualpipe, dualpipev
from fmoe.schedule.gen_zb import zb_h1, zbv
from fmoe.schedule.ir import Schedule, ScheduleError

NAMES = ("gpipe", "1f1b", "interleaved", "interleaved+extra", "zb_h1", "zbv", "dualpipe", "dualpipev",
         "dualpipev+dw_detach")
SINGLE_RANK = ("combined_1f1b",)  # pp = 1 only
ALL_NAMES = NAMES + SINGLE_RANK

# model chunks per rank (the model is cut into pp x this many chunks); None: the interleaved schedules,
# which take v (default 2). DualPipe runs two copies of a pp-chunk cut: 1 (its memory counts the copy).
CHUNKS: dict[str, int | None] = {
    "gpipe": 1, "1f1b": 1, "interleaved": None, "interleaved+extra": None, "zb_h1": 1, "zbv": 2,
    "dualpipe": 1, "dualpipev": 2, "dualpipev+dw_detach": 2, "combined_1f1b": 1,
}
DEFAULT_V = 2  # the interleaved schedules' v when none is given


def chunks_per_rank(name: str, v: int | None = None) -> int:
    """Returns the model chunks per rank schedule `name` runs with `v` (None: its own; the interleaved
    ones: DEFAULT_V). ScheduleError for an unknown name, or a v the schedule does not run."""
    if name not in CHUNKS:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(ALL_NAMES)}")
    fixed = CHUNKS[name]
    if fixed is None:
        return DEFAULT_V if v is None else v
    if v is not None and v != fixed:
        takes = ", ".join(n for n, c in CHUNKS.items() if c is None)
        raise ScheduleError(f"{name} holds {fixed} model chunk{'s' if fixed > 1 else ''} per rank, not "
                            f"vpp {v} (only {takes} take a virtual pipeline size)")
    return fixed


# schedules with a rule on the model's transformer layers (the others cut any count into their chunks)
LAYER_RULES = {"dualpipev": check_dualpipev_layers, "dualpipev+dw_detach": check_dualpipev_layers}


def check_layers(name: str, pp: int, layers: int) -> None:
    """Raises ScheduleError when `layers` transformer layers break schedule `name`'s own layer rule
    (DualPipeV: at least 2pp and a multiple of 2pp); the rule `build(..., layers=)` applies, without
    generating the schedule (the planner checks thousands of layouts)."""
    rule = LAYER_RULES.get(name)
    if rule is not None:
        rule(pp, layers)


def build(name: str, pp: int, m: int, v: int | None = None, *, layers: int | None = None) -> Schedule:
    """Returns the schedule called `name` (one of ALL_NAMES) for pp ranks and m microbatches, with v
    chunks per rank for the interleaved ones (`chunks_per_rank`: another v for the others is refused).
    `layers`: the model's transformer layers, checked against the rule of a schedule that has one
    (DualPipeV: at least 2pp and a multiple of 2pp, seed 001); None checks nothing."""
    v = chunks_per_rank(name, v)
    table = {
        "gpipe": lambda: gpipe(pp, m),
        "1f1b": lambda: one_f_one_b(pp, m),
        "interleaved": lambda: interleaved_1f1b(pp, m, v),
        "interleaved+extra": lambda: interleaved_1f1b(pp, m, v, extra_warmup=True),
        "zb_h1": lambda: zb_h1(pp, m),
        "zbv": lambda: zbv(pp, m),
        "dualpipe": lambda: dualpipe(pp, m),
        "dualpipev": lambda: dualpipev(pp, m, layers=layers),
        "dualpipev+dw_detach": lambda: dualpipev(pp, m, dw_detach=True, layers=layers),
        "combined_1f1b": lambda: combined_1f1b(m),
    }
    if name in SINGLE_RANK and pp != 1:
        raise ScheduleError(f"{name} runs on one pipeline rank (pp = 1), got pp={pp}")
    return table[name]()
