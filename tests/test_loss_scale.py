"""fp16 mixed precision with loss scaling (fmoe/precision.py: LossScale, unscale_; the executor's loss_scale).

Oracles: a plain imperative loop with Megatron's DynamicGradScaler trackers (the state machine); float64
gradients of the same master weights (the fp16 gradients); the executor's unscaled run (its scaled one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fmoe import schedule as S
from fmoe._compat import keystr, tree_flatten, tree_flatten_with_path, tree_map
from fmoe.model import init_gpt, init_gpt_state
from fmoe.pipeline import gpt_pipeline_step, gpt_program, split_microbatches
from fmoe.precision import POLICIES, LossScale, cast_to_compute, unscale_
from fmoe.schedule.options import ExecOptions

sys.path.insert(0, str(Path(__file__).parent))
from test_precision import _cfg, _grads, is_zero_gradient, same_routing  # noqa: E402  (the bf16 tests' tiny GPT)

FP16 = POLICIES["fp16-mixed"]


def _megatron_loop(scale: float, flags: list[bool], window: int, hysteresis: int, min_scale: float,
                   ) -> list[float]:
    """The scale after each step, by mutable trackers as Megatron's DynamicGradScaler.update keeps them."""
    growth_tracker, hysteresis_tracker, out = 0, hysteresis, []
    for finite in flags:
        if not finite:
            growth_tracker = 0
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = max(scale * 0.5, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == window:
                growth_tracker, hysteresis_tracker = 0, hysteresis
                scale *= 2.0
        out.append(scale)
    return out


@settings(max_examples=60, deadline=None)
@example(flags=[False, False, True, True, True], window=3, hysteresis=2)  # hysteresis, then regrowth
@example(flags=[False] * 12, window=1, hysteresis=1)                      # floored at min_scale
@example(flags=[True] * 7, window=2, hysteresis=3)                        # growth only
@given(flags=st.lists(st.booleans(), max_size=40), window=st.integers(1, 5), hysteresis=st.integers(1, 3))
def test_dynamic_scale_follows_megatrons_update(flags: list[bool], window: int, hysteresis: int) -> None:
    ls = LossScale.dynamic_scale(2.0**10, growth_interval=window, min_scale=4.0, hysteresis=hysteresis)
    got = []
    for finite in flags:
        ls = ls.adjust(finite)
        got.append(ls.scale)
    assert got == _megatron_loop(2.0**10, flags, window, hysteresis, 4.0)


def test_hysteresis_example_by_hand() -> None:
    ls = LossScale.dynamic_scale(8.0, growth_interval=3, hysteresis=2)
    scales = []
    for finite in [False, False, True, True, True, False]:
        ls = ls.adjust(finite)
        scales.append(ls.scale)
    assert scales == [8.0, 4.0, 4.0, 4.0, 8.0, 8.0]  # the first overflow is tolerated, growth resets it


def test_static_scale_never_moves_and_bad_values_are_refused() -> None:
    ls = LossScale.static_scale(128.0)
    for finite in [False, True, False]:
        ls = ls.adjust(finite)
    assert ls.scale == 128.0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            LossScale.static_scale(bad)
    with pytest.raises(ValueError, match="growth_interval and hysteresis"):
        LossScale.dynamic_scale(2.0, hysteresis=0)


def test_unscale_divides_in_place_and_reports_non_finite() -> None:
    ls = LossScale.static_scale(4.0)
    a, b = torch.tensor([4.0, 8.0]), torch.tensor([2.0])
    assert bool(unscale_([a, b], ls))
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [0.5]
    for bad in (float("inf"), float("nan")):
        assert not bool(unscale_([torch.tensor([1.0]), torch.tensor([bad])], ls))
    assert bool(unscale_([], ls))


def _unscaled(grads: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """fp16 gradients summed into fp32 and divided by the loss scale, as the training step does."""
    out = [g.float() for g in grads]
    assert bool(unscale_(out, LossScale.static_scale(scale)))
    return out


@settings(max_examples=6, deadline=None)
@example(E=1, K=1, seed=0)  # one expert
@example(E=4, K=4, seed=1)  # top-k = E
@given(E=st.sampled_from([2, 4]), K=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_loss_scaling_recovers_fp16_gradients_that_underflow_without_it(E: int, K: int, seed: int) -> None:
    """A loss weighted 2**-20 (as a small loss term or many microbatches give): its fp16 gradients
    flush to zero unscaled, and track the float64 oracle once the backward is scaled by 2**20 and the
    fp32 sums divided by it."""
    cfg = _cfg(E, min(K, E), mtp=False)
    master = init_gpt(cfg, torch.Generator().manual_seed(seed))
    seq = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed + 1))
    ids, targets = seq[:, :-1], seq[:, 1:]
    mult = 2.0**-20
    compute = cast_to_compute(master, FP16)
    assert all(t.dtype == torch.float16 for t in tree_flatten(compute)[0])
    _, routes_ref, ref = _grads(tree_map(lambda t: t.double(), master), ids, targets, cfg, mult)
    _, routes, scaled = _grads(compute, ids, targets, cfg, mult * 2.0**20)
    _, _, unscaled = _grads(compute, ids, targets, cfg, mult)
    # A token whose top-k scores nearly tie may pick another expert in fp16: another function (see
    # test_precision). Compare where the routing is the oracle's.
    assume(same_routing(routes, routes_ref))
    scaled, unscaled = _unscaled(scaled, 2.0**20), _unscaled(unscaled, 1.0)
    names = [keystr(p) for p, _ in tree_flatten_with_path(master)[0]]

    def err(g: torch.Tensor, r: torch.Tensor) -> float:
        return float((g.double() - r).norm() / r.norm().clamp(min=1e-30))

    nonzero = [k for k, r in enumerate(ref) if not is_zero_gradient(r, ref)]
    for k in nonzero:
        assert err(scaled[k], ref[k]) < 0.01, (names[k], err(scaled[k], ref[k]))  # fp16: 0.4% seen
    kept = [names[k] for k in nonzero if err(unscaled[k], ref[k]) < 0.5]
    assert not kept, kept  # unscaled, every leaf loses most of its gradient (measured: all of it)


def test_executor_loss_scale_multiplies_gradients_not_the_loss() -> None:
    cfg = _cfg(4, 2, mtp=True)
    params = init_gpt(cfg, torch.Generator().manual_seed(3))
    seq = torch.randint(0, cfg.vocab_size, (4, 9), generator=torch.Generator().manual_seed(4))
    batches = split_microbatches(seq[:, :-1], seq[:, 1:], 2)
    plain = gpt_pipeline_step(gpt_program(cfg, S.one_f_one_b(1, 2), 0), params, init_gpt_state(cfg), batches)
    scaled = gpt_pipeline_step(gpt_program(cfg, S.one_f_one_b(1, 2), 0), params, init_gpt_state(cfg), batches,
                               options=ExecOptions(loss_scale=1024.0))
    assert float(scaled.loss) == float(plain.loss)
    for (path, a), b in zip(tree_flatten_with_path(plain.grads)[0], tree_flatten(scaled.grads)[0]):
        if a is not None:
            torch.testing.assert_close(b, a * 1024.0, rtol=0, atol=0, msg=keystr(path))  # 2**10: exact
    with pytest.raises(ValueError, match="loss_scale"):
        gpt_pipeline_step(gpt_program(cfg, S.one_f_one_b(1, 2), 0), params, init_gpt_state(cfg), batches,
                          options=ExecOptions(loss_scale=0.0))
