"""The planner's predictions on this machine against measurement: `fmoe train` steps of one model under
several layouts and schedules, each on 2 gloo ranks (one thread each), next to what `fmoe plan --cluster
local` predicts for the same layout.

    .venv/bin/python benchmarks/plan_local.py                 # tiny preset, 12 layouts, 20 steps each
    .venv/bin/python benchmarks/plan_local.py --preset small --steps 8

Every layout and the eight calibration runs (`fmoe.calibrate.machine.calibration_configs`: the tiny preset
data-parallel on 2 ranks with 8 microbatches each under 1f1b, the same with 2 layers, under zb_h1, with
16 and with 1 sequence per microbatch, expert-parallel under 1f1b without overlap with 4 and with 16
sequences per microbatch, and pipelined over the 2 ranks under dualpipev with 16 microbatches, which
prices a pipeline message; none of them a measured layout) run as live jobs side by side
(`fmoe.calibrate.jobs.step_live`, 42 processes, 0.4 GiB each): a step of each in turn, the order shuffled
every round, so that all of them meet the same phases of this machine's speed (it moves by up to 2x
within seconds), over two sessions of fresh processes (two copies of one layout in one set of processes
came out up to 1.066x apart). Measured per layout: the median `step_s` over its steps after 2 warm-up steps a
session (max over the two ranks), and the peak resident memory of a rank over its whole run (VmHWM, max
over ranks and sessions). Predicted: `fmoe.plan.estimate.fastest_fitting` on the `local` cluster fitted
to the calibration runs of the same run, with the machine's GEMM, attention and optimizer rates measured
once per round while the jobs are stopped (`fmoe.calibrate.machine.measure_rates`; measured once in a slow
phase, the GEMM peak came out 80 GFLOP/s against 117-155 in the other runs, and every host time fitted
beyond it went wrong) and its gloo links once after (`measure_machine`). Prints the ratio predicted /
measured for step time and memory, whether the ranking by predicted step time matches the measured one,
and how many of the pairs that either side separates by more than 10% the other orders alike. A
control, the first layout run a second time as a job of its own, says how far apart this machine puts
the same work in one run: pairs measured further apart than that are counted too, and so are pairs that
both halves of the steps order alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from fmoe.calibrate import machine as LC  # noqa: E402
from fmoe.calibrate.jobs import step_live  # noqa: E402
from fmoe.calibrate.models import load_model  # noqa: E402
from fmoe.plan import estimate as E  # noqa: E402
from fmoe.plan.layout import Layout  # noqa: E402
from fmoe.train.config import TrainConfig  # noqa: E402

# prefix of the calibration runs' jobs (fmoe.calibrate.machine.calibration_configs)
CALIBRATION = "calibration "
_PP2, _EP2, _DP2 = {"pp": 2, "ep": 1, "dp": 1}, {"pp": 1, "ep": 2, "dp": 1}, {"pp": 1, "ep": 1, "dp": 2}
# (name, TrainConfig overrides, planner schedule, vpp): every schedule at the preset's 4 sequences per
# microbatch, then layouts at other microbatch sizes (which the calibration runs, at 4 and 16, are not)
LAYOUTS = (
    ("pp2 1f1b", {**_PP2, "schedule": "1f1b"}, "1f1b", 1),
    ("pp2 zb_h1", {**_PP2, "schedule": "zb_h1"}, "zb_h1", 1),
    ("pp2 interleaved", {**_PP2, "schedule": "interleaved"}, "interleaved", 2),
    ("pp2 dualpipev", {**_PP2, "schedule": "dualpipev"}, "dualpipev", 2),
    ("ep2 combined_1f1b", {**_EP2, "schedule": "combined_1f1b"}, "combined_1f1b", 1),
    ("dp2 1f1b", {**_DP2, "schedule": "1f1b"}, "1f1b", 1),
    ("pp2 1f1b mbs16", {**_PP2, "schedule": "1f1b", "micro_batch_size": 16}, "1f1b", 1),
    ("pp2 1f1b mbs2", {**_PP2, "schedule": "1f1b", "micro_batch_size": 2}, "1f1b", 1),
    ("pp2 interleaved mbs8", {**_PP2, "schedule": "interleaved", "micro_batch_size": 8}, "interleaved", 2),
    ("pp2 dualpipev mbs2", {**_PP2, "schedule": "dualpipev", "micro_batch_size": 2}, "dualpipev", 2),
    ("ep2 combined_1f1b mbs8", {**_EP2, "schedule": "combined_1f1b", "micro_batch_size": 8},
     "combined_1f1b", 1),
    ("dp2 1f1b mbs16", {**_DP2, "schedule": "1f1b", "micro_batch_size": 16}, "1f1b", 1),
)
# the control: the first layout run a second time, as a job of its own beside the first; how far apart
# its two medians come is how far this machine puts the same work in one run (out of every tally)
CONTROL_OF = LAYOUTS[0][0]
CONTROL = f"{CONTROL_OF} (control)"


def main() -> None:
    """Measures every layout, predicts it, prints the comparison table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--steps", type=int, default=20,
                    help="measured steps of every job, a step of each in turn (after 2 warm-up steps)")
    ap.add_argument("--sessions", type=int, default=2,
                    help="sets of fresh processes the steps are split over (a job's own speed averages out)")
    args = ap.parse_args()
    model = load_model(args.preset)
    base = {"progress": False, "steps": 10**6}
    tcs = {
        name: TrainConfig.from_sources(args.preset, None, {**base, **over}) for name, over, _, _ in LAYOUTS
    }
    tcs[CONTROL] = tcs[CONTROL_OF]
    calibration = LC.calibration_configs()
    t0 = time.perf_counter()
    jobs = {**{CALIBRATION + name: tc for name, tc in calibration.items()}, **tcs}
    rates: list[dict[str, float]] = []
    runs = step_live(jobs, args.steps, sessions=args.sessions,
                     events={CALIBRATION + name for name in calibration},
                     each_round=lambda: rates.append(LC.measure_rates()))
    samples = {name: runs[CALIBRATION + name].host_sample() for name in calibration}
    cluster = LC.fit_host(LC.measure_machine(rates), **samples)
    sample = samples["full"]
    print(f"{len(jobs)} jobs, {args.steps} steps of each in turn over {args.sessions} sessions of fresh "
          f"processes, in {time.perf_counter() - t0:.0f} s; local cluster: {cluster}")
    walls = runs[CALIBRATION + "full"].step_s
    print(f"calibration run (median of {len(walls)} steps): step {sample.wall_s * 1e3:.1f} ms, executor span "
          f"{sample.span_s * 1e3:.1f} ms, forward per layer "
          + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(sample.f_s.items()))
          + f" ms, B {sample.b_s * 1e3:.2f} ms, W {sample.w_s * 1e3:.2f} ms per microbatch; "
          f"max / min step {max(walls) / min(walls):.2f}")
    step_times = {name: runs[name].step_s for name in tcs}
    # the steps' halves (with two sessions, one each): a pair is in a stable order when both order it alike
    halves = {name: (statistics.median(t[: len(t) // 2]), statistics.median(t[len(t) // 2 :]))
              for name, t in step_times.items()}
    rows = []
    for name, _, sched, vpp in LAYOUTS:
        tc = tcs[name]
        ctx = E.Context(model, cluster, tc.world_size, tc.global_batch_size)
        lay = Layout(
            tp=1,
            pp=tc.pp,
            ep=tc.ep,
            dp=tc.dp,
            vpp=vpp,
            schedule=sched,
            overlap=tc.overlap and sched != "1f1b" or sched == "combined_1f1b",
            micro_batch=tc.micro_batch_size,
        )
        pred = E.fastest_fitting(ctx, lay)
        measured = statistics.median(step_times[name])
        rows.append((name, pred.step_s, measured, pred.mem_gib, runs[name].peak_gib))
    print(
        f"{'layout':<24} {'pred step ms':>12} {'meas step ms':>12} {'ratio':>6} {'halves':>6} "
        f"{'pred GiB':>9} {'meas GiB':>9} {'ratio':>6}"
    )
    for name, ps, ms, pm, mm in rows:
        h = halves[name]
        print(
            f"{name:<24} {ps * 1e3:12.1f} {ms * 1e3:12.1f} {ps / ms:6.3f} {max(h) / min(h):6.2f} "
            f"{pm:9.3f} {mm:9.3f} {pm / mm:6.3f}"
        )
    twice = (statistics.median(step_times[CONTROL]), statistics.median(step_times[CONTROL_OF]))
    resolution = max(twice) / min(twice)
    print(f"control: {CONTROL_OF} run twice, side by side, {twice[0] * 1e3:.1f} and "
          f"{twice[1] * 1e3:.1f} ms: the same work {resolution:.3f}x apart (this run's resolution)")
    by_pred = [r[0] for r in sorted(rows, key=lambda r: r[1])]
    by_meas = [r[0] for r in sorted(rows, key=lambda r: r[2])]
    within_t = sum(abs(r[1] / r[2] - 1) <= 0.10 for r in rows)
    within_m = sum(abs(r[3] / r[4] - 1) <= 0.15 for r in rows)
    print(f"step time within 10%: {within_t}/{len(rows)}; peak memory within 15%: {within_m}/{len(rows)}")
    print(f"ranking predicted: {by_pred}\nranking measured:  {by_meas}\nsame ranking: {by_pred == by_meas}")
    pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1 :]]

    def alike(pair: tuple[tuple, tuple]) -> bool:
        """Whether the prediction orders the pair as the measurement does."""
        a, b = pair
        return (a[1] < b[1]) == (a[2] < b[2])

    def count(label: str, subset: list[tuple[tuple, tuple]]) -> None:
        """Prints how many pairs of `subset` are ordered alike, naming the others."""
        print(f"pairs {label}: {len(subset)}, ordered alike: {sum(map(alike, subset))}"
              + "".join(f"\n  not alike: {a[0]} / {b[0]}" for a, b in subset if not alike((a, b))))

    concordant = sum(map(alike, pairs))
    print(f"pairs ordered alike: {concordant}/{len(pairs)} (Kendall tau "
          f"{(2 * concordant - len(pairs)) / len(pairs):.3f})")
    # the pairs in the same measured order in both halves of the steps (the halves do not overlap)
    count("in the same measured order in both halves",
          [(a, b) for a, b in pairs if max(halves[a[0]]) < min(halves[b[0]])
           or max(halves[b[0]]) < min(halves[a[0]])])
    count(f"measured further apart than the control ({resolution:.3f}x)",
          [(a, b) for a, b in pairs if max(a[2], b[2]) / min(a[2], b[2]) > resolution])
    for side, col in (("measured", 2), ("predicted", 1)):
        count(f"{side} more than 10% apart", [(a, b) for a, b in pairs if abs(a[col] / b[col] - 1) > 0.10])

if __name__ == "__main__":
    main()
