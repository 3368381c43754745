"""The held-out data of `fmoe train`: which windows train and which evaluate, never the same ones.

    train = train_dataset(tc)        # what the steps read (fmoe/train/data.py's batch stream over it)
    valid = valid_dataset(tc)        # what --eval-interval evaluates on (None without evaluation)

- A data file: its windows (non-overlapping, seq_length + 1 tokens each) are cut by `--split`, Megatron's
  "train,valid,test" weights (default 969,30,1), into three contiguous runs of windows: train the first,
  valid the next, test the last (held out, never read). Boundaries as Megatron's dataset builder puts
  them: round(cumulative fraction x windows). Contiguous runs of non-overlapping windows share no token.
- The Markov corpus: the training corpus is the one `fmoe train` always drew (--markov-sequences
  sequences, generator seed --seed + 1); the validation set is eval_iters x global_batch_size further
  sequences of the same chain drawn with seed --seed + 2, so training data is unchanged whether or not a
  run evaluates, and the same corpus floor (the chain's entropy rate) applies to both. --split does not
  apply to it.
- `--data-path`: --split cuts each prefix's documents (fmoe/train/documents.py); the validation set is the
  blend of the prefixes' validation documents, with the same weights.
"""

from __future__ import annotations

from typing import Any

from fmoe.train.data import Dataset, file_dataset, markov_chain, markov_corpus, markov_dataset
from fmoe.train.documents import Blend
from fmoe.train.split_rule import parse_split as parse_split  # where callers have found them
from fmoe.train.split_rule import split_bounds as split_bounds

# a fmoe.train.config.TrainConfig, named and not imported: the config reads the data modules (through
# fmoe.train.data_source), so an import back, even for types, would close a circle
TrainConfig = Any

VALID_SEED_OFFSET = 2  # the training corpus is drawn with seed + 1 (markov_dataset), the chain with seed


def window_range(ds: Dataset, windows: range, part: str) -> Dataset:
    """Returns the Dataset of windows `windows` of file dataset `ds` (a view of its memory map: nothing is
    read), named after `part`."""
    w = ds.seq_len + 1
    return Dataset(name=f"{ds.name} {part} windows [{windows.start}, {windows.stop})",
                   vocab_size=ds.vocab_size, seq_len=ds.seq_len,
                   source=ds.source[windows.start * w: windows.stop * w], floor=ds.floor, path=ds.path)


def _file_parts(tc: TrainConfig) -> tuple[Dataset, tuple[range, range, range]]:
    ds = file_dataset(tc.data, tc.data_kind, tc.seq_length, tc.vocab_size)
    return ds, split_bounds(ds.num_windows, tc.split)


def _documents(tc: TrainConfig, part: str) -> Blend:
    from fmoe.train.documents import documents_dataset, parse_data_path

    return documents_dataset(parse_data_path(tc.data_path), seq_len=tc.seq_length, split=tc.split, part=part,
                             vocab_size=tc.vocab_size, seed=tc.seed)


def train_dataset(tc: TrainConfig) -> Dataset | Blend:
    """The data the run trains on (module docstring)."""
    if tc.data_path is not None:
        return _documents(tc, "train")
    if tc.data == "markov":
        return markov_dataset(tc.vocab_size, tc.seq_length, tc.markov_sequences, tc.seed)
    ds, (train, _, _) = _file_parts(tc)
    return window_range(ds, train, "train")


def valid_dataset(tc: TrainConfig) -> Dataset | Blend | None:
    """The held-out data --eval-interval evaluates on (module docstring); None when the run evaluates not."""
    if not tc.eval_interval:
        return None
    if tc.data_path is not None:
        return _documents(tc, "valid")
    if tc.data == "markov":
        n = tc.eval_iters * tc.global_batch_size
        chain = markov_chain(tc.vocab_size, tc.seed)
        corpus = markov_corpus(chain, n, tc.seq_length + 1, tc.seed + VALID_SEED_OFFSET)
        return Dataset(name=f"markov(V={tc.vocab_size}, seed={tc.seed}) validation", vocab_size=tc.vocab_size,
                       seq_len=tc.seq_length, source=corpus, floor=chain.entropy_rate)
    ds, (_, valid, _) = _file_parts(tc)
    return window_range(ds, valid, "valid")


def eval_problem(tc: TrainConfig) -> str | None:
    """One line saying what is wrong with --split / --eval-interval / --eval-iters, or None (checked
    before launch, after the data file's own checks)."""
    try:
        parse_split(tc.split)
    except ValueError as exc:
        return str(exc)
    if tc.eval_iters < 1:
        return f"--eval-iters must be a positive integer, got {tc.eval_iters}"
    if tc.data == "markov" or tc.data_path is not None:  # --data-path's parts: fmoe.train.data_source
        return None
    ds, (train, valid, _) = _file_parts(tc)
    if not len(train):
        return f"--split {tc.split} leaves no training window of {ds.num_windows} in {tc.data}"
    if tc.eval_interval and not len(valid):
        return (f"--eval-interval evaluates on held-out data, but --split {tc.split} leaves no validation "
                f"window of {ds.num_windows} in {tc.data} (raise the valid weight)")
    return None
