"""Held-out evaluation of `fmoe train` (--eval-interval, --eval-iters, --split): the validation data never
overlaps the training data; an evaluation runs forward only and changes nothing of the training run (its
losses, weights and MoE state bitwise equal to a run that never evaluates); every layout's eval loss
agrees with the one-process run's (`gpt_loss` through autograd's forward, no executor).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_utils import spawn

from fmoe.model import gpt_loss
from fmoe.parallel import ParallelLayout
from fmoe.train.config import TrainConfig
from fmoe.train.data import microbatches
from fmoe.train.evaluate import due, evaluate
from fmoe.train.launch import _world
from fmoe.train.loop import Trainer, World
from fmoe.train.splits import parse_split, split_bounds, train_dataset, valid_dataset

NUMERIC = ("loss", "main_loss", "balance_loss", "lr", "grad_norm", "max_over_mean_load", "dropped")


def _read(ds, steps: int, seed: int) -> set[int]:
    """The tokens the batch stream over `ds` (global batch 8, one data rank) reads in `steps` steps."""
    seen: set[int] = set()
    for step in range(steps):
        for ids, targets in microbatches(ds, step, global_batch=8, micro_batch=4, data_rank=0, data_ranks=1,
                                         seed=seed):
            seen |= set(ids.flatten().tolist()) | set(targets.flatten().tolist())
    return seen


def test_a_file_is_cut_into_train_valid_and_test_windows_that_share_no_token(tmp_path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(4096, dtype=np.uint16).tofile(path)  # every token once: a shared token is a shared position
    tc = TrainConfig(data=str(path), data_kind="bin16", vocab_size=4096, seq_length=15, split="80,15,5",
                     eval_interval=1, global_batch_size=8, micro_batch_size=4, pp=1, ep=1)
    assert tc.problem() is None
    train, valid = train_dataset(tc), valid_dataset(tc)
    assert (train.num_windows, valid.num_windows) == (205, 38)  # of 256: round(.8 N), round(.95 N) - that
    seen_train = _read(train, train.num_windows // 8 + 2, tc.seed)  # an epoch and more of training
    seen_valid = _read(valid, tc.eval_iters, tc.seed)  # what one evaluation reads
    assert seen_train == set(range(205 * 16)) and seen_valid <= set(range(205 * 16, 243 * 16))
    assert len(seen_valid) == 38 * 16  # 10 batches of 8 windows visit all 38 validation windows
    # the test share stays unread: nothing past window 243
    assert max(seen_valid) < 243 * 16


def test_the_markov_validation_set_is_another_draw_and_leaves_the_training_corpus_alone() -> None:
    from fmoe.train.data import markov_dataset

    tc = TrainConfig(markov_sequences=2048, eval_interval=5, eval_iters=3, global_batch_size=32)
    train, valid = train_dataset(tc), valid_dataset(tc)
    assert torch.equal(train.source, markov_dataset(64, 64, 2048, tc.seed).source)  # as before evaluation
    assert valid.num_windows == 3 * 32 and valid.floor == train.floor
    rows = {tuple(r) for r in train.source.tolist()}
    assert not any(tuple(r) in rows for r in valid.source.tolist())
    assert valid_dataset(TrainConfig()) is None  # no evaluation, nothing drawn


def test_split_parsing_and_bounds() -> None:
    assert parse_split("969,30,1") == pytest.approx((0.969, 0.030, 0.001))
    assert parse_split("98,2") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("1") == (1.0, 0.0, 0.0)
    for bad in ("a,b", "-1,2", "0,0", "1,2,3,4", ""):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    train, valid, test = split_bounds(1000, "969,30,1")
    assert (train, valid, test) == (range(0, 969), range(969, 999), range(999, 1000))


def test_bad_eval_flags_fail_with_one_line_before_launch(tmp_path, capsys, no_launch: None) -> None:
    from fmoe.cli.main import main

    small = tmp_path / "small.bin"
    np.zeros(65 * 40, dtype=np.uint16).tofile(small)  # 40 windows: 969,30,1 leaves round(39.96) - 39 = 1
    tiny = tmp_path / "tiny.bin"
    np.zeros(65 * 10, dtype=np.uint16).tofile(tiny)  # 10 windows: none for validation
    data = ("--data", str(tiny), "--data-kind", "bin16")
    cases = [((*data, "--eval-interval", "5"), "leaves no validation window of 10"),
             ((*data, "--split", "0,1"), "leaves no training window"),
             ((*data, "--split", "1,x"), "--split must be"),
             (("--split", "1,x"), "--split applies to --data FILE or --data-path"),
             (("--eval-interval", "5", "--eval-iters", "0"), "--eval-iters must be a positive integer"),
             (("--eval-interval", "-1"), "--eval-interval must be >= 0")]
    for flags, needle in cases:
        code = main(["train", "--no-progress", *flags])
        out = capsys.readouterr()
        text = (out.out + out.err).strip()
        assert code == 2 and needle in text and len(text.splitlines()) == 1, (flags, text)
    ok = TrainConfig(data=str(small), data_kind="bin16", eval_interval=5)
    assert ok.problem() is None and valid_dataset(ok).num_windows == 1
    assert [s for s in range(1, 13) if due(TrainConfig(steps=12, eval_interval=5), s)] == [5, 10, 12]


FLAGS = {"steps": 2, "eval_iters": 2, "lr_warmup_iters": 1, "moe_router_bias_update_rate": 1e-2,
         "seq_length": 16, "global_batch_size": 16, "micro_batch_size": 2, "progress": False}
LAYOUTS = {"pp2_ep2_dualpipev": {"pp": 2, "ep": 2, "dp": 1},
           "pp2_dp2_interleaved": {"pp": 2, "ep": 1, "dp": 2, "schedule": "interleaved"},
           "pp1_ep2_dp2_combined": {"pp": 1, "ep": 2, "dp": 2}}


def _run(trainer: Trainer, with_eval: bool) -> tuple[list, list]:
    """Trains to --steps (evaluating after each step); returns the steps' metrics and the evaluations."""
    steps, evals = [], []
    while trainer.step_done < trainer.tc.steps:
        m = trainer.step()
        steps.append(tuple(m[k] for k in NUMERIC))
        if with_eval:
            rng = torch.get_rng_state()
            evals.append(evaluate(trainer))
            assert torch.equal(rng, torch.get_rng_state())  # the training's RNG stream is left as it was
    return steps, evals


def _state(trainer: Trainer) -> list[torch.Tensor]:
    from fmoe._compat import tree_flatten

    return [t.clone() for t in trainer.tensors.values()] + [
        t.clone() for t in tree_flatten(trainer.state)[0] if isinstance(t, torch.Tensor)]


def _eval_rank(rank: int, world: int) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        tc = TrainConfig(**FLAGS, **layout, eval_interval=1)
        groups = ParallelLayout(pp=tc.pp, ep=tc.ep, dp=tc.dp)
        plain = Trainer(tc, World(rank, world, groups, torch.device("cpu")))
        evaluated = Trainer(tc, World(rank, world, groups, torch.device("cpu")))
        plain_steps, _ = _run(plain, with_eval=False)
        eval_steps, evals = _run(evaluated, with_eval=True)
        same_state = all(torch.equal(a, b) for a, b in zip(_state(plain), _state(evaluated), strict=True))
        out[name] = (plain_steps == eval_steps, same_state, evals)
    return out


def test_evaluation_is_forward_only_and_every_layout_agrees_with_the_one_process_run(tmp_path) -> None:
    tc = TrainConfig(**FLAGS, pp=1, ep=1, dp=1, eval_interval=1)
    world = _world(tc, 0, f"file://{tmp_path / 'store'}", 0, 1)
    try:
        trainer = Trainer(tc, world)
        _, want = _run(trainer, with_eval=True)
    finally:
        torch.distributed.destroy_process_group()
    assert want[0]["eval_main_loss"] > want[-1]["eval_main_loss"]  # it measures the training
    with torch.no_grad():  # what it measures: the cross-entropy of the validation split's first batches
        ce = [gpt_loss(trainer.params, ids, t, trainer.cfg, trainer.state)[1].main_loss
              for i in range(tc.eval_iters) for ids, t in microbatches(
                  valid_dataset(tc), i, global_batch=tc.global_batch_size, micro_batch=tc.micro_batch_size,
                  data_rank=0, data_ranks=1, seed=tc.seed)]
    assert want[-1]["eval_main_loss"] == pytest.approx(float(sum(ce)) / len(ce), rel=1e-6)
    for result in spawn(_eval_rank, 4, timeout_s=400):
        for name, (same_steps, same_state, evals) in result.value.items():
            assert same_steps and same_state, (name, result.rank)  # bitwise: the evaluations changed nothing
            for w, got in zip(want, evals, strict=True):
                for key in ("eval_loss", "eval_main_loss"):
                    assert got[key] == pytest.approx(w[key], rel=2e-5), (name, result.rank, key)


def _eval_tp_rank(rank: int, world: int) -> dict[str, float]:
    tc = TrainConfig(**FLAGS, pp=1, ep=1, dp=1, tp=2, eval_interval=1)
    trainer = Trainer(tc, World(rank, world, ParallelLayout(pp=1, ep=1, dp=1, tp=2), torch.device("cpu")))
    return evaluate(trainer)


def test_a_tensor_parallel_evaluation_agrees_with_the_one_process_run(tmp_path) -> None:
    """Every tp rank holds the whole loss: the evaluation divides the tp copies out, as training does (tp 2
    read twice the one-process eval loss)."""
    tc = TrainConfig(**FLAGS, pp=1, ep=1, dp=1, eval_interval=1)
    world = _world(tc, 0, f"file://{tmp_path / 'store'}", 0, 1)
    try:
        want = evaluate(Trainer(tc, world))  # the initial weights, which tp 2 draws alike
    finally:
        torch.distributed.destroy_process_group()
    for result in spawn(_eval_tp_rank, 2, timeout_s=300):
        for key in ("eval_loss", "eval_main_loss"):
            assert result.value[key] == pytest.approx(want[key], rel=2e-5), (result.rank, key)
