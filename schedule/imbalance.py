"""Stage imbalance (feature 23): extra cost on the first/last stage (embedding, loss, MTP) and a layer
placement that evens per-rank cost.

Legend: S stages, L layers; costs in units of one transformer layer (`place_layers`), or in any unit
shared by the per-layer costs and the extras (`balance_layers`: dense and MoE layers may differ).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

from fmoe.schedule.ir import Placement, ScheduleError


@dataclass(frozen=True)
class LayerPlacement:
    """`layers[s]` layers on stage s; `rank_cost[r]` its total cost; `imbalance_pct` = (max/mean-1)*100."""

    layers: tuple[int, ...]
    rank_cost: tuple[float, ...]
    imbalance_pct: float
    exact: bool = True  # False: `balance_layers` ran out of its search budget (best found, not proven)


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


def cost_rank_costs(placement: Placement, layer_costs: Sequence[float], layers: tuple[int, ...],
                    first_extra: float = 0.0, last_extra: float = 0.0) -> tuple[float, ...]:
    """Returns per-rank cost [pp] of cutting the layers (costs `layer_costs` [L], in order) into
    consecutive chunks of `layers[s]` on stage s, plus the extras on the first and last stage."""
    if len(layers) != placement.num_stages or sum(layers) != len(layer_costs):
        raise ScheduleError(f"layer counts {layers} do not cut {len(layer_costs)} layers into "
                            f"{placement.num_stages} stages")
    cost, start, last = [0.0] * placement.pp, 0, placement.num_stages - 1
    for s, n in enumerate(layers):
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == last else 0.0)
        cost[placement.stage_rank[s]] += sum(layer_costs[start:start + n]) + extra
        start += n
    return tuple(cost)


def balance_layers(placement: Placement, layer_costs: Sequence[float], first_extra: float = 0.0,
                   last_extra: float = 0.0, min_layers: int | Sequence[int] = 1,
                   budget: int = 2_000) -> LayerPlacement:
    """Returns the LayerPlacement of the layers (costs `layer_costs` [L], in model order) cut into
    consecutive chunks, one per stage in stage order, at least `min_layers` each (or `min_layers[s]` on
    stage s), that minimises the costliest rank (a rank sums the chunks it holds; `first_extra` goes to
    stage 0, `last_extra` to the last). Exact (branch and bound over the cuts); past `budget` search
    nodes it returns the best cut found with `exact=False`. Raises ScheduleError on bad numbers or too
    few layers."""
    _check_extra("first_extra", first_extra)
    _check_extra("last_extra", last_extra)
    L, S, pp = len(layer_costs), placement.num_stages, placement.pp
    mins = (min_layers,) * S if isinstance(min_layers, Integral) else tuple(min_layers)
    if len(mins) != S:
        raise ScheduleError(f"{len(mins)} minimum layer counts for {S} stages")
    for m in mins:
        _check_count("min_layers", m)
    for i, c in enumerate(layer_costs):
        _check_extra(f"layer_costs[{i}]", c)
    if L < sum(mins):
        what = f"{min_layers} to each of" if isinstance(min_layers, Integral) else f"{mins} to the"
        raise ScheduleError(f"{L} layers cannot give {what} {S} stages")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    extra = [(first_extra if s == 0 else 0.0) + (last_extra if s == S - 1 else 0.0) for s in range(S)]
    rank_of = placement.stage_rank
    # stages still to come per rank after stage s: whose cost can still grow
    later = [sorted({rank_of[t] for t in range(s + 1, S)}) for s in range(S)]
    chunks_left = [[sum(1 for t in range(s, S) if rank_of[t] == r) for r in range(pp)] for s in range(S)]
    total = prefix[L] + sum(extra)
    mean = total / pp
    eps = 1e-9 * max(total, 1e-300)

    def fill(bound: float) -> tuple[int, ...] | None:
        """A cut with every rank under `bound`, taking each chunk its rank's share of the room left
        (all of it on the rank's last chunk), or None where that greedy fails."""
        cost, pos, out = [0.0] * pp, 0, []
        for s in range(S):
            r, hi = rank_of[s], L - sum(mins[s + 1:])
            share = (bound - cost[r]) / chunks_left[s][r] - extra[s]
            k = L - pos if s == S - 1 else mins[s]
            while s < S - 1 and pos + k < hi and prefix[pos + k + 1] - prefix[pos] <= share:
                k += 1
            cost[r] += prefix[pos + k] - prefix[pos] + extra[s]
            if cost[r] > bound:
                return None
            out.append(k)
            pos += k
        return tuple(out)

    # the incumbent: the even split, or the greedy fill under the least bound it meets (bisection)
    start = even_layers(placement, L)
    best_layers, best = start, math.inf
    if all(n >= m for n, m in zip(start, mins)):
        best = max(cost_rank_costs(placement, layer_costs, start, first_extra, last_extra))
    lo, hi_bound = mean, total
    for _ in range(40):
        mid = (lo + hi_bound) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi_bound = mid
            top = max(cost_rank_costs(placement, layer_costs, got, first_extra, last_extra))
            if top < best:
                best, best_layers = top, got
    seen: dict[tuple, float] = {}
    nodes = 0
    cuts = [0] * S

    def search(s: int, pos: int, cost: list[float], done_max: float) -> None:
        """Extends the cut from stage s at layer `pos`, updating `best` when a cheaper cut is found."""
        nonlocal best, best_layers, nodes
        nodes += 1
        if nodes > budget or best <= mean + eps:
            return
        key = (s, pos, tuple(round(cost[r], 9) for r in later[s - 1]) if s else ())
        if seen.get(key, math.inf) <= done_max:  # explored with no costlier finished rank, under a bound
            return  # at least as loose: nothing better below
        seen[key] = done_max
        r = rank_of[s]
        hi = L - sum(mins[s + 1:])
        if s == S - 1:
            ks = [L - pos]
        elif r not in later[s]:
            # the rank's last chunk: the most that fits leaves the least to the others
            ks = list(range(hi - pos, mins[s] - 1, -1))
        else:
            # try first the share that brings this rank to the mean over its remaining chunks
            want = (mean - cost[r]) / chunks_left[s][r] - extra[s]
            ks = sorted(range(mins[s], hi - pos + 1),
                        key=lambda k: abs(prefix[pos + k] - prefix[pos] - want))
        for k in ks:
            new = cost[r] + prefix[pos + k] - prefix[pos] + extra[s]
            if new >= best - eps:
                continue
            cost[r], old = new, cost[r]
            cuts[s] = k
            if s == S - 1:
                best, best_layers = max(done_max, *cost), tuple(cuts)
            else:
                # what is left must fit under the bound on the ranks that still get chunks
                rest = prefix[L] - prefix[pos + k] + sum(extra[s + 1:])
                room = sum(best - eps - cost[q] for q in later[s])
                if rest <= room:
                    search(s + 1, pos + k, cost, done_max if r in later[s] else max(done_max, new))
            cost[r] = old

    search(0, 0, [0.0] * pp, 0.0)
    exact = nodes <= budget
    if not exact:
        best_layers = _polish(placement, layer_costs, best_layers, first_extra, last_extra, mins)
    cost = cost_rank_costs(placement, layer_costs, best_layers, first_extra, last_extra)
    return LayerPlacement(best_layers, cost, imbalance_pct(cost), exact=exact)


def _polish(placement: Placement, layer_costs: Sequence[float], layers: tuple[int, ...],
            first_extra: float, last_extra: float, mins: tuple[int, ...]) -> tuple[int, ...]:
    """Returns `layers` after moving single cut points by one layer while that lowers the rank costs
    sorted from the costliest (lexicographically: the max, then the next, so plateaus are left)."""
    def key(counts: tuple[int, ...]) -> tuple[float, ...]:
        return tuple(sorted(cost_rank_costs(placement, layer_costs, counts, first_extra, last_extra),
                            reverse=True))

    cur, cur_key = list(layers), key(layers)
    improved = True
    while improved:
        improved = False
        for s in range(1, len(cur)):  # the cut point between stages s-1 and s
            for d in (1, -1):  # one layer from stage s to s-1, or back
                if cur[s] - d < mins[s] or cur[s - 1] + d < mins[s - 1]:
                    continue
                cur[s - 1] += d
                cur[s] -= d
                k = key(tuple(cur))
                if k < cur_key:
                    cur_key, improved = k, True
                else:
                    cur[s - 1] -= d
                    cur[s] += d
    return tuple(cur)


# A stage without layers still costs its host work and a P2P hop that the layer costs do not price: a
# cut takes one only when it lowers the modelled imbalance by at least EMPTY_STAGE_GAIN_PCT points, and
# only for an end stage whose extra is worth EMPTY_STAGE_MIN_EXTRA mean layers (the head + loss + MTP;
# an embedding alone would be a stage that only passes its rows on).
EMPTY_STAGE_GAIN_PCT = 1.0
EMPTY_STAGE_MIN_EXTRA = 0.5


def balance_layers_or_empty(placement: Placement, layer_costs: Sequence[float], first_extra: float = 0.0,
                            last_extra: float = 0.0) -> LayerPlacement:
    """Returns `balance_layers` with a layer per stage, or with the first / last stage left holding only
    its extra (the embedding; the head + loss + MTP) where that lowers the imbalance by at least
    EMPTY_STAGE_GAIN_PCT points and the extra is worth EMPTY_STAGE_MIN_EXTRA mean layers. A middle stage
    always keeps a layer (without one it would only pass the hidden state on). Raises ScheduleError when
    there are fewer layers than stages."""
    one = balance_layers(placement, layer_costs, first_extra, last_extra, 1)
    S = placement.num_stages
    floor = EMPTY_STAGE_MIN_EXTRA * sum(layer_costs) / max(len(layer_costs), 1)
    ends = (first_extra >= floor > 0, last_extra >= floor > 0)
    if S == 1 or not any(ends):
        return one
    mins = (int(not ends[0]),) + (1,) * (S - 2) + (int(not ends[1]),)
    empty = balance_layers(placement, layer_costs, first_extra, last_extra, mins)
    return empty if empty.imbalance_pct <= one.imbalance_pct - EMPTY_STAGE_GAIN_PCT else one
