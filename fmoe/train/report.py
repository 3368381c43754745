"""What a run shows: a progress bar, one JSON line per step, a summary, the loss-curve PNG and the
measured trace of one step. Rank 0 reports; the other ranks stay quiet."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from fmoe.schedule.timeline import TraceEvent, write_png, write_trace
from fmoe.train.run_errors import RunError

METRIC_KEYS = ("step", "loss", "main_loss", "balance_loss", "mtp_loss", "lr", "grad_norm", "tokens_per_s",
               "step_s", "exposed_comm_frac", "max_over_mean_load", "dropped")
FP16_KEYS = ("loss_scale", "skipped")  # present in an --fp16 run's metrics only
EVAL_KEYS = ("eval_loss", "eval_main_loss", "eval_s")  # on the steps an evaluation followed (--eval-interval)
# --moe-per-layer-logging: MoE layer (checkpoint key) -> tokens per expert; -> the aux-loss-free expert bias
PER_LAYER_KEYS = ("expert_load", "expert_bias")


class Reporter:
    """Rank 0's view of the run: `start(first_step)`, `step(metrics)` per step, `close() -> summary`."""

    def __init__(self, total_steps: int, *, metrics_path: str | None, progress: bool, floor: float | None,
                 describe: str, continue_from: int | None = None, log_interval: int = 0):
        """`continue_from`: the step a --resume run restarts at (the metrics file is continued, its earlier
        steps kept in `earlier` for the loss curve); None for a fresh run (the file is started anew).
        `log_interval`: without the bar, a line every that many steps (0: none)."""
        self.total, self.floor, self.describe = total_steps, floor, describe
        self.history: list[dict[str, Any]] = []
        self.earlier: list[dict[str, Any]] = []  # a resumed run's steps before its checkpoint
        self.log_interval = log_interval if not progress else 0
        self._file: TextIO | None = None
        if metrics_path:
            if continue_from is not None:
                self.earlier = _keep_steps_through(Path(metrics_path), continue_from)
            # A fresh run truncates (as torchtitan starts a new log per run): a file holding two runs'
            # steps reads as one; --resume appends to its own run's lines.
            with _named("--metrics", metrics_path):
                self._file = open(metrics_path, "a" if continue_from is not None else "w")  # noqa: SIM115
        self._metrics_path = metrics_path
        self._progress = progress
        self._bar: Any = None
        self._eval: str = ""  # the last evaluation, kept on the bar until the next one

    def start(self, first_step: int) -> None:
        """Prints what the run is (layers, layout, data, floor) and opens the progress bar at `first_step`
        (0 for a fresh run, the checkpoint's step on resume)."""
        print(f"fmoe train: {self.describe}; steps {first_step + 1}-{self.total}", flush=True)
        if self._progress:
            self._bar = _progress_bar(self.total, first_step)

    def step(self, m: dict[str, Any]) -> None:
        """Records one step's metrics: a JSON line, the bar's postfix."""
        self.history.append(m)
        if self._file is not None:
            keys = (*METRIC_KEYS, *FP16_KEYS, *EVAL_KEYS, *PER_LAYER_KEYS)
            with _named("--metrics", self._metrics_path):
                self._file.write(json.dumps({k: m[k] for k in keys if k in m}) + "\n")
                self._file.flush()
        if "eval_main_loss" in m:
            self._eval = f" eval {m['eval_main_loss']:.3f}@{m['step']}"
        if self.log_interval and (m["step"] % self.log_interval == 0 or m["step"] == self.total):
            print(f"fmoe train: step {m['step']}/{self.total} {_line(m)} lr {m['lr']:.3g} grad norm "
                  f"{m['grad_norm']:.3g}{self._eval}", flush=True)
        if self._bar is not None:
            self._bar.set_postfix_str(_line(m) + self._eval, refresh=False)
            self._bar.update(1)

    def close(self) -> str:
        """Closes the bar and the metrics file; returns the summary text (also what `fmoe train` prints)."""
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if not self.history:
            return "fmoe train: no step ran (the checkpoint is already at --steps)"
        last = self.history[-1]
        tail = self.history[-min(10, len(self.history)):]
        main = sum(m["main_loss"] for m in tail) / len(tail)
        first = self.history[0]
        lines = [f"fmoe train: {self.describe}",
                 f"  steps {first['step']}-{last['step']}: main loss {first['main_loss']:.4f}"
                 f" -> {last['main_loss']:.4f} (mean of the last {len(tail)}: {main:.4f})"]
        if self.floor is not None:
            lines.append(f"  corpus floor (entropy rate) {self.floor:.4f} nats/token: the last-{len(tail)} "
                         f"mean is {main - self.floor:+.4f} above it")
        evals = [m for m in self.history if "eval_main_loss" in m]
        if evals:
            e = evals[-1]
            spent = sum(m["eval_s"] for m in evals)
            train_s = sum(m["step_s"] for m in self.history)
            gap = e["eval_main_loss"] - self.floor if self.floor is not None else None
            above = f", {gap:+.4f} above the floor" if gap is not None else ""
            lines.append(f"  held-out eval after step {e['step']}: main loss {e['eval_main_loss']:.4f} "
                         f"(total {e['eval_loss']:.4f}){above}; {len(evals)} evaluations took {spent:.2f} s "
                         f"({100 * spent / max(train_s, 1e-9):.1f}% of the training steps' time)")
        steady = self.history[1:] or self.history
        def median(key: str) -> float:
            return sorted(m[key] for m in steady)[len(steady) // 2]

        exposed = 100 * sum(m["exposed_comm_frac"] for m in steady) / len(steady)
        lines.append(f"  median {median('tokens_per_s'):.0f} tokens/s, step {median('step_s'):.3f} s, "
                     f"exposed comm {exposed:.1f}% (steps after the first)")
        if "loss_scale" in last:
            skipped = sum(bool(m["skipped"]) for m in self.history)
            lines.append(f"  fp16: {skipped} of {len(self.history)} steps skipped (non-finite gradients), "
                         f"last loss scale {last['loss_scale']:g}")
        return "\n".join(lines)


@contextmanager
def _named(flag: str, path: str | None) -> Iterator[None]:
    """An OSError inside (a full disk, a folder that is a file) as a RunError naming the flag and path."""
    try:
        yield
    except OSError as exc:
        raise RunError(f"{flag} {path}: cannot write ({exc.strerror or exc}): free space there or give "
                       "another path") from None


def _line(m: dict[str, Any]) -> str:
    """One step's figures as the bar and the --log-interval lines show them."""
    return (f"loss {m['main_loss']:.3f} tok/s {m['tokens_per_s']:.0f} step {m['step_s'] * 1e3:.0f}ms "
            f"exposed {100 * m['exposed_comm_frac']:.0f}% load {m['max_over_mean_load']:.2f} "
            f"drop {m['dropped']}" + (f" scale {m['loss_scale']:g}" if "loss_scale" in m else ""))


def _progress_bar(total: int, first_step: int) -> Any:
    """A tqdm bar from `first_step` of `total`. One process writes it: a rank, whose bars write under a
    thread lock (fmoe.parallel.teardown.thread_locks_for_bars: tqdm's default lock is a named semaphore that
    a rank's os._exit would leave to the resource tracker)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=first_step, unit="step", dynamic_ncols=True, desc="fmoe train")


def _keep_steps_through(path: Path, step: int) -> list[dict[str, Any]]:
    """Drops the lines of `path` after step `step` (steps the crashed run made past its checkpoint, which
    the resumed run makes again) and a torn last line, so each step appears once; returns the kept
    steps' metrics."""
    if not path.is_file():
        return []
    kept, steps = [], []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
            if int(m["step"]) <= step:
                kept.append(line + "\n")
                steps.append(m)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(kept))
    return steps


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The steps' metrics in a --metrics file (a torn or foreign line skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if isinstance(m, dict) and "step" in m and "main_loss" in m and "loss" in m:
            out.append(m)
    return out


def write_loss_curve(history: list[dict[str, Any]], path: str | Path, floor: float | None,
                     title: str, resumed_at: int | None = None) -> Path | None:
    """Draws main loss (and total loss) against step, with the corpus floor, to `path` (a dotted line at
    `resumed_at`, the checkpoint a resumed run continued from); returns it, or None when matplotlib is not
    installed (pip install 'fmoe[viz]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [m["step"] for m in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [m["main_loss"] for m in history], label="main loss (cross-entropy)")
    ax.plot(steps, [m["loss"] for m in history], label="training loss", alpha=0.5)
    evals = [m for m in history if "eval_main_loss" in m]
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval_main_loss"] for m in evals], "o-",
                label="held-out main loss")
    if floor is not None:
        ax.axhline(floor, color="black", linestyle="--", label=f"floor {floor:.3f}")
    if resumed_at is not None:
        ax.axvline(resumed_at, color="gray", linestyle=":", label=f"resumed after step {resumed_at}")
    ax.set_xlabel("step")
    ax.set_ylabel("nats / token")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)
    ax.legend()
    top = max(m["main_loss"] for m in history)
    ax.set_ylim(bottom=0 if floor is None else max(0.0, floor - 0.5),
                top=top * 1.05 if math.isfinite(top) else None)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_step_trace(events_by_rank: list[list[TraceEvent]], path: str | Path,
                     meta: dict[str, Any] | None = None) -> list[Path]:
    """Writes the measured Chrome trace of one step (every rank's events, re-numbered by global rank,
    times from the earliest event) to `path` (`meta` into its otherData and process names: whether the
    compute model was on), and its timeline PNG next to it when matplotlib is there; returns the paths
    written."""
    events = [replace(e, rank=rank) for rank, evs in enumerate(events_by_rank) for e in evs]
    path = Path(path)
    out = [write_trace(events, path, us_per_unit=1e6, name="fmoe train step", meta=meta)]
    try:
        out.append(write_png(events, path.with_suffix(".png"), title="fmoe train: one measured step",
                             unit="s"))
    except ImportError:
        pass
    return out
