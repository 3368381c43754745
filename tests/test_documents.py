"""--data-path's sample stream against oracles rebuilt here: the documents of a split concatenated in each
epoch's order and sliced, plain loops over ranks for the sharding, counts for the blend; the EOD mask
against a loop; the tokenizers' vocabulary and EOD; the background reader against the reader itself.

Legend: P stream positions, S positions per sample, D documents, G global batch, R data ranks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.examples.stdlib_text import train_bpe
from fmoe.packing import pack_documents
from fmoe.train.config import TrainConfig
from fmoe.train.data import microbatches
from fmoe.train.documents import BLOCK, documents_dataset, parse_data_path
from fmoe.train.indexed import IndexedWriter
from fmoe.train.prefetch import Prefetcher
from fmoe.train.splits import split_bounds
from fmoe.train.tokenizer import build_tokenizer, padded_vocab_size


def _write(prefix: str, docs: list[list[int]], dtype=np.uint16) -> None:
    with IndexedWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc, [len(doc)] if doc else [])


def _oracle(docs: list[list[int]], part: range, S: int, seed: int, salt: tuple, p: int) -> list[int]:
    """Sample p as the module docstring defines it: epoch p // N's documents in the order of
    default_rng([seed, *salt, e]).permutation, concatenated, tokens [j S, j S + S + 1)."""
    T = sum(len(docs[d]) for d in part)
    N = (T - 1) // S
    e, j = divmod(p, N)
    order = part.start + np.random.default_rng([seed, *salt, e]).permutation(len(part))
    stream = [t for d in order for t in docs[d]]
    return stream[j * S: j * S + S + 1]


doc_lists = st.lists(st.lists(st.integers(0, 99), min_size=0, max_size=20), min_size=1, max_size=25)


@settings(max_examples=40)
@given(docs=doc_lists, S=st.integers(1, 9), seed=st.integers(0, 2**31), split=st.sampled_from(
    ["1", "8,2", "969,30,1"]))
@example(docs=[[1, 2], [3], [], [4, 5, 6, 7]], S=1, seed=0, split="1")  # one-token samples, an empty doc
@example(docs=[[1, 2, 3]], S=2, seed=5, split="1")  # one sample per epoch: every position a new epoch
def test_samples_are_the_epochs_documents_concatenated_and_sliced(tmp_path_factory, docs, S, seed,
                                                                  split) -> None:
    prefix = str(tmp_path_factory.mktemp("d") / "ds")
    _write(prefix, docs)
    docs = [d for d in docs if d]  # an empty document holds no sequence: the stream's units are sequences
    part = split_bounds(len(docs), split)[0]
    if sum(len(docs[d]) for d in part) < S + 1:
        with pytest.raises(ValueError, match="fewer than one sample"):
            documents_dataset(parse_data_path([prefix]), seq_len=S, split=split, part="train", vocab_size=100,
                              seed=seed)
        return
    ds = documents_dataset(parse_data_path([prefix]), seq_len=S, split=split, part="train", vocab_size=100,
                           seed=seed)
    N = ds.streams[0].num_samples
    positions = list(range(3 * N + 2))  # three epochs and into a fourth
    got = ds.samples(torch.tensor(positions))
    assert got.shape == (len(positions), S + 1) and got.dtype == torch.int64
    for p in positions:
        assert got[p].tolist() == _oracle(docs, part, S, seed, (0, 0), p), p
    # out of order and repeated positions read the same (a pure function of the position)
    again = ds.samples(torch.tensor(positions[::-1] + positions[:3]))
    assert torch.equal(again[: len(positions)], got.flip(0)) and torch.equal(again[-3:], got[:3])


def test_an_epoch_reads_every_token_of_its_split_once_and_epochs_differ(tmp_path) -> None:
    rng = np.random.default_rng(0)
    docs = [list(range(100 * d, 100 * d + int(n))) for d, n in enumerate(rng.integers(1, 60, size=40))]
    _write(str(tmp_path / "ds"), docs)
    S = 7
    ds = documents_dataset(parse_data_path([str(tmp_path / "ds")]), seq_len=S, split="1", part="train",
                           vocab_size=4000, seed=3)
    N, T = ds.streams[0].num_samples, ds.streams[0].num_tokens
    first = ds.samples(torch.arange(N))
    read = torch.cat([first[:, :-1].reshape(-1), first[-1, -1:]])  # neighbours share one token
    assert len(read) == N * S + 1 and T - len(read) < S  # only the tail that fills no sample is unread
    assert len(set(read.tolist())) == len(read)  # no token twice
    second = ds.samples(torch.arange(N, 2 * N))
    assert not torch.equal(first, second)  # another document order
    # a sample runs across document boundaries: some sample holds tokens of two documents
    assert any(len({t // 100 for t in row.tolist()}) > 1 for row in first)


def test_parse_data_path_reads_megatrons_forms() -> None:
    assert parse_data_path(["a"]) == [(None, "a")]
    assert parse_data_path(["a", "b", "c"]) == [(None, "a"), (None, "b"), (None, "c")]
    assert parse_data_path(["30", "a", "70", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_data_path(["x", "a", "y", "b"]) == [(None, p) for p in "xayb"]  # no numbers: all prefixes
    for bad, words in ((["0.3", "a", "b"], "without its prefix"), (["0.3", "a", "b", "c"], "stands where"),
                       (["-1", "a", "2", "b"], ">= 0"), ([], "needs a prefix"),
                       (["0", "a", "0", "b"], ">= 0")):
        with pytest.raises(ValueError, match=words) as info:
            parse_data_path(bad)
        assert "--data-path" in str(info.value)


def test_a_blend_takes_each_prefix_at_its_weight_and_each_prefix_in_its_own_order(tmp_path) -> None:
    _write(str(tmp_path / "a"), [[1] * 50 for _ in range(20)])  # prefix a: tokens 1, prefix b: tokens 2
    _write(str(tmp_path / "b"), [[2] * 30 for _ in range(20)])
    blend = parse_data_path(["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")])
    ds = documents_dataset(blend, seq_len=8, split="1", part="train", vocab_size=3, seed=0)
    P = BLOCK + 1000  # across a block boundary
    prefix_P, at_P = ds.locate(np.arange(P))
    assert abs((prefix_P == 0).mean() - 0.3) < 1e-3
    for d in (0, 1):  # each prefix's positions count 0, 1, 2, ... in blend order, across blocks
        assert at_P[prefix_P == d].tolist() == list(range(int((prefix_P == d).sum())))
    rows = ds.samples(torch.arange(200))
    assert rows[torch.from_numpy(prefix_P[:200] == 0)].unique().tolist() == [1]
    assert rows[torch.from_numpy(prefix_P[:200] == 1)].unique().tolist() == [2]
    # without weights each prefix weighs its tokens (a holds 1000, b 600)
    plain = documents_dataset(parse_data_path([str(tmp_path / "a"), str(tmp_path / "b")]), seq_len=8,
                              split="1", part="train", vocab_size=3, seed=0)
    assert plain.weights == pytest.approx([1000 / 1600, 600 / 1600])


@pytest.mark.parametrize("R", [1, 2, 4])
def test_the_global_batch_is_the_same_in_every_layout_and_from_any_start(tmp_path, R: int) -> None:
    _write(str(tmp_path / "ds"), [list(range(i, i + 13)) for i in range(0, 60)])
    ds = documents_dataset(parse_data_path([str(tmp_path / "ds")]), seq_len=6, split="1", part="train",
                           vocab_size=100, seed=1)
    G, B = 8, 2 if R < 4 else 1

    def global_batch(start: int, ranks: int, micro: int) -> torch.Tensor:
        rows = [ids for r in range(ranks) for ids, _ in microbatches(
            ds, 0, global_batch=G, micro_batch=micro, data_rank=r, data_ranks=ranks, seed=1, start=start)]
        return torch.cat(rows)

    for start in (0, 8, 13, 200):  # 13: a run whose global batch changed on resume
        want = ds.samples(torch.arange(start, start + G))[:, :-1]
        assert torch.equal(global_batch(start, R, B), want)
    # the step form is start = step x G
    assert torch.equal(global_batch(3 * G, R, B), torch.cat([ids for r in range(R) for ids, _ in microbatches(
        ds, 3, global_batch=G, micro_batch=B, data_rank=r, data_ranks=R, seed=1)]))


def test_eod_mask_ignores_the_target_after_each_eod(tmp_path) -> None:
    """The loader keeps every token (MTP embeds the targets); --eod-mask-loss's mask, the model's
    (fmoe.packing), takes the loss off the target after each EOD of the loader's batches."""
    EOD = 9
    _write(str(tmp_path / "ds"), [[1, 2, EOD], [3, EOD], [4, 5, 6, EOD], [7, EOD]] * 5)
    ds = documents_dataset(parse_data_path([str(tmp_path / "ds")]), seq_len=5, split="1", part="train",
                           vocab_size=10, seed=0)
    (ids, targets), = microbatches(ds, 0, global_batch=4, micro_batch=4, data_rank=0, data_ranks=1, seed=0)
    assert torch.equal(ids[:, 1:], targets[:, :-1]) and (targets >= 0).all()
    masked = pack_documents(ids, EOD, eod_mask_loss=True).targets(targets)
    for b in range(4):
        for s in range(5):  # Megatron's loss_mask[tokens == eod] = 0, as a loop
            want = -100 if int(ids[b, s]) == EOD else int(targets[b, s])
            assert int(masked[b, s]) == want
    assert (masked == -100).any() and (masked == EOD).any()  # an EOD target itself keeps its loss


def test_tokens_outside_the_vocabulary_are_refused_naming_the_prefix(tmp_path) -> None:
    _write(str(tmp_path / "ds"), [[1, 2, 3, 300]] * 4)
    ds = documents_dataset(parse_data_path([str(tmp_path / "ds")]), seq_len=3, split="1", part="train",
                           vocab_size=256, seed=0)
    with pytest.raises(ValueError, match=f"{tmp_path / 'ds'} holds token 300, outside the vocabulary of "
                                         "size 256"):
        ds.samples(torch.arange(5))


def test_tokenizers_give_vocabulary_and_eod(tmp_path) -> None:
    train_bpe(["hello world <|endoftext|>", "more text here"] * 10, 280, tmp_path / "tokenizer.json")
    hf = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    assert hf.vocab_size == 280 and hf.eod == 0  # the special token was added first
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path)).eod == 0  # a directory holding it
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|endoftext|>"}}')
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path)).eod == 0
    assert hf.encode("hello") and 0 not in hf.encode("hello")  # no special token added
    byte = build_tokenizer("ByteLevelTokenizer")
    assert (byte.vocab_size, byte.eod, byte.encode("é")) == (257, 256, [0xC3, 0xA9])
    null = build_tokenizer("NullTokenizer", vocab_size=50)
    assert (null.vocab_size, null.eod, null.encode("3 4  7")) == (51, 50, [3, 4, 7])
    # Megatron's padding: to a multiple of divisible_by x tp
    padded = [padded_vocab_size(v, 128, tp) for v, tp in ((280, 1), (256, 1), (257, 2), (1, 1))]
    assert padded == [384, 256, 512, 128]
    for kind, model, words in (("Nope", None, "must be one of"),
                               ("HuggingFaceTokenizer", None, "give its file"),
                               ("SentencePieceTokenizer", str(tmp_path / "x.model"), "no such file"),
                               ("NullTokenizer", None, "give --vocab-size")):
        with pytest.raises(ValueError, match=words):
            build_tokenizer(kind, model)


def test_the_tokenizer_sets_the_vocabulary_unless_it_is_given(tmp_path) -> None:
    train_bpe(["hello world", "more text here"] * 10, 280, tmp_path / "tokenizer.json")
    flags = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tmp_path / "tokenizer.json")}
    V = build_tokenizer(**{"kind": flags["tokenizer_type"], "model": flags["tokenizer_model"]}).vocab_size
    assert 256 < V <= 280  # the bytes and the EOD, and what merges so little text allows
    assert TrainConfig.from_sources("small", None, flags).vocab_size == 384  # not the preset's 256
    assert TrainConfig.from_sources("tiny", None, {**flags, "tp": 2}).vocab_size == 512
    eight = TrainConfig.from_sources("tiny", None, {**flags, "make_vocab_size_divisible_by": 8}).vocab_size
    assert eight % 8 == 0 and V <= eight < V + 8
    assert TrainConfig.from_sources("tiny", None, {**flags, "vocab_size": 1000}).vocab_size == 1000
    small = TrainConfig.from_sources("tiny", None, {**flags, "vocab_size": 100})
    assert f"smaller than --tokenizer-model's vocabulary of {V}" in small.problem()


def test_the_background_reader_returns_what_the_reader_returns() -> None:
    calls = []

    def read(start: int):
        calls.append(start)
        if start == 99:
            raise ValueError("bad token")
        return [(torch.full((2, 3), start), torch.full((2, 3), -start))]

    pre = Prefetcher(read, torch.device("cpu"))
    try:
        for start, nxt in ((0, 8), (8, 16), (16, None), (40, 48), (48, 99)):  # 40: a jump (a resume)
            (ids, targets), = pre.get(start, nxt)
            assert int(ids[0, 0]) == start and int(targets[0, 0]) == -start
        with pytest.raises(ValueError, match="bad token"):  # the read ahead's error, raised when asked for
            pre.get(99, None)
        assert calls == [0, 8, 16, 40, 48, 99]  # each read once: ahead, or on the spot after a jump
    finally:
        pre.close()


def _mapped_rss_kib(path: str) -> int:
    """The resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's line: range perms offset dev inode path
            inside = line.endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_mapped_reads_leave_no_page_of_the_bin_in_the_process(tmp_path) -> None:
    """The samples are read through the .bin's memory map, and each read gives its pages back
    (madvise MADV_DONTNEED): after reading samples across a cached 4 MB corpus, none of the .bin's map is
    resident (the rule that keeps a 2 GB corpus's process as small as a 20 MB one's; BENCHMARKS.md)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=int(n)).tolist() for n in rng.integers(100, 4000, size=1000)]
    prefix = str(tmp_path / "ds")
    _write(prefix, docs)
    Path(prefix + ".bin").read_bytes()  # in the page cache: where a fault maps the pages around it
    ds = documents_dataset(parse_data_path([prefix]), seq_len=64, split="1", part="train", vocab_size=60000,
                           seed=0)
    got = ds.samples(torch.arange(0, ds.streams[0].num_samples, 7))
    stream = [t for d in ds.streams[0].epoch(0)[0] for t in docs[d]]
    assert got[3].tolist() == stream[21 * 64: 21 * 64 + 65]  # the tokens themselves
    assert _mapped_rss_kib(prefix + ".bin") == 0
    ds.streams[0].dataset.tokens[:].sum()  # a plain map of the file keeps its pages: the check can fail
    assert _mapped_rss_kib(prefix + ".bin") > 1000
