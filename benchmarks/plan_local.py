"""The planner's predictions on this machine against measurement: `fmoe train` steps of one model under
several layouts and schedules, each on 2 gloo ranks (one thread each), next to what `fmoe plan --cluster
local` predicts for the same layout.

    .venv/bin/python benchmarks/plan_local.py                 # tiny preset, 12 layouts, 2 rounds
    .venv/bin/python benchmarks/plan_local.py --preset small --rounds 1

Measured per layout: the median `step_s` of the Trainer's steps after 2 warm-up steps (max over the two
ranks), and the peak resident memory of a rank over its whole run (VmHWM, max over ranks). Rounds run
every layout once, in an order rotated by one each round; medians over all measured steps. Predicted:
`fmoe.plan.estimate.fastest_fitting` on the `local` cluster, calibrated in the same run: the machine's
rates and links once (`fmoe.plan.local.measure_machine`), and the host overheads from six calibration
runs (`measure_runs`: the tiny preset data-parallel on 2 ranks with 8 microbatches each under 1f1b, the
same with 2 layers, under zb_h1, with 16 sequences per microbatch, expert-parallel under 1f1b without
overlap, and pipelined over the 2 ranks under dualpipev with 16 microbatches, which prices a pipeline
message; layouts none of the measured ones is), which take their turn in every round like a layout, so
that both see the same drift of this machine's speed (up to 2x between minutes). The fit uses the median
over rounds of each calibration figure. Prints the ratio predicted / measured for step time and memory,
whether the ranking by predicted step time matches the measured one, and how many of the pairs that
either side separates by more than 10% the other orders alike. A control, the first layout measured a
second time in every round as a layout of its own, says how far apart this machine puts the same work in
one run: pairs measured further apart than that are counted too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

from fmoe.plan import estimate as E  # noqa: E402
from fmoe.plan import local as LC  # noqa: E402
from fmoe.plan.layout import Layout  # noqa: E402
from fmoe.plan.specs import load_model  # noqa: E402
from fmoe.train.config import TrainConfig  # noqa: E402

CALIBRATION = "calibration"  # the turn of fmoe.plan.local.measure_runs (all six) in each round
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
# the control: the first layout measured a second time in every round, as a layout of its own; how far apart
# its two medians come is how far this machine puts the same work in one run (out of every tally)
CONTROL_OF = LAYOUTS[0][0]
CONTROL = f"{CONTROL_OF} (control)"


def _rank(rank: int, tc: TrainConfig, steps: int, store: str, q: Any) -> None:
    torch.set_num_threads(1)  # as fmoe train: the cores split between the ranks
    from fmoe.train.launch import _world
    from fmoe.train.loop import Trainer

    try:
        world = _world(tc, 0, f"file://{store}", rank, 2)
        trainer = Trainer(tc, world)
        times = [trainer.step()["step_s"] for _ in range(steps)]
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        q.put((rank, times, hwm / 2**20))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        q.put((rank, repr(exc), 0.0))


def measure(tc: TrainConfig, steps: int) -> tuple[list[float], float]:
    """Runs `steps` Trainer steps on 2 spawned ranks; returns (per-step max-over-ranks seconds, peak GiB)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = tempfile.mktemp(prefix="fmoe_plan_bench_")
    procs = [ctx.Process(target=_rank, args=(r, tc, steps, store, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for rank, times, _ in got:
        if isinstance(times, str):
            raise RuntimeError(f"rank {rank}: {times}")
    per_step = [max(vals) for vals in zip(*(t for _, t, _ in got))]
    return per_step, max(m for _, _, m in got)


def main() -> None:
    """Measures every layout, predicts it, prints the comparison table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="steps per run (the first 2 are warm-up)")
    args = ap.parse_args()
    machine = LC.measure_machine()
    model = load_model(args.preset)
    base = {"progress": False, "steps": 10**6}
    tcs = {
        name: TrainConfig.from_sources(args.preset, None, {**base, **over}) for name, over, _, _ in LAYOUTS
    }
    tcs[CONTROL] = tcs[CONTROL_OF]
    step_times: dict[str, list[float]] = {name: [] for name in tcs}
    round_medians: dict[str, list[float]] = {name: [] for name in tcs}
    peaks: dict[str, list[float]] = {name: [] for name in tcs}
    samples: list[LC.HostSample] = []
    shorts: list[LC.HostSample] = []
    splits: list[LC.HostSample] = []
    experts: list[LC.HostSample] = []
    larges: list[LC.HostSample] = []
    pipes: list[LC.HostSample] = []
    names = [CALIBRATION, *tcs]
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name == CALIBRATION:
                for got, into in zip(LC.measure_runs(), (samples, shorts, splits, experts, larges, pipes)):
                    if got is not None:
                        into.append(got)
                continue
            per_step, peak = measure(tcs[name], args.steps)
            step_times[name] += per_step[2:]
            round_medians[name].append(statistics.median(per_step[2:]))
            peaks[name].append(peak)
    sample = LC.median_sample(samples)
    cluster = LC.fit_host(machine, sample, LC.median_sample(shorts), LC.median_sample(splits),
                          LC.median_sample(experts), LC.median_sample(larges),
                          LC.median_sample(pipes) if pipes else None)
    print(f"measured in {time.perf_counter() - t0:.0f} s; local cluster: {cluster}")
    spread = max(s.wall_s for s in samples) / min(s.wall_s for s in samples)
    print(f"calibration run (median of {len(samples)}): step {sample.wall_s * 1e3:.1f} ms, executor span "
          f"{sample.span_s * 1e3:.1f} ms, forward per layer "
          + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(sample.f_s.items()))
          + f" ms, B {sample.b_s * 1e3:.2f} ms, W {sample.w_s * 1e3:.2f} ms per microbatch; "
          f"max / min step over the rounds {spread:.2f}")
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
        rows.append((name, pred.step_s, statistics.median(step_times[name]), pred.mem_gib, max(peaks[name])))
    print(
        f"{'layout':<24} {'pred step ms':>12} {'meas step ms':>12} {'ratio':>6} {'rounds max/min':>14} "
        f"{'pred GiB':>9} {'meas GiB':>9} {'ratio':>6}"
    )
    for name, ps, ms, pm, mm in rows:
        rm = round_medians[name]
        print(
            f"{name:<24} {ps * 1e3:12.1f} {ms * 1e3:12.1f} {ps / ms:6.3f} {max(rm) / min(rm):14.2f} "
            f"{pm:9.3f} {mm:9.3f} {pm / mm:6.3f}"
        )
    twice = (statistics.median(step_times[CONTROL]), statistics.median(step_times[CONTROL_OF]))
    resolution = max(twice) / min(twice)
    print(f"control: {CONTROL_OF} measured twice in every round, {twice[0] * 1e3:.1f} and "
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
    # the pairs whose measured order is the same in every round (the round medians do not overlap)
    count("in the same measured order in every round",
          [(a, b) for a, b in pairs if max(round_medians[a[0]]) < min(round_medians[b[0]])
           or max(round_medians[b[0]]) < min(round_medians[a[0]])])
    count(f"measured further apart than the control ({resolution:.3f}x)",
          [(a, b) for a, b in pairs if max(a[2], b[2]) / min(a[2], b[2]) > resolution])
    for side, col in (("measured", 2), ("predicted", 1)):
        count(f"{side} more than 10% apart", [(a, b) for a, b in pairs if abs(a[col] / b[col] - 1) > 0.10])

if __name__ == "__main__":
    main()
