"""Stage imbalance (feature 23): extra cost on the first/last stage (embedding, loss, MTP) and a layer
placement that evens per-rank cost.

Legend: S stages, L layers; costs in units of one transformer layer (`place_layers`), or in any unit
shared by the per-layer costs and the extras (`balance_layers`: dense and MoE layers may differ).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

from fmoe.schedule.ir import Placement, ScheduleError


@dataclass(frozen=True)
class LayerPlacement:
    """`layers[s]` layers on stage s; `rank_cost[r]` its total cost; `imbalance_pct` = (max/mean-1)*100;
    `stage_cost[s]` each stage's own cost (what a schedule whose ranks hold several stages waits on)."""

    layers: tuple[int, ...]
    rank_cost: tuple[float, ...]
    imbalance_pct: float
    exact: bool = True  # False: `balance_layers` ran out of its search budget (best found, not proven)
    split_last: float = 0.0  # > 0: the last stage holds only this part of the last extra (`split_last`)
    stage_cost: tuple[float, ...] = ()

    @property
    def stage_imbalance_pct(self) -> float:
        """(max/mean - 1) * 100 of the per-stage costs."""
        return imbalance_pct(self.stage_cost)


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


def _stage_extras(S: int, first_extra: float, last_extra: float, split_last: float) -> list[float]:
    """Returns the extra cost per stage [S]: `first_extra` on stage 0 and `last_extra` on the last, or
    with `split_last` > 0 that part of `last_extra` alone on the last stage and the rest on the one
    before. Raises ScheduleError on bad numbers, a split above `last_extra` or one stage to split over."""
    _check_extra("first_extra", first_extra)
    _check_extra("last_extra", last_extra)
    _check_extra("split_last", split_last)
    if split_last > last_extra:
        raise ScheduleError(f"split_last {split_last!r} is more than last_extra {last_extra!r}")
    if split_last and S < 2:
        raise ScheduleError("split_last needs two stages or more")
    extra = [0.0] * S
    extra[0] += first_extra
    extra[-1] += split_last if split_last else last_extra
    if split_last:
        extra[-2] += last_extra - split_last
    return extra


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
    return LayerPlacement(tuple(layers), cost, imbalance_pct(cost),
                          stage_cost=stage_costs(placement, tuple(layers), first_extra, last_extra))


def cost_stage_costs(placement: Placement, layer_costs: Sequence[float], layers: tuple[int, ...],
                     first_extra: float = 0.0, last_extra: float = 0.0,
                     split_last: float = 0.0) -> tuple[float, ...]:
    """Returns per-stage cost [S] of cutting the layers (costs `layer_costs` [L], in order) into
    consecutive chunks of `layers[s]` on stage s, plus the extras on the first and last stage
    (`split_last` > 0: that part of the last extra alone on the last stage, the rest on the one before)."""
    if len(layers) != placement.num_stages or sum(layers) != len(layer_costs):
        raise ScheduleError(f"layer counts {layers} do not cut {len(layer_costs)} layers into "
                            f"{placement.num_stages} stages")
    extra = _stage_extras(placement.num_stages, first_extra, last_extra, split_last)
    cost, start = [], 0
    for s, n in enumerate(layers):
        cost.append(sum(layer_costs[start:start + n]) + extra[s])
        start += n
    return tuple(cost)


def cost_rank_costs(placement: Placement, layer_costs: Sequence[float], layers: tuple[int, ...],
                    first_extra: float = 0.0, last_extra: float = 0.0,
                    split_last: float = 0.0) -> tuple[float, ...]:
    """Returns per-rank cost [pp]: the `cost_stage_costs` of the stages the rank holds, summed."""
    cost = [0.0] * placement.pp
    for s, c in enumerate(cost_stage_costs(placement, layer_costs, layers, first_extra, last_extra,
                                           split_last)):
        cost[placement.stage_rank[s]] += c
    return tuple(cost)


def _greedy_stage_cut(prefix: list[float], extra: list[float], mins: Sequence[int], last_ls: int,
                      bound: float) -> tuple[int, ...] | None:
    """The cut with every stage's cost under `bound` that gives each stage the most layers that fit
    (leaving the later stages their minimums; stage `last_ls` takes the rest, any stage after it none),
    or None where there is none: taking more early only shortens what the later stages must hold, so
    this greedy finds a cut whenever one exists."""
    L, S = len(prefix) - 1, len(extra)
    pos, out = 0, []
    for s in range(S):
        hi = L - sum(mins[s + 1:])
        k = L - pos if s == last_ls else 0 if s > last_ls else mins[s]
        while s < last_ls and pos + k < hi and prefix[pos + k + 1] - prefix[pos] + extra[s] <= bound:
            k += 1
        if k < mins[s] or pos + k > hi or prefix[pos + k] - prefix[pos] + extra[s] > bound:
            return None
        out.append(k)
        pos += k
    return tuple(out)


def _cut_setup(placement: Placement, layer_costs: Sequence[float], first_extra: float, last_extra: float,
               min_layers: int | Sequence[int], split_last: float,
               ) -> tuple[list[float], list[float], tuple[int, ...], int]:
    """Checks a cut's inputs; returns (prefix sums of the layer costs [L+1], extra per stage [S], the
    minimum layers per stage [S], the stage that takes the layers left). Raises ScheduleError on bad
    numbers or too few layers."""
    S = placement.num_stages
    extra = _stage_extras(S, first_extra, last_extra, split_last)
    mins = (min_layers,) * S if isinstance(min_layers, Integral) else tuple(min_layers)
    if len(mins) != S:
        raise ScheduleError(f"{len(mins)} minimum layer counts for {S} stages")
    if split_last:
        mins = mins[:-1] + (0,)
    for m in mins:
        _check_count("min_layers", m)
    for i, c in enumerate(layer_costs):
        _check_extra(f"layer_costs[{i}]", c)
    if len(layer_costs) < sum(mins):
        what = f"{min_layers} to each of" if isinstance(min_layers, Integral) else f"{mins} to the"
        raise ScheduleError(f"{len(layer_costs)} layers cannot give {what} {S} stages")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    return prefix, extra, mins, S - 2 if split_last else S - 1


def least_stage_cost(placement: Placement, layer_costs: Sequence[float], first_extra: float = 0.0,
                     last_extra: float = 0.0, min_layers: int | Sequence[int] = 1,
                     split_last: float = 0.0) -> float:
    """Returns the least costliest-stage cost over the cuts `balance_layers` considers (same arguments):
    a bisection on the bound over `_greedy_stage_cut`, exact to the float. Raises ScheduleError as
    `balance_layers` does."""
    prefix, extra, mins, last_ls = _cut_setup(placement, layer_costs, first_extra, last_extra, min_layers,
                                              split_last)
    lo, hi = 0.0, prefix[-1] + sum(extra)
    got = _greedy_stage_cut(prefix, extra, mins, last_ls, hi)
    for _ in range(80):
        mid = (lo + hi) / 2
        cut = _greedy_stage_cut(prefix, extra, mins, last_ls, mid)
        if cut is None:
            lo = mid
        else:
            hi, got = mid, cut
    assert got is not None  # the total bound always fits
    return max(prefix[sum(got[:s + 1])] - prefix[sum(got[:s])] + extra[s] for s in range(len(got)))


def balance_layers(placement: Placement, layer_costs: Sequence[float], first_extra: float = 0.0,
                   last_extra: float = 0.0, min_layers: int | Sequence[int] = 1,
                   budget: int = 2_000, split_last: float = 0.0,
                   stage_cap: float = math.inf) -> LayerPlacement:
    """`_balance_layers` (see there), remembered: a planner and a config's checks ask for the same cut
    hundreds of times (the DeepSeek-V3 layout checks: 928 calls, 59 distinct), and the answer is a frozen
    value. Unhashable arguments (a placement holding lists) are answered uncached."""
    mins = tuple(min_layers) if isinstance(min_layers, Sequence) else min_layers
    args = (placement, tuple(layer_costs), first_extra, last_extra, mins, budget, split_last, stage_cap)
    try:
        return _balance_layers_cached(*args)
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        return _balance_layers(*args)


@functools.lru_cache(maxsize=1024)
def _balance_layers_cached(*args: object) -> LayerPlacement:
    return _balance_layers(*args)


def _balance_layers(placement: Placement, layer_costs: Sequence[float], first_extra: float = 0.0,
                    last_extra: float = 0.0, min_layers: int | Sequence[int] = 1,
                    budget: int = 2_000, split_last: float = 0.0,
                    stage_cap: float = math.inf) -> LayerPlacement:
    """Returns the LayerPlacement of the layers (costs `layer_costs` [L], in model order) cut into
    consecutive chunks, one per stage in stage order, at least `min_layers` each (or `min_layers[s]` on
    stage s), that minimises the costliest rank (a rank sums the chunks it holds; `first_extra` goes to
    stage 0, `last_extra` to the last). `split_last` > 0: the last stage holds no layer and only that
    part of `last_extra` (something that needs no layer after the stage before: the MTP module after the
    loss), the rest going to the stage before. `stage_cap`: only cuts whose every stage costs at most
    that (at least `least_stage_cost`, else there are none). Exact (branch and bound over the cuts); past
    `budget` search nodes it returns the best cut found with `exact=False`. Raises ScheduleError on bad
    numbers, too few layers or a `stage_cap` no cut meets."""
    L, S, pp = len(layer_costs), placement.num_stages, placement.pp
    prefix, extra, mins, last_ls = _cut_setup(placement, layer_costs, first_extra, last_extra, min_layers,
                                              split_last)
    capped = math.isfinite(stage_cap)
    cap = stage_cap * (1 + 1e-12) + 1e-12 if capped else math.inf  # float sums taken in another order
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
            k = L - pos if s == last_ls else 0 if s > last_ls else mins[s]
            share = min(share, cap - extra[s])
            while s < last_ls and pos + k < hi and prefix[pos + k + 1] - prefix[pos] <= share:
                k += 1
            cost[r] += prefix[pos + k] - prefix[pos] + extra[s]
            if cost[r] > bound or prefix[pos + k] - prefix[pos] + extra[s] > cap:
                return None
            out.append(k)
            pos += k
        return tuple(out)

    # the incumbent: the even split (or under a cap, the greedy cut under it), or the greedy fill under
    # the least bound it meets (bisection)
    start = even_layers(placement, L)
    if split_last:
        start = even_layers(dataclasses.replace(placement, stage_rank=placement.stage_rank[:-1]), L) + (0,)
    if capped:
        start = _greedy_stage_cut(prefix, extra, mins, last_ls, cap)
        if start is None:
            raise ScheduleError(f"no cut keeps every stage under {stage_cap!r}")
    best_layers, best = start, math.inf
    if all(n >= m for n, m in zip(start, mins)):
        best = max(cost_rank_costs(placement, layer_costs, start, first_extra, last_extra, split_last))
    lo, hi_bound = mean, total
    for _ in range(40):
        mid = (lo + hi_bound) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi_bound = mid
            top = max(cost_rank_costs(placement, layer_costs, got, first_extra, last_extra, split_last))
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
        if s >= last_ls:
            ks = [L - pos] if s == last_ls else [0]
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
            if new >= best - eps or prefix[pos + k] - prefix[pos] + extra[s] > cap:
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
    # min-max leaves every rank but the costliest free (one forced costly stage makes any cut under it
    # optimal): the polish evens the rest, and past the budget brings the max down where it can
    best_layers = _polish(placement, layer_costs, best_layers, first_extra, last_extra, mins, split_last, cap)
    cost = cost_rank_costs(placement, layer_costs, best_layers, first_extra, last_extra, split_last)
    return LayerPlacement(best_layers, cost, imbalance_pct(cost), exact=exact, split_last=split_last,
                          stage_cost=cost_stage_costs(placement, layer_costs, best_layers, first_extra,
                                                      last_extra, split_last))


def _polish(placement: Placement, layer_costs: Sequence[float], layers: tuple[int, ...],
            first_extra: float, last_extra: float, mins: tuple[int, ...],
            split_last: float = 0.0, cap: float = math.inf) -> tuple[int, ...]:
    """Returns `layers` after moving single cut points by one layer while that lowers the rank costs
    sorted from the costliest (lexicographically: the max, then the next, so plateaus are left); with
    `split_last` the last stage keeps no layer, and no stage goes over `cap`."""
    def key(counts: tuple[int, ...]) -> tuple[float, ...]:
        return tuple(sorted(cost_rank_costs(placement, layer_costs, counts, first_extra, last_extra,
                                            split_last), reverse=True))

    cur, cur_key = list(layers), key(layers)
    improved = True
    while improved:
        improved = False
        for s in range(1, len(cur) - (1 if split_last else 0)):  # the cut point between stages s-1 and s
            for d in (1, -1):  # one layer from stage s to s-1, or back
                if cur[s] - d < mins[s] or cur[s - 1] + d < mins[s - 1]:
                    continue
                cur[s - 1] += d
                cur[s] -= d
                k = key(tuple(cur))
                within = max(cost_stage_costs(placement, layer_costs, tuple(cur), first_extra, last_extra,
                                              split_last)) <= cap
                if within and k < cur_key:
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
# Where a rank holds several stages (interleaved, V) the schedule waits on its slowest stage as well as
# its busiest rank: a cut may give up to RANK_SLACK_PCT of the costliest rank's cost for a costliest
# stage lower by at least STAGE_GAIN_PCT points of stage imbalance (docs/plan.md "Balanced cut": on
# Pangu's PP16 x VPP2 the simulator's makespan falls 16.7 s -> 13.9 s for 2.5% more on its costliest rank).
RANK_SLACK_PCT = 5.0
STAGE_GAIN_PCT = 1.0


def balance_layers_or_empty(placement: Placement, layer_costs: Sequence[float], first_extra: float = 0.0,
                            last_extra: float = 0.0, split_last: float = 0.0,
                            even_chunks: bool = True) -> LayerPlacement:
    """Returns `balance_layers` with a layer per stage, or with the first / last stage left holding only
    its extra (the embedding; the head + loss + MTP) where that lowers the imbalance by at least
    EMPTY_STAGE_GAIN_PCT points and the extra is worth EMPTY_STAGE_MIN_EXTRA mean layers. A middle stage
    always keeps a layer (without one it would only pass the hidden state on). `split_last` > 0: also the
    cut whose last stage holds only that part of the last extra (the MTP module), the rest on the stage
    before (the loss; without a layer of its own where it is worth EMPTY_STAGE_MIN_EXTRA mean layers),
    taken where it lowers the imbalance by EMPTY_STAGE_GAIN_PCT points more (LayerPlacement.split_last).
    Where a rank holds several stages: of these kinds of cut, the one with the cheapest costliest stage
    (`least_stage_cost`, then the least costliest rank under it) where its costliest rank is within
    RANK_SLACK_PCT of the chosen cut's and its stage imbalance STAGE_GAIN_PCT points lower
    (`even_chunks=False`: not that step, the least costliest rank only).
    Raises ScheduleError when there are fewer layers than stages."""
    S = placement.num_stages
    floor = EMPTY_STAGE_MIN_EXTRA * sum(layer_costs) / max(len(layer_costs), 1)
    ends = (first_extra >= floor > 0, last_extra >= floor > 0)
    kinds: list[tuple[tuple[int, ...], float]] = [((1,) * S, 0.0)]  # (minimum layers per stage, split)
    if S > 1 and any(ends):
        kinds.append(((int(not ends[0]),) + (1,) * (S - 2) + (int(not ends[1]),), 0.0))
    if S > 1 and split_last:
        _stage_extras(S, first_extra, last_extra, split_last)  # the checks, before a search
        before = last_extra - split_last  # the part left on stage S-2
        mins = [1] * S
        mins[0] = int(not ends[0])
        mins[S - 2] = 0 if S == 2 or before >= floor > 0 else 1
        kinds.append((tuple(mins), split_last))
    one = balance_layers(placement, layer_costs, first_extra, last_extra, 1)
    best = one
    for mins, split in kinds[1:]:  # the empty end first, then the split: each must pay over the best
        cut = balance_layers(placement, layer_costs, first_extra, last_extra, mins, split_last=split)
        best = cut if cut.imbalance_pct <= best.imbalance_pct - EMPTY_STAGE_GAIN_PCT else best
    if not even_chunks or len(set(placement.stage_rank)) == S:  # a stage per rank: ranks are stages
        return best
    slack = max(best.rank_cost) * (1 + RANK_SLACK_PCT / 100)
    chosen = best
    for mins, split in kinds:
        cap = least_stage_cost(placement, layer_costs, first_extra, last_extra, mins, split)
        if cap >= max(chosen.stage_cost):
            continue
        cut = balance_layers(placement, layer_costs, first_extra, last_extra, mins, split_last=split,
                             stage_cap=cap)
        if max(cut.rank_cost) <= slack and cut.stage_imbalance_pct <= (
                best.stage_imbalance_pct - STAGE_GAIN_PCT):
            chosen = cut
    return chosen
