"""The learning-rate schedule of `fmoe train` (fmoe/train/lr_schedule.py): Megatron-LM's
OptimizerParamScheduler with num_steps = the steps done, its flags checked before launch, the old --warmup
read with a warning, and the resume check over every value the LR depends on.

Oracle: `_megatron`, the piecewise definition written out again from Megatron's get_lr (warmup, then the
decay style over [warmup, decay], min_lr after it), checked at every step of random schedules.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe.train.checkpoint import CheckpointError, check_schedule
from fmoe.train.config import TrainConfig
from fmoe.train.lr_schedule import DECAY_STYLES, WSD_DECAY_STYLES, LRSchedule
from fmoe.train.optim import lr_at


def _megatron(s: LRSchedule, n: int) -> float:
    """Megatron's get_lr(num_steps=n), written out from its definition."""
    lr, lo, W, D = s.lr, s.min_lr, s.lr_warmup_iters, s.lr_decay_iters
    if 0 < W and n <= W:
        return s.lr_warmup_init + (lr - s.lr_warmup_init) * n / W
    if s.lr_decay_style == "constant":
        return lr
    if n > D:
        return lo
    if s.lr_decay_style == "inverse-square-root":
        return max(lo, lr * math.sqrt(max(W, 1) / max(n, 1)))
    t = (n - W) / (D - W)  # share of the decay done
    if s.lr_decay_style == "linear":
        return lo + (lr - lo) * (1 - t)
    if s.lr_decay_style == "cosine":
        return lo + (lr - lo) * (1 + math.cos(math.pi * t)) / 2
    stable_until = D - s.lr_wsd_decay_iters  # WSD: flat at lr, then the anneal over the last Wd steps
    if n <= stable_until:
        return lr
    q = (n - stable_until) / s.lr_wsd_decay_iters
    coeff = {"linear": 1 - q, "cosine": (1 + math.cos(math.pi * q)) / 2, "exponential": 2 * 0.5**q - 1,
             "minus_sqrt": 1 - math.sqrt(q)}[s.lr_wsd_decay_style]
    return lo + (lr - lo) * coeff


@st.composite
def schedules(draw: st.DrawFn, styles: tuple[str, ...] = DECAY_STYLES) -> LRSchedule:
    lr = draw(st.floats(1e-5, 1.0))
    warmup = draw(st.integers(0, 40))
    decay = warmup + draw(st.integers(1, 120))
    style = draw(st.sampled_from(styles))
    wsd = draw(st.integers(1, decay - warmup)) if style == "WSD" else None
    return LRSchedule(lr=lr, min_lr=lr * draw(st.floats(0.0, 0.9)), lr_warmup_iters=warmup,
                      lr_decay_iters=decay, lr_decay_style=style,
                      lr_warmup_init=lr * draw(st.sampled_from([0.0, 0.0, 0.1, 0.5])),
                      lr_wsd_decay_iters=wsd, lr_wsd_decay_style=draw(st.sampled_from(WSD_DECAY_STYLES)))


@settings(max_examples=300)
@given(schedules())
def test_every_step_follows_megatrons_definition(s: LRSchedule) -> None:
    for n in range(s.lr_decay_iters + 5):
        assert s.at(n) == pytest.approx(_megatron(s, n), rel=1e-12, abs=1e-15), n


@settings(max_examples=200)
@given(schedules())
def test_warmup_is_linear_from_its_start_then_the_lr_never_rises_and_ends_at_min_lr(s: LRSchedule) -> None:
    W, D = s.lr_warmup_iters, s.lr_decay_iters
    for n in range(W + 1):  # Megatron: lr * n / warmup (from lr_warmup_init, 0 by default)
        want = s.lr_warmup_init + (s.lr - s.lr_warmup_init) * n / W if W else s.lr
        assert s.at(n) == pytest.approx(want, rel=1e-12)
    after = [s.at(n) for n in range(W, D + 10)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(after, after[1:])), after  # monotone decay
    assert all(s.min_lr * (1 - 1e-12) <= x <= s.lr * (1 + 1e-12) for x in after)
    if s.lr_decay_style == "constant":
        assert after == pytest.approx([s.lr] * len(after), rel=1e-12)
    else:  # reaches min_lr at lr_decay_iters (inverse-square-root: right after) and stays there
        end = D if s.lr_decay_style != "inverse-square-root" else D + 1
        assert s.at(end) == pytest.approx(s.min_lr, rel=1e-9, abs=1e-15)
        assert all(s.at(n) == s.min_lr for n in range(D + 1, D + 10))


@settings(max_examples=200)
@given(schedules(styles=("WSD",)))
def test_wsd_holds_the_peak_until_its_anneal(s: LRSchedule) -> None:
    start = s.lr_decay_iters - s.lr_wsd_decay_iters
    assert s.at(s.lr_warmup_iters) == pytest.approx(s.lr, rel=1e-12)  # the warmup's end (its own formula)
    stable = {s.at(n) for n in range(s.lr_warmup_iters + 1, start + 1)}
    assert len(stable) <= 1 and all(x == pytest.approx(s.lr, rel=1e-12) for x in stable)  # flat, at the peak
    assert s.at(start + 1) < s.lr or s.lr == s.min_lr


def test_the_trainer_reads_the_schedule_of_its_flags() -> None:
    tc = TrainConfig(lr=1.0, min_lr=0.0, lr_warmup_iters=2, steps=10, lr_decay_style="WSD",
                     lr_wsd_decay_iters=4, lr_wsd_decay_style="linear")
    assert [lr_at(tc, n) for n in range(11)] == pytest.approx(
        [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    assert lr_at(TrainConfig(lr=1.0, steps=10, lr_decay_iters=4, lr_warmup_iters=0, min_lr=0.1,
                             lr_decay_style="linear"), 5) == 0.1  # --lr-decay-iters, not --steps


def test_warmup_is_read_under_its_old_name_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(FutureWarning, match="--warmup is deprecated: use --lr-warmup-iters"):
        assert TrainConfig.build({"warmup": 5}).lr_warmup_iters == 5
    toml = tmp_path / "old.toml"
    toml.write_text("warmup = 7\n")
    with pytest.warns(FutureWarning):
        assert TrainConfig.from_sources("tiny", str(toml)).lr_warmup_iters == 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="old name of --lr-warmup-iters"):
            TrainConfig.build({"warmup": 5, "lr_warmup_iters": 6})
        assert TrainConfig.build({"warmup": 6, "lr_warmup_iters": 6}).lr_warmup_iters == 6


def test_bad_schedules_fail_with_one_line_before_launch(capsys, no_launch: None) -> None:
    from fmoe.cli.main import main

    cases = [(("--lr-decay-style", "cosin"), "--lr-decay-style must be one of"),
             (("--lr-decay-style", "WSD"), "needs --lr-wsd-decay-iters"),
             (("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "200"), "must lie in [1, 130]"),
             (("--lr-wsd-decay-iters", "5"), "applies to --lr-decay-style WSD only"),
             (("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5", "--lr-wsd-decay-style", "step"),
              "--lr-wsd-decay-style must be one of"),
             (("--lr-decay-iters", "20"), "must exceed --lr-warmup-iters (20)"),
             (("--lr-warmup-init", "1.0"), "--lr-warmup-init must lie in"),
             (("--lr-warmup-iters", "-1"), "--lr-warmup-iters must be >= 0")]
    for flags, needle in cases:
        code = main(["train", "--no-progress", *flags])
        out = capsys.readouterr()
        text = (out.out + out.err).strip()
        assert code == 2 and needle in text and len(text.splitlines()) == 1, (flags, text)
    # the old flag: one warning line, then the run goes on (here to a layout error, before launch)
    code = main(["train", "--no-progress", "--warmup", "3", "--global-batch-size", "30"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[0].startswith("fmoe train: warning: --warmup is deprecated"), err
    assert len(err) == 2 and "multiple of --micro-batch-size" in err[1], err


def test_a_resumed_run_must_keep_every_value_the_lr_depends_on() -> None:
    base = TrainConfig(steps=100, lr_warmup_iters=10).as_dict()
    def refused(saved: dict, now: dict) -> str | None:
        try:
            check_schedule({"config": saved}, now, "ckpt")
        except CheckpointError as exc:
            return str(exc)
        return None

    wsd = {**base, "lr_decay_style": "WSD", "lr_wsd_decay_iters": 20}
    for change, field in (({"lr_decay_style": "linear"}, "lr_decay_style"), ({"steps": 200}, "steps"),
                          ({"lr_decay_iters": 50}, "lr_decay_iters"), ({"min_lr": 0.0}, "min_lr"),
                          ({"lr_warmup_init": 1e-4}, "lr_warmup_init")):
        err = refused(base, {**base, **change})
        assert err is not None and field in err and "--override-opt-param-scheduler" in err, (change, err)
    for change in ({"lr_wsd_decay_iters": 30}, {"lr_wsd_decay_style": "cosine"}):
        assert refused(wsd, {**wsd, **change}) is not None, change
    # what the LR does not depend on may change: --steps past a fixed --lr-decay-iters, WSD flags of cosine
    fixed = {**base, "lr_decay_iters": 100}
    assert refused(fixed, {**fixed, "steps": 300}) is None
    assert refused(base, {**base, "lr_wsd_decay_style": "cosine"}) is None
    # a checkpoint written before these flags: `warmup` and the cosine, read as the same schedule
    old = {**{k: v for k, v in base.items() if not k.startswith("lr_")}, "warmup": 10}
    assert refused(old, base) is None
    assert "lr_warmup_iters: checkpoint 10, this run 5" in refused(old, {**base, "lr_warmup_iters": 5})


def test_a_run_inside_its_warmup_is_warned_about_before_launch(capsys, monkeypatch) -> None:
    """--steps at or below the warmup (default 20) trained the whole run inside the warmup without a word,
    while the same value as --lr-decay-iters is refused: one warning line, naming both flags."""
    import fmoe.train.launch as launch_mod
    from fmoe.cli.main import main

    monkeypatch.setattr(launch_mod, "_device_type", lambda tc: (_ for _ in ()).throw(SystemExit(0)))
    for flags, warned in [(("--steps", "20"), True), (("--steps", "5", "--lr-warmup-iters", "5"), True),
                          (("--steps", "21"), False), (("--steps", "5", "--lr-warmup-iters", "0"), False)]:
        with pytest.raises(SystemExit):
            main(["train", "--no-progress", *flags])
        err = capsys.readouterr().err.strip().splitlines()
        if warned:
            assert len(err) == 1 and err[0].startswith("fmoe train: warning: --steps") and \
                "--lr-warmup-iters" in err[0], (flags, err)
        else:
            assert err == [], (flags, err)
