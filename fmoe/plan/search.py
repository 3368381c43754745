"""Rank every layout of a request: screen all candidates with the closed-form estimate, simulate the best,
and say why the first beats the second.

    ranked = plan(ctx)                      # PlanResult: simulated best first, then the rejected
    print(format_table(ranked.best[:10]))
    print(why(ranked.best[0], ranked.best[1]))

Two passes because the simulator costs tens of milliseconds per schedule: the closed form (textbook
bubble, the same per-stage costs) screens thousands of candidates in seconds; the `simulate_top` best of
them (and the best of every schedule) are simulated and re-ranked, so the table's figures all come from
`fmoe.schedule.simulate`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from fmoe.plan import layout as L
from fmoe.plan.estimate import PAIRED_SCHEDULES, Context, Prediction, fastest_fitting
from fmoe.plan.specs import PlanError


@dataclass(frozen=True)
class PlanResult:
    """`best`: simulated predictions that fit, fastest first; `screened`: how many candidates passed the
    rules; `rejected`: (layout, reason) of those that broke a rule or did not fit any recompute."""

    best: tuple[Prediction, ...]
    screened: int
    rejected: tuple[tuple[L.Layout, str], ...]


SCREEN_REPORT = 1000  # layouts between two "screening" progress calls


def plan(
    ctx: Context,
    *,
    simulate_top: int = 32,
    micro_batches: tuple[int, ...] = (1, 2, 4),
    vpps: tuple[int, ...] = (2, 4),
    capacity_factors: tuple[float | None, ...] = (None,),
    zero1: bool = True,
    cps: tuple[int, ...] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> PlanResult:
    """Returns the PlanResult of searching every layout for `ctx` (`cps`: the context-parallel sizes, None:
    `layout.cp_sizes`, more than 1 only for long sequences). Raises PlanError when none can run.
    `progress(what, done, total)`: every SCREEN_REPORT layouts screened ("screening", tried, 0), after the
    screening ("screened", layouts that fit, all tried) and as each of the best is simulated ("simulated",
    k, of how many)."""
    rejected: list[tuple[L.Layout, str]] = []
    quick: list[Prediction] = []
    for lay, why_not in L.candidates(
        ctx.model,
        ctx.cluster,
        ctx.devices,
        ctx.global_batch,
        micro_batches=micro_batches,
        vpps=vpps,
        capacity_factors=capacity_factors,
        zero1=zero1,
        cps=cps,
    ):
        if progress is not None and (len(rejected) + len(quick)) % SCREEN_REPORT == SCREEN_REPORT - 1:
            progress("screening", len(rejected) + len(quick) + 1, 0)
        if why_not is not None:
            rejected.append((lay, why_not))
            continue
        pred = fastest_fitting(ctx, lay, simulate=False)
        if pred.fits:
            quick.append(pred)
        else:
            rejected.append((pred.layout, pred.reason or "does not fit"))
    if not quick:
        reasons = sorted({r for _, r in rejected})
        raise PlanError(
            f"no layout of {ctx.model.name} fits {ctx.devices} x {ctx.cluster.name} at global batch "
            f"{ctx.global_batch}: " + "; ".join(reasons[:3])
        )
    quick.sort(key=lambda p: p.step_s)
    chosen = {p.layout: p for p in quick[:simulate_top]}
    for name in {p.layout.schedule for p in quick}:  # the best of each schedule, for the comparison
        first = next(p for p in quick if p.layout.schedule == name)
        chosen.setdefault(first.layout, first)
    if progress is not None:
        progress("screened", len(quick), len(quick) + len(rejected))
    simulated = []
    for p in chosen.values():
        simulated.append(fastest_fitting(ctx, p.layout, simulate=True))
        if progress is not None:
            progress("simulated", len(simulated), len(chosen))
    best = sorted((p for p in simulated if p.fits), key=lambda p: p.step_s)
    rejected += [(p.layout, p.reason or "does not fit") for p in simulated if not p.fits]
    return PlanResult(tuple(best), len(quick), tuple(rejected))


HEADER = (
    f"{'#':>3} {'layout':<34} {'schedule':<18} {'overlap':<9} {'rc':<8} {'step s':>8} {'tok/s':>10} "
    f"{'MFU':>6} {'mem GiB':>8} {'bubble':>7} {'comm':>6}"
)


def format_row(k: int, p: Prediction) -> str:
    """One table line of prediction `p` ranked `k`."""
    lay = p.layout
    label = " ".join(w for w in lay.label().split() if not w.startswith("rc-"))
    return (
        f"{k:>3} {label:<34} {lay.schedule:<18} {overlap_label(p):<9} {lay.recompute:<8} "
        f"{p.step_s:8.3f} {p.tokens_per_s:10.4g} {100 * p.mfu:5.1f}% {p.mem_gib:8.2f} "
        f"{100 * p.bubble:6.1f}% {100 * p.exposed_comm:5.1f}%"
    )


def overlap_label(p: Prediction) -> str:
    """fb overlap as the table shows it: "off", or the MoE layers' modes "in a pair/alone" (fmoe.overlap;
    a schedule without F&B pairs shows only the lone one)."""
    if not p.layout.overlap:
        return "off"
    paired, lone = p.overlap_modes
    return f"{paired}/{lone}" if p.layout.schedule in PAIRED_SCHEDULES else f"-/{lone}"


COLUMNS = ("overlap: how the MoE all-to-all is hidden, in an F&B pair / alone: pair (behind the other "
           "microbatch's compute), self (in row chunks behind its own experts), none; '-' where the schedule "
           "has no F&B pairs; off: fb overlap off. rc: what is recomputed in the backward: none, adaptive "
           "(the routed experts of a layer whose load runs high), parts joined by '+' (selective), full "
           "(whole layers). bubble: idle share of the step; comm: exposed communication's share.")


def format_table(preds: tuple[Prediction, ...] | list[Prediction], start: int = 1) -> str:
    """The ranked table of `preds` (header + one line each) and what its overlap and rc columns mean."""
    return "\n".join([HEADER] + [format_row(start + k, p) for k, p in enumerate(preds)]
                     + textwrap.wrap(COLUMNS, len(HEADER)))


def _parts(p: Prediction) -> dict[str, float]:
    t = p.times
    compute = t["busy_mean"] - p.exposed_comm * p.step_s + t["dp_exposed"]
    return {
        "compute": max(compute, 0.0),
        "bubble": t["bubble"],
        "exposed communication": p.exposed_comm * p.step_s,
        "optimizer": t["optimizer"],
    }


TIE = 0.005  # step times closer than this share are a tie: "ties with", not "beats"


def _names(first: Prediction, second: Prediction) -> tuple[str, str]:
    """The two layouts' names (label and schedule), with fb overlap where that tells them apart (the
    label has every other option)."""
    def name(p: Prediction, other: Prediction) -> str:
        lay = p.layout
        text = f"{lay.label()} {lay.schedule}"
        if lay.overlap != other.layout.overlap:
            text += " with fb overlap" if lay.overlap else " without fb overlap"
        return text

    return name(first, second), name(second, first)


def why(first: Prediction, second: Prediction) -> str:
    """One line on why `first` beats `second` (or ties with it, within TIE): the parts of the step that
    differ most."""
    a, b = _parts(first), _parts(second)
    diffs = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    gain = second.step_s - first.step_s
    main = [f"{k} {a[k]:.3g} s vs {b[k]:.3g} s" for d, k in diffs if d > 0.05 * max(gain, 1e-12)][:2]
    lost = [f"{k} +{-d:.3g} s" for d, k in diffs if d < -0.05 * max(gain, 1e-12)][:1]
    one, two = _names(first, second)
    verb = "ties with" if gain <= TIE * second.step_s else "beats"
    text = (
        f"{one} {verb} {two} by {gain:.3g} s/step ({100 * gain / second.step_s:.1f}%): "
        + (", ".join(main) if main else "about equal in every part")
    )
    if lost:
        text += f"; it pays {', '.join(lost)}"
    if second.mem_gib - first.mem_gib >= 0.05:  # what the line's one decimal can show
        text += f"; and needs {second.mem_gib - first.mem_gib:.1f} GiB less per device"
    return text


def explain(p: Prediction) -> str:
    """A breakdown of one prediction: step parts, per-layer times, all-to-all bytes, memory per part."""
    lay, t = p.layout, p.times
    lines = [
        f"layout {lay.label()}, schedule {lay.schedule} (vpp {lay.vpp}), fb overlap "
        f"{'on' if lay.overlap else 'off'} (MoE all-to-all hidden in a pair / alone: {overlap_label(p)}), "
        f"recompute {lay.recompute}, "
        f"{p.microbatches} microbatches per rank",
        f"  step {p.step_s:.4g} s = pipeline {t['pipeline']:.4g} s (busy {t['busy_mean']:.4g}, bubble "
        f"{t['bubble']:.4g}) + exposed DP reduce {t['dp_exposed']:.4g} s + optimizer {t['optimizer']:.4g} s",
        f"  {p.tokens_per_s:.4g} tokens/s, MFU {100 * p.mfu:.1f}%, bubble {100 * p.bubble:.1f}%, exposed "
        f"communication {100 * p.exposed_comm:.1f}%",
        f"  layer cut: modelled compute imbalance {p.cut_imbalance_pct:.1f}% per rank, "
        f"{p.cut_stage_imbalance_pct:.1f}% per chunk",
        f"  per chunk and microbatch (max): F {t['f_chunk_max']:.4g} s, I {t['i_chunk_max']:.4g} s, W "
        f"{t['w_chunk_max']:.4g} s; recompute {t['recompute_per_layer']:.3g} s and TP collectives "
        f"{t['tp_comm_per_layer']:.3g} s per MoE layer",
        f"  all-to-all per MoE layer (one dispatch): {t['a2a_per_layer'] * 1e3:.3g} ms, bytes per rank "
        + ", ".join(f"{k} {v / 2**20:.3g} MiB" for k, v in p.a2a_bytes.items()),
        f"  P2P per microbatch {t['p2p'] * 1e3:.3g} ms; DP gradient reduce {t['dp_reduce']:.4g} s",
        "  step under each way of hiding the all-to-all (in a pair / alone; fmoe.overlap): "
        + ", ".join(f"{k.split()[-1]} {v:.4g} s" for k, v in t.items() if k.startswith("step overlap ")),
        f"  memory per device {p.mem_gib:.2f} GiB: " + ", ".join(f"{k} {v:.2f}" for k, v in p.memory.items()),
    ]
    return "\n".join(lines)


def parse_label(text: str) -> dict[str, object]:
    """Returns the Layout fields a label like "tp8 pp16 ep4 vpp2 dp12 mb1" names (for --explain)."""
    out: dict[str, object] = {}
    keys = {"tp": "tp", "pp": "pp", "ep": "ep", "vpp": "vpp", "dp": "dp", "cp": "cp", "mb": "micro_batch"}
    for word in text.replace(",", " ").split():
        for prefix in sorted(keys, key=len, reverse=True):
            if word.startswith(prefix) and word[len(prefix) :].isdigit():
                out[keys[prefix]] = int(word[len(prefix) :])
                break
        else:
            if word == "hier":
                out["hierarchical"] = True
            elif word == "tp-splits-experts":
                out["tp_extends_ep"] = False
            elif word.startswith("cap"):
                out["capacity_factor"] = float(word[3:])
            else:
                raise PlanError(f"--explain: cannot read {word!r} (write e.g. 'tp8 pp16 ep4 vpp2 dp12 mb1')")
    return out
