"""Samples of `--data-path`: documents of Megatron indexed datasets, shuffled per epoch, cut into samples of
seq_length + 1 tokens across document boundaries, and blended by weight.

    blend = parse_data_path(["0.3", "wiki", "0.7", "code"])     # [(0.3, "wiki"), (0.7, "code")]
    ds = documents_dataset(blend, seq_len=S, split="969,30,1", part="train", vocab_size=V, seed=seed)
    windows_PS1 = ds.samples(positions_P)                      # int64 [P, S + 1]

Legend: P stream positions, S positions per sample, D documents of a split, K blend block.

- One prefix (`DocumentStream`): the documents (Megatron's GPT sequences) [a, b) of its `--split` part,
  bounds as Megatron's builder puts them (round(cumulative fraction x documents)). Epoch e visits them
  in the order of a permutation drawn from (seed, part, prefix number, e); their tokens, back to back,
  give N = (T - 1) // S samples, sample j being tokens [j S, j S + S + 1) (neighbours share a token, as
  in Megatron's GPTDataset; the tail that fills no sample is not read that epoch, a different tail the
  next). Stream position p is sample p mod N of epoch p // N: a pure function of p and the seed, so
  a resumed run reads what the uninterrupted one would have, in any layout.
- A blend (`Blend`): position p takes its prefix from a fixed table of K positions filled as Megatron's
  build_blending_indices does (each position to the prefix furthest behind its weight), repeated
  block after block; within a prefix the positions count on. Without weights (several prefixes, no
  numbers) each prefix weighs its tokens, as Megatron's concatenation.
- Memory: the .bin and .idx stay memory-mapped; an epoch costs two arrays of D entries (its order and
  the running token count), whatever the size of the corpus in tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fmoe.train.indexed import IndexedDataset
from fmoe.train.split_rule import split_bounds

__all__ = ["Blend", "DocumentStream", "parse_data_path", "documents_dataset", "BLOCK"]

PARTS = ("train", "valid", "test")
BLOCK = 1 << 16  # K: the blend table's length


def parse_data_path(items: tuple[str, ...] | list[str]) -> list[tuple[float | None, str]]:
    """Megatron's `--data-path` list: one or more prefixes, or weights and prefixes ("0.3 a 0.7 b"), as
    megatron.core.datasets.utils.get_blend_from_list reads it -> [(weight or None, prefix)], weights
    normalized to sum 1. ValueError naming the flag for an empty list, a bad or non-positive weight, or a
    mix of weighted and unweighted entries."""
    items = [s.strip() for s in items if s.strip()]
    if not items:
        raise ValueError("--data-path needs a prefix (or weights and prefixes: 0.3 a 0.7 b)")

    def number(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None

    if len(items) % 2 == 1 or all(number(w) is None for w in items[0::2]):
        numeric = [s for s in items if number(s) is not None]
        if numeric:
            raise ValueError(f"--data-path {' '.join(items)}: give weights and prefixes in pairs (0.3 a 0.7 "
                             f"b) or prefixes only; {numeric[0]!r} looks like a weight without its prefix")
        return [(None, p) for p in items]
    weights = [number(w) for w in items[0::2]]
    if any(w is None for w in weights):
        bad = items[0::2][weights.index(None)]
        raise ValueError(f"--data-path: {bad!r} stands where a weight goes (weights and prefixes in pairs)")
    if not all(w >= 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f"--data-path weights must be >= 0 with a positive sum, got {weights}")
    total = float(sum(weights))
    return [(w / total, p) for w, p in zip(weights, items[1::2])]


def split_documents(num_docs: int, split: str, part: str) -> range:
    """The documents of `part` ("train", "valid", "test") of --split over `num_docs` documents."""
    return split_bounds(num_docs, split)[PARTS.index(part)]


class DocumentStream:
    """One prefix's `part` as an endless seeded stream of samples (module docstring)."""

    def __init__(self, dataset: IndexedDataset, docs: range, *, seq_len: int, seed: int,
                 salt: tuple[int, ...], name: str) -> None:
        self.dataset, self.docs, self.seq_len, self.seed, self.salt, self.name = (
            dataset, docs, seq_len, seed, salt, name)
        lengths_D = dataset.lengths_N[docs.start: docs.stop]
        self.num_tokens = int(lengths_D.sum(dtype=np.int64))
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)  # N per epoch
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()  # the prefetch thread and evaluation may ask at once

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """(order_D, ends_D): epoch e's documents in visiting order (indices into the dataset) and the token
        count after each. Two epochs are kept: a batch may straddle one boundary."""
        with self._lock:
            if e not in self._epochs:
                rng = np.random.default_rng([self.seed, *self.salt, e])
                order_D = rng.permutation(len(self.docs))  # int64, shifted in place: no second array
                order_D += self.docs.start
                ends_D = np.cumsum(self.dataset.lengths_N[order_D], dtype=np.int64)
                while len(self._epochs) >= 2:
                    self._epochs.pop(min(self._epochs))
                self._epochs[e] = (order_D, ends_D)
            return self._epochs[e]

    def sample(self, p: int) -> np.ndarray:
        """int64 [S + 1]: stream position p's sample."""
        e, j = divmod(p, self.num_samples)
        order_D, ends_D = self.epoch(e)
        start, need = j * self.seq_len, self.seq_len + 1
        k = int(np.searchsorted(ends_D, start, side="right"))  # the document holding token `start`
        offset = start - (int(ends_D[k - 1]) if k else 0)
        parts = []
        while need:
            doc = int(order_D[k])
            take = min(need, int(self.dataset.lengths_N[doc]) - offset)
            if take > 0:
                parts.append(self.dataset.read(doc, offset, take))
                need -= take
            k, offset = k + 1, 0
        return np.concatenate(parts)


@dataclass(frozen=True)
class _Table:
    """The blend's block: prefix_K [K] (which prefix each position takes), rank_K [K] (how many earlier
    positions of the block took it), per_block [C] (positions per block of each prefix)."""

    prefix_K: np.ndarray
    rank_K: np.ndarray
    per_block: np.ndarray


def blend_table(weights: list[float], size: int = BLOCK) -> _Table:
    """The first `size` positions of a blend as Megatron's build_blending_indices fills them: position i
    goes to the prefix d with the largest weights[d] * max(i, 1) - taken[d] (the first on ties)."""
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    prefix, rank = [], []
    for i in range(size):  # plain Python: a numpy call per position is slower for a few prefixes
        errors = [wd * max(i, 1) - t for wd, t in zip(w, taken)]  # max(i, 1): Megatron's, as written
        d = errors.index(max(errors))
        prefix.append(d)
        rank.append(taken[d])
        taken[d] += 1
    return _Table(np.asarray(prefix, dtype=np.int64), np.asarray(rank, dtype=np.int64),
                  np.asarray(taken, dtype=np.int64))


class Blend:
    """The samples of --data-path: its prefixes' `part` streams, blended by weight (module docstring).

    name, seq_len, vocab_size and floor (None: real text has no known loss floor) as
    fmoe.train.data.Dataset (what the EODs do is the model's: fmoe/packing.py).
    """

    floor = None

    def __init__(self, streams: list[DocumentStream], weights: list[float], *, vocab_size: int,
                 part: str) -> None:
        self.streams, self.weights, self.vocab_size = streams, weights, vocab_size
        self.seq_len = streams[0].seq_len
        self.table = blend_table(weights) if len(streams) > 1 else None
        self.name = ("data-path " + " ".join(f"{w:.3g} {s.name}" for w, s in zip(weights, streams))
                     + f" {part}")

    def locate(self, positions_P: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(prefix_P, position_P): which prefix's stream each blend position reads, and where in it."""
        if self.table is None:
            return np.zeros_like(positions_P), positions_P
        block_P, slot_P = np.divmod(positions_P, BLOCK)
        prefix_P = self.table.prefix_K[slot_P]
        return prefix_P, block_P * self.table.per_block[prefix_P] + self.table.rank_K[slot_P]

    def samples(self, positions_P: torch.Tensor, seed: int | None = None) -> torch.Tensor:
        """int64 [P, S + 1]: the samples at stream positions `positions_P` (the stream's seed was fixed at
        build; `seed` is accepted for the Dataset interface). ValueError naming the prefix for a token
        outside the vocabulary."""
        pos_P = np.asarray(torch.as_tensor(positions_P, device="cpu"), dtype=np.int64)
        prefix_P, at_P = self.locate(pos_P)
        out = np.empty((len(pos_P), self.seq_len + 1), dtype=np.int64)
        for i, (d, p) in enumerate(zip(prefix_P.tolist(), at_P.tolist())):
            out[i] = self.streams[d].sample(p)
        bad_P = ((out >= self.vocab_size) | (out < 0)).any(axis=1)
        if bad_P.any():
            i = int(bad_P.argmax())
            token = next(int(t) for t in out[i] if not 0 <= t < self.vocab_size)
            raise ValueError(f"{self.streams[prefix_P[i]].dataset.prefix} holds token {token}, outside the "
                             f"vocabulary of size {self.vocab_size} (another tokenizer's data, or "
                             "--vocab-size too small?)")
        return torch.from_numpy(out)

    def describe(self) -> str:
        """One line: the prefixes, their documents, tokens and samples per epoch."""
        parts = [f"{s.name} docs [{s.docs.start}, {s.docs.stop}) {s.num_tokens} tokens "
                 f"{s.num_samples} samples" for s in self.streams]
        return f"{self.name}: " + "; ".join(parts) + f" of {self.seq_len + 1} tokens, no known floor"

    def __repr__(self) -> str:
        return f"Blend({self.describe()})"


def documents_dataset(blend: list[tuple[float | None, str]], *, seq_len: int, split: str, part: str,
                      vocab_size: int, seed: int) -> Blend:
    """The Blend of `part` of the --data-path entries `blend` (parse_data_path's). ValueError naming the
    prefix whose part holds no sample of seq_len + 1 tokens."""
    streams = []
    for number, (_, prefix) in enumerate(blend):
        ds = IndexedDataset(prefix)
        docs = split_documents(len(ds), split, part)
        stream = DocumentStream(ds, docs, seq_len=seq_len, seed=seed, salt=(PARTS.index(part), number),
                                name=Path(prefix).name)
        if stream.num_samples < 1:
            raise ValueError(f"--data-path {prefix}: its {part} documents (--split {split}: [{docs.start}, "
                             f"{docs.stop}) of {len(ds)}) hold {stream.num_tokens} tokens, fewer than one "
                             f"sample of --seq-length {seq_len} + 1")
        streams.append(stream)
    if blend[0][0] is None:  # no weights: each prefix weighs its tokens
        total = sum(s.num_tokens for s in streams)
        weights = [s.num_tokens / total for s in streams]
    else:
        weights = [float(w) for w, _ in blend]
    return Blend(streams, weights, vocab_size=vocab_size, part=part)
