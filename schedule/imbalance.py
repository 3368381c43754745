"""Stage imbalance (feature 23): extra cost on the first/last stage (embedding, loss, MTP) and a layer
placement that evens per-rank cost.

Legend: S stages, L layers; costs in units of one transformer layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

from fmoe.schedule.ir import Placement, ScheduleError


@dataclass(frozen=True)
class LayerPlacement:
    """`layers[s]` layers on stage s; `rank_cost[r]` its total cost; `imbalance_pct` = (max/mean-1)*100."""

    layers: tuple[int, ...]
    rank_cost: tuple[float, ...]
    imbalance_pct: float


def _check_extra(name: str, x: object) -> None:
    """Raises ScheduleError unless `x` is a finite real >= 0 (nan / inf / negative would bias placement)."""
    if not isinstance(x, Real) or isinstance(x, bool) or not math.isfinite(x):
        raise ScheduleError(f"{name} must be a finite number >= 0, got {x!r}")
    if x < 0:
        raise ScheduleError(f"{name} must be >= 0, got {x!r}")


def _check_count(name: str, x: object) -> None:
    """Raises ScheduleError unless `x` is an int >= 0."""
    if not isinstance(x, Integral) or isinstance(x, bool) or x < 0:
        raise ScheduleError(f"{name} must be an int >= 0, got {x!r}")


def stage_costs(placement: Placement, layers: tuple[int, ...], first_extra: float = 0.0,
                last_extra: float = 0.0) -> tuple[float, ...]:
    """Returns per-stage cost [S]: its layers + `first_extra` on stage 0 + `last_extra` on the last.
    Raises ScheduleError unless both extras are finite numbers >= 0."""
    _check_extra("first_extra", first_extra)
    _check_extra("last_extra", last_extra)
    if len(layers) != placement.num_stages:
        raise ScheduleError(f"{len(layers)} layer counts for {placement.num_stages} stages")
    last = placement.num_stages - 1
    return tuple(n + (first_extra if s == 0 else 0.0) + (last_extra if s == last else 0.0)
                 for s, n in enumerate(layers))


def rank_costs(placement: Placement, layers: tuple[int, ...], first_extra: float = 0.0,
               last_extra: float = 0.0) -> tuple[float, ...]:
    """Returns per-rank cost [pp]: the `stage_costs` of the stages the rank holds, summed."""
    cost = [0.0] * placement.pp
    for s, c in enumerate(stage_costs(placement, layers, first_extra, last_extra)):
        cost[placement.stage_rank[s]] += c
    return tuple(cost)


def even_layers(placement: Placement, num_layers: int, min_layers: int = 0) -> tuple[int, ...]:
    """Returns `num_layers` split as evenly as possible over the stages [S] (earlier stages get the
    remainder); raises ScheduleError when a stage would get fewer than `min_layers`."""
    n = placement.num_stages
    if num_layers < n * min_layers:
        raise ScheduleError(f"{num_layers} layers cannot give {min_layers} to each of {n} stages")
    return tuple(num_layers // n + (1 if s < num_layers % n else 0) for s in range(n))


def imbalance_pct(costs: tuple[float, ...]) -> float:
    """Returns (max / mean - 1) * 100 of `costs` (0 for perfectly even)."""
    mean = sum(costs) / len(costs)
    return (max(costs) / mean - 1.0) * 100.0 if mean else 0.0


def place_layers(placement: Placement, num_layers: int, first_extra: float = 0.0, last_extra: float = 0.0,
                 min_layers: int = 0) -> LayerPlacement:
    """Returns a LayerPlacement of `num_layers` over the stages that minimises the costliest rank
    (local search from the even split, moving one layer from the costliest rank's stage to the
    cheapest rank's stage while that lowers the pair's maximum), at least `min_layers` per stage.
    Raises ScheduleError unless the extras are finite numbers >= 0 and the layer counts ints >= 0."""
    _check_extra("first_extra", first_extra)
    _check_extra("last_extra", last_extra)
    _check_count("num_layers", num_layers)
    _check_count("min_layers", min_layers)
    layers = list(even_layers(placement, num_layers, min_layers))
    while True:
        cost = rank_costs(placement, tuple(layers), first_extra, last_extra)
        hi = max(range(placement.pp), key=lambda r: cost[r])
        lo = min(range(placement.pp), key=lambda r: cost[r])
        src = [s for s in placement.stages_of(hi) if layers[s] > min_layers]
        dst = placement.stages_of(lo)
        if hi == lo or not src or not dst or max(cost[hi] - 1, cost[lo] + 1) >= cost[hi]:
            break
        layers[max(src, key=lambda s: layers[s])] -= 1
        layers[min(dst, key=lambda s: layers[s])] += 1
    cost = rank_costs(placement, tuple(layers), first_extra, last_extra)
    return LayerPlacement(tuple(layers), cost, imbalance_pct(cost))
