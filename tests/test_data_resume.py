"""The data's place in a checkpoint, on `--data-path` documents: a run stopped after its last checkpoint and
resumed reads the very samples the uninterrupted run read (and trains to the same losses, bitwise), in the
same layout and in another (dp 2); a resume on other data is refused with one line naming the difference,
unless --override-data. The oracle is the uninterrupted run, its batches recorded as it read them.

The runs are in-process (`train_rank` on a one-rank gloo group; the dp 2 run as two spawned gloo ranks), on a
model small enough for a few steps in seconds; a "kill" is the uninterrupted run's directory with its last
checkpoint removed (what a kill after step 2 leaves behind).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import spawn

from fmoe.parallel import ParallelLayout
from fmoe.train import checkpoint, loop
from fmoe.train.config import TrainConfig
from fmoe.train.data_source import data_identity
from fmoe.train.indexed import IndexedWriter
from fmoe.train.launch import _world, train_rank
from fmoe.train.loop import World

V, EOD = 64, 63  # NullTokenizer: the EOD is the last id of --vocab-size
STEPS = 4


def _dataset(root: Path, rewrite: bool = False) -> str:
    """ROOT/corpus_text_document: 120 documents of random tokens, each ending with the EOD (written once)."""
    rng = np.random.default_rng(0)
    prefix = str(root / "corpus_text_document")
    if Path(prefix + ".idx").is_file() and not rewrite:
        return prefix
    with IndexedWriter(prefix, np.uint16) as w:
        for _ in range(120):
            doc = [*rng.integers(0, EOD, size=int(rng.integers(3, 40))).tolist(), EOD]
            w.add_document(doc, [len(doc)])
    return prefix


def _config(root: Path, **kw) -> TrainConfig:
    base = dict(pp=1, ep=1, num_layers=2, hidden_size=32, ffn_hidden_size=64, moe_ffn_hidden_size=32,
                num_experts=4, num_attention_heads=2, first_k_dense=1, seq_length=16, micro_batch_size=2,
                global_batch_size=8, steps=STEPS, vocab_size=V, data_path=(_dataset(root),),
                tokenizer_type="NullTokenizer", eod_mask_loss=True, reset_position_ids=True,
                reset_attention_mask=True, lr_warmup_iters=1, progress=False,
                moe_router_bias_update_rate=1e-2)
    return TrainConfig(**{**base, **kw})


def _run(tc: TrainConfig, world: World | None = None) -> list[tuple]:
    """Trains `tc` on this rank (alone on a fresh one-rank group without `world`); returns (consumed samples,
    data rank, ids) of every batch it read."""
    seen: list[tuple] = []
    read = loop.microbatches

    def recording(dataset, step, **kw):
        out = read(dataset, step, **kw)
        if dataset is not None and kw.get("start") is not None:
            seen.append((kw["start"], kw["data_rank"], torch.cat([ids for ids, _ in out]).tolist()))
        return out

    loop.microbatches = recording
    alone = world is None
    world = _world(tc, 0, f"file://{tempfile.mktemp()}", 0, 1) if alone else world
    try:
        train_rank(tc, world)
    finally:
        loop.microbatches = read
        if alone:
            dist.destroy_process_group()
    return seen


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(metrics: list[dict]) -> list[tuple]:
    return [(m["step"], m["loss"], m["main_loss"], m["grad_norm"]) for m in metrics]


def _dp2_rank(rank: int, world: int, tc: TrainConfig) -> list[tuple]:
    layout = ParallelLayout(pp=tc.pp, ep=tc.ep, dp=tc.dp)
    return _run(tc, World(rank, world, layout, torch.device("cpu")))


def _global(seen: list[tuple]) -> dict[int, list]:
    """start -> the global batch's rows, data ranks in order (each rank's rows are a contiguous run)."""
    out: dict[int, list] = {}
    for start, _, rows in sorted(seen, key=lambda s: (s[0], s[1])):
        out.setdefault(start, []).extend(rows)
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    tc = _config(root, save=str(root / "ckpt"), save_interval=2, metrics=str(root / "m.jsonl"))
    seen = _run(tc)
    return root, tc, seen, _metrics(root / "m.jsonl")


def _killed_after_step_2(root: Path, name: str) -> Path:
    """A --save directory as a kill after step 2 leaves it: step 2 its latest checkpoint."""
    out = root / name
    out.mkdir()
    shutil.copytree(root / "ckpt" / "step_00000002", out / "step_00000002")
    (out / checkpoint.LATEST).write_text("step_00000002\n")
    return out


def test_a_resume_reads_the_samples_of_the_uninterrupted_run_and_trains_bitwise_alike(uninterrupted) -> None:
    root, tc, ref_seen, ref = uninterrupted
    assert [s[0] for s in ref_seen] == [0, 8, 16, 24]  # positions = samples consumed before each step
    save = _killed_after_step_2(root, "resume")
    seen = _run(_config(root, save=str(save), resume=True, metrics=str(root / "r.jsonl")))
    assert seen == ref_seen[2:]  # the very samples, in order
    assert _losses(_metrics(root / "r.jsonl")) == _losses(ref[2:])  # and bitwise the same training
    masked = sum(row.count(EOD) for _, _, rows in ref_seen for row in rows)
    assert masked > 0  # the data holds documents boundaries, inside samples


def test_a_resume_into_another_layout_reads_the_same_global_batches(uninterrupted, monkeypatch) -> None:
    root, tc, ref_seen, ref = uninterrupted
    save = _killed_after_step_2(root, "dp2")
    other = _config(root, dp=2, load=str(save / "step_00000002"), metrics=str(root / "dp2.jsonl"))
    results = spawn(_dp2_rank, 2, other, timeout_s=240)
    seen = [s for r in results for s in r.value]
    assert {rank for _, rank, _ in seen} == {0, 1}
    assert _global(seen) == _global(ref_seen[2:])  # the same global batches, split over two data ranks
    for want, have in zip(ref[2:], _metrics(root / "dp2.jsonl"), strict=True):
        assert have["step"] == want["step"]
        for key in ("loss", "main_loss", "grad_norm"):
            assert have[key] == pytest.approx(want[key], rel=1e-5), (want["step"], key)


@pytest.mark.parametrize("change, words", [
    ({"split": "90,10"}, "split: checkpoint '969,30,1', this run '90,10'"),
    ({"seed": 7}, "seed: checkpoint 1234, this run 7"),
    ({"eod_mask_loss": False}, "eod_mask: checkpoint 63, this run None"),
    ({"reset_attention_mask": False}, "reset_attention_mask: checkpoint True, this run False"),
    ({"reset_position_ids": False}, "reset_position_ids: checkpoint True, this run False"),
    ({"data_path": ("2", "A", "1", "B")}, "blend: checkpoint"),
    ({"data_path": None}, "source: checkpoint 'data-path', this run 'markov'"),
])
def test_a_resume_on_other_data_is_refused_in_one_line(uninterrupted, change: dict, words: str) -> None:
    root, tc, _, _ = uninterrupted
    meta = checkpoint.read_meta(root / "ckpt" / "step_00000002")
    now = _config(root, **change) if change.get("data_path", ()) is not None else _config(
        root, data_path=None, eod_mask_loss=False, reset_position_ids=False, reset_attention_mask=False,
        tokenizer_type=None)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.check_data(meta, data_identity(now), "ckpt/step_00000002")
    text = str(info.value)
    assert words in text and "--override-data" in text and "\n" not in text
    checkpoint.check_data(meta, data_identity(_config(root)), "same")  # the same flags pass


def test_a_rewritten_data_file_is_refused_and_override_data_goes_on(uninterrupted) -> None:
    root, tc, _, _ = uninterrupted
    save = _killed_after_step_2(root, "rewritten")
    moved = root / "other"
    moved.mkdir()
    prefix = str(moved / "corpus_text_document")
    with IndexedWriter(prefix, np.uint16) as w:  # same path as a fresh preprocess would overwrite: new tokens
        w.add_document([1, 2, 3, EOD] * 30, [120])
    meta = checkpoint.read_meta(save / "step_00000002")
    saved_prefix = meta["data"]["blend"][0][1]
    shutil.copy(prefix + ".bin", saved_prefix + ".bin")
    shutil.copy(prefix + ".idx", saved_prefix + ".idx")
    try:
        now = data_identity(_config(root, data_path=(saved_prefix,)))
        with pytest.raises(checkpoint.CheckpointError,
                           match=r"corpus_text_document.bin: checkpoint \d+ bytes"):
            checkpoint.check_data(meta, now, "ckpt")
        seen = _run(_config(root, data_path=(saved_prefix,), save=str(save), resume=True,
                            override_data=True))
        assert [s[0] for s in seen] == [16, 24]  # it goes on from the checkpoint's position, on this data
    finally:
        _dataset(root, rewrite=True)  # put the uninterrupted run's data back for the other tests


def test_a_text_file_run_resumed_without_data_is_refused_not_continued_on_markov(tmp_path) -> None:
    text = tmp_path / "book.txt"
    text.write_text("some text " * 500)
    run = TrainConfig(data=str(text), data_kind="text", vocab_size=256)
    meta = {"config": run.as_dict()}  # what an fmoe train checkpoint from before "data" was recorded holds
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"source: checkpoint 'text file .*book.txt', this run 'markov'"):
        checkpoint.check_data(meta, data_identity(TrainConfig(vocab_size=256)), "old")
    meta["data"] = data_identity(run)
    with pytest.raises(checkpoint.CheckpointError, match="source: checkpoint 'text file"):
        checkpoint.check_data(meta, data_identity(TrainConfig(vocab_size=256)), "new")
    checkpoint.check_data({"config": {"num_layers": 4}}, data_identity(run), "converted")  # fmoe convert's


def test_fmoe_train_on_documents_in_a_pipeline_equals_the_one_process_run(tmp_path) -> None:
    """`fmoe train --reset-position-ids --reset-attention-mask --eod-mask-loss --mtp` on an indexed dataset
    at pp 2 (1F1B: the documents ride in each microbatch's meta to both stages, the held-out evaluation's
    too) equal to the one-process run (in this process, the same config) step by step, fp64."""
    from test_train import _train

    common = dict(mtp=True, dtype="float64", steps=2, eval_interval=2, eval_iters=1, split="8,2")
    _run(_config(tmp_path, **common, metrics=str(tmp_path / "ref.jsonl")))
    ref = _metrics(tmp_path / "ref.jsonl")
    given = dataclasses.asdict(_config(tmp_path, **common))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in given.items() if k in _FLAGGED]
    pp2 = _train(tmp_path, "pp2", *flags, "--data-path", _dataset(tmp_path), "--mtp", "--reset-position-ids",
                 "--reset-attention-mask", "--eod-mask-loss", "--pp", "2", "--ep", "1", "--schedule", "1f1b")
    assert [m["step"] for m in pp2] == [m["step"] for m in ref] == [1, 2]
    for w, h in zip(ref, pp2, strict=True):
        for key in ("loss", "main_loss", "mtp_loss", "grad_norm", "eval_loss"):
            if key in w:
                assert h[key] == pytest.approx(w[key], rel=1e-9), (w["step"], key)
    assert "eval_loss" in ref[-1] and ref[-1]["mtp_loss"] > 0


# the _config fields given to `fmoe train` as flags (the switches and the data path are spelled out)
_FLAGGED = ("num_layers", "hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "num_experts",
            "num_attention_heads", "first_k_dense", "seq_length", "micro_batch_size", "global_batch_size",
            "steps", "vocab_size", "tokenizer_type", "lr_warmup_iters", "moe_router_bias_update_rate",
            "dtype", "eval_interval", "eval_iters", "split", "seed")
