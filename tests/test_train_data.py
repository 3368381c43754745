"""The data layer of `fmoe train` against independent oracles: the Markov floor against a Monte-Carlo
estimate and a plain double loop, the batch stream against its definition rebuilt here, the shards against
the global batch, the file windows against numpy slicing.

Legend: B sequences, S positions, V vocabulary, N windows, G global batch, R data ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fmoe.train import data
from fmoe.train.data import (
    Dataset,
    batch_indices,
    byte_file,
    chain_from_transition,
    file_dataset,
    markov_chain,
    markov_corpus,
    markov_dataset,
    microbatches,
    shard_microbatches,
    token_file,
)

# ---------------------------------------------------------------------------------------------------------
# Markov chain and corpus


@pytest.fixture(scope="module")
def chain16_corpus():
    chain = markov_chain(16, seed=3)
    return chain, markov_corpus(chain, num_sequences=2000, length=200, seed=4)


def test_entropy_rate_matches_the_monte_carlo_loss_of_the_true_chain(chain16_corpus) -> None:
    # The mean of -log P[x_t, x_{t+1}] over a stationary corpus estimates the entropy rate. Rows are
    # independent and identically distributed, so the spread of the per-row means gives an honest standard
    # error (transitions within a row are correlated).
    chain, ids_NL = chain16_corpus
    nll_NT = -torch.log(chain.transition_VV[ids_NL[:, :-1], ids_NL[:, 1:]])
    row_mean_N = nll_NT.mean(dim=1)
    se = float(row_mean_N.std() / math.sqrt(len(row_mean_N)))
    assert abs(float(row_mean_N.mean()) - chain.entropy_rate) < 4 * se, (float(row_mean_N.mean()), se)
    assert se < 0.01  # the check above has teeth: an error of a few hundredths of a nat would fail it
    # The first transition alone too: a start that is not stationary would show up here.
    first_N = nll_NT[:, 0]
    assert abs(float(first_N.mean()) - chain.entropy_rate) < 4 * float(first_N.std() / math.sqrt(2000))


def test_token_frequencies_approach_the_stationary_distribution(chain16_corpus) -> None:
    chain, ids_NL = chain16_corpus
    N, V = ids_NL.shape[0], chain.stationary_V.numel()
    freq_NV = torch.nn.functional.one_hot(ids_NL, V).double().mean(dim=1)
    se_V = freq_NV.std(dim=0) / math.sqrt(N)
    assert ((freq_NV.mean(dim=0) - chain.stationary_V).abs() < 5 * se_V + 1e-12).all()
    # Position 0 is drawn from pi directly: a binomial bound per token.
    pi_V = chain.stationary_V
    freq0_V = torch.bincount(ids_NL[:, 0], minlength=V).double() / N
    assert ((freq0_V - pi_V).abs() <= 5 * torch.sqrt(pi_V * (1 - pi_V) / N) + 1e-12).all()


def test_transition_counts_estimate_the_transition_matrix(chain16_corpus) -> None:
    chain, ids_NL = chain16_corpus
    V = chain.stationary_V.numel()
    counts_VV = torch.zeros(V, V, dtype=torch.float64)
    counts_VV.index_put_((ids_NL[:, :-1].reshape(-1), ids_NL[:, 1:].reshape(-1)),
                         torch.ones(ids_NL[:, 1:].numel(), dtype=torch.float64), accumulate=True)
    n_V1 = counts_VV.sum(dim=1, keepdim=True)
    P_VV = chain.transition_VV
    assert ((counts_VV / n_V1 - P_VV).abs() <= 6 * torch.sqrt(P_VV * (1 - P_VV) / n_V1) + 1e-3).all()


@settings(max_examples=25)
@given(V=st.integers(1, 40), seed=st.integers(0, 2**31 - 1), sharpness=st.floats(0.0, 6.0))
@example(V=1, seed=0, sharpness=3.0)
@example(V=64, seed=0, sharpness=3.0)
@example(V=8, seed=1, sharpness=0.0)
def test_stationary_distribution_is_exact(V: int, seed: int, sharpness: float) -> None:
    chain = markov_chain(V, seed, sharpness)
    P_VV, pi_V = chain.transition_VV, chain.stationary_V
    assert P_VV.dtype == pi_V.dtype == torch.float64 and P_VV.shape == (V, V) and pi_V.shape == (V,)
    torch.testing.assert_close(P_VV.sum(dim=1), torch.ones(V, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (pi_V >= 0).all()
    assert abs(float(pi_V.sum()) - 1) < 1e-12
    torch.testing.assert_close(pi_V @ P_VV, pi_V, rtol=0, atol=1e-12)
    if sharpness == 0.0:  # uniform rows: the floor is log V
        assert chain.entropy_rate == pytest.approx(math.log(V), abs=1e-12)
    assert 0 <= chain.entropy_rate <= math.log(V) + 1e-12


def _entropy_rate_loop(P: list[list[float]], pi: list[float]) -> float:
    total = 0.0
    for i in range(len(pi)):
        for j in range(len(pi)):
            if P[i][j] > 0:
                total -= pi[i] * P[i][j] * math.log(P[i][j])
    return total


def test_entropy_rate_against_a_double_loop() -> None:
    for V, seed in [(2, 0), (5, 1), (7, 9)]:
        chain = markov_chain(V, seed)
        oracle = _entropy_rate_loop(chain.transition_VV.tolist(), chain.stationary_V.tolist())
        assert chain.entropy_rate == pytest.approx(oracle, rel=1e-12, abs=1e-15)


def test_chains_with_zero_transitions() -> None:
    # A deterministic 3-cycle: pi uniform, no uncertainty at all (0 log 0 = 0, not NaN).
    cycle = chain_from_transition(torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]]))
    torch.testing.assert_close(cycle.stationary_V, torch.full((3,), 1 / 3, dtype=torch.float64))
    assert cycle.entropy_rate == 0.0
    # A sparse chain with a known answer: pi solves the balance equations by hand, pi = (2/5, 2/5, 1/5).
    P = [[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    chain = chain_from_transition(torch.tensor(P))
    torch.testing.assert_close(chain.stationary_V, torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64))
    assert chain.entropy_rate == pytest.approx(_entropy_rate_loop(P, [0.4, 0.4, 0.2]), rel=1e-12)
    assert chain.entropy_rate == pytest.approx(0.4 * math.log(2), rel=1e-12)


def test_bad_transition_matrices_are_refused() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        chain_from_transition(torch.tensor([[0.5, 0.4], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="non-negative"):
        chain_from_transition(torch.tensor([[1.5, -0.5], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="unique stationary"):
        chain_from_transition(torch.eye(2))  # two closed classes: every mixture is stationary


def test_default_sharpness_leaves_a_visible_gap_below_uniform() -> None:
    rate = markov_chain(64, 0).entropy_rate
    print(f"markov_chain(64, 0).entropy_rate = {rate:.4f} nats/token (log 64 = {math.log(64):.4f})")
    assert 1.5 < rate < 2.5


def test_corpus_shape_seed_and_rows() -> None:
    chain = markov_chain(8, 0)
    a = markov_corpus(chain, 50, 30, seed=1)
    assert a.dtype == torch.int64 and a.shape == (50, 30)
    assert int(a.min()) >= 0 and int(a.max()) < 8
    assert torch.equal(a, markov_corpus(chain, 50, 30, seed=1))
    assert not torch.equal(a, markov_corpus(chain, 50, 30, seed=2))
    assert markov_corpus(chain, 3, 1, seed=0).shape == (3, 1)
    # Every observed transition has positive probability under the chain.
    sparse = chain_from_transition(torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    ids_NL = markov_corpus(sparse, 200, 40, seed=0)
    assert (sparse.transition_VV[ids_NL[:, :-1], ids_NL[:, 1:]] > 0).all()


# ---------------------------------------------------------------------------------------------------------
# Markov dataset


def test_markov_dataset_is_seeded_and_knows_its_floor() -> None:
    ds = markov_dataset(vocab_size=16, seq_len=12, num_sequences=40, seed=5)
    assert (ds.vocab_size, ds.seq_len, ds.num_windows, ds.path) == (16, 12, 40, None)
    assert ds.floor == markov_chain(16, 5).entropy_rate
    idx = torch.tensor([3, 0, 39, 3])
    w = ds.windows(idx)
    assert w.dtype == torch.int64 and w.shape == (4, 13)
    assert torch.equal(w[0], w[3])
    assert torch.equal(w, markov_dataset(16, 12, 40, seed=5).windows(idx))
    assert not torch.equal(w, markov_dataset(16, 12, 40, seed=6).windows(idx))
    # The windows are the corpus drawn with seed + 1 from the chain of `seed`.
    corpus = markov_corpus(markov_chain(16, 5), 40, 13, seed=6)
    assert torch.equal(ds.windows(torch.arange(40)), corpus)
    assert ds.describe() == f"markov(V=16, seed=5): 40 windows of 13 tokens, floor {ds.floor:.3f} nats/token"
    with pytest.raises(IndexError):
        ds.windows(torch.tensor([40]))
    with pytest.raises(IndexError):
        ds.windows(torch.tensor([-1]))
    assert ds.windows(torch.tensor([], dtype=torch.int64)).shape == (0, 13)


# ---------------------------------------------------------------------------------------------------------
# File sources


@pytest.mark.parametrize("dtype, kind, vocab", [("uint16", "bin16", 50_000), ("uint32", "bin32", 200_000)])
def test_token_file_windows_equal_numpy_slicing(tmp_path, dtype: str, kind: str, vocab: int) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=1000).astype(dtype)
    path = tmp_path / f"train.{dtype}.bin"
    tokens.tofile(path)
    mm = token_file(path, dtype)
    assert isinstance(mm, np.memmap) and mm.dtype == np.dtype(dtype) and np.array_equal(mm, tokens)
    S = 15
    ds = file_dataset(path, kind, seq_len=S, vocab_size=vocab)
    assert ds.num_windows == 1000 // (S + 1) and ds.floor is None and ds.path == path
    assert isinstance(ds.source, np.memmap) and Path(ds.source.filename) == path.resolve()
    idx = torch.tensor([0, 61, 7, 7, 30])
    expected = np.stack([tokens[i * (S + 1): (i + 1) * (S + 1)] for i in idx.tolist()]).astype(np.int64)
    got = ds.windows(idx)
    assert got.dtype == torch.int64 and np.array_equal(got.numpy(), expected)
    assert ds.describe() == f"{kind}({path}, V={vocab}): 62 windows of 16 tokens, no known floor"
    with pytest.raises(IndexError):
        ds.windows(torch.tensor([62]))  # the tail of 8 tokens fills no window


def test_out_of_vocabulary_tokens_are_refused_naming_the_file(tmp_path) -> None:
    tokens = np.arange(40, dtype=np.uint16) % 10
    tokens[33] = 50_000  # in window 3 of 10-token windows
    path = tmp_path / "big_vocab.bin"
    tokens.tofile(path)
    ds = file_dataset(path, "bin16", seq_len=9, vocab_size=10)
    assert ds.windows(torch.tensor([0, 1, 2])).shape == (3, 10)  # only the requested rows are checked
    with pytest.raises(ValueError, match=r"big_vocab\.bin.*50000.*size 10"):
        ds.windows(torch.tensor([1, 3]))


def test_byte_file_reads_text_as_bytes(tmp_path) -> None:
    text = "hello, wörld!\nmixture of experts\n" * 3
    path = tmp_path / "input.txt"
    path.write_text(text, encoding="utf-8")
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    assert isinstance(byte_file(path), np.memmap) and np.array_equal(byte_file(path), raw)
    ds = file_dataset(path, "text", seq_len=7, vocab_size=256)
    assert ds.num_windows == len(raw) // 8
    assert np.array_equal(ds.windows(torch.arange(ds.num_windows)).numpy().reshape(-1),
                          raw[: ds.num_windows * 8].astype(np.int64))
    with pytest.raises(ValueError, match="256"):
        file_dataset(path, "text", seq_len=7, vocab_size=255)


def test_file_errors_name_the_path(tmp_path) -> None:
    missing = tmp_path / "nope.bin"
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        token_file(missing, "uint16")
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        file_dataset(missing, "text", 4, 256)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.bin.*empty"):
        token_file(empty, "uint32")
    with pytest.raises(ValueError, match="empty.bin.*empty"):
        byte_file(empty)
    ragged = tmp_path / "ragged.bin"
    ragged.write_bytes(b"\x01\x00\x02\x00\x03\x00")  # 6 bytes: 3 uint16 tokens, 1.5 uint32 tokens
    assert token_file(ragged, "uint16").tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="ragged.bin.*6 bytes.*4"):
        token_file(ragged, "uint32")
    with pytest.raises(ValueError, match="dtype"):
        token_file(ragged, "int16")
    with pytest.raises(ValueError, match="kind"):
        file_dataset(ragged, "bin64", 2, 10)
    with pytest.raises(ValueError, match=r"short\.bin.* 3 tokens; one window needs 5"):
        short = tmp_path / "short.bin"
        np.arange(3, dtype=np.uint16).tofile(short)
        file_dataset(short, "bin16", seq_len=4, vocab_size=10)
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "exact.bin")
    assert file_dataset(tmp_path / "exact.bin", "bin16", seq_len=4, vocab_size=10).num_windows == 1


# ---------------------------------------------------------------------------------------------------------
# The batch stream


def _stream_oracle(num_windows: int, global_batch: int, step: int, seed: int) -> list[int]:
    """The definition written out: concatenate the epochs' permutations and cut the step's slice."""
    stop = (step + 1) * global_batch
    perms = [torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed * 1_000_003 + e))
             for e in range(-(-stop // num_windows))]
    return torch.cat(perms)[step * global_batch: stop].tolist()


@settings(max_examples=60)
@given(N=st.integers(1, 50), G=st.integers(1, 20), seed=st.integers(0, 10_000))
@example(N=1, G=1, seed=0)
@example(N=1, G=7, seed=3)
@example(N=5, G=12, seed=0)  # G > N: a batch spans more than two epochs
@example(N=9, G=9, seed=1)  # G == N: one step, one epoch
@example(N=7, G=3, seed=2)  # batches straddle epoch boundaries
def test_batch_indices_visit_every_window_once_per_epoch(N: int, G: int, seed: int) -> None:
    epochs = 3
    steps = -(-epochs * N // G)
    batches = [batch_indices(N, G, k, seed) for k in range(steps)]
    for k, b in enumerate(batches):
        assert b.dtype == torch.int64 and b.shape == (G,)
        assert b.tolist() == _stream_oracle(N, G, k, seed)
    stream = torch.cat(batches)[: epochs * N]
    for e in range(epochs):
        assert sorted(stream[e * N: (e + 1) * N].tolist()) == list(range(N)), e


@settings(max_examples=20)
@given(N=st.integers(1, 50), G=st.integers(1, 20), seed=st.integers(0, 10_000))
@example(N=1, G=20, seed=0)
def test_batch_indices_do_not_depend_on_call_order(N: int, G: int, seed: int) -> None:
    data._epoch_permutation.cache_clear()
    forward = [batch_indices(N, G, k, seed) for k in range(10)]
    data._epoch_permutation.cache_clear()
    # Resuming at step 7 (a fresh process) and then going back to step 3 gives the same batches.
    assert torch.equal(batch_indices(N, G, 7, seed), forward[7])
    assert torch.equal(batch_indices(N, G, 3, seed), forward[3])
    for k in reversed(range(10)):
        assert torch.equal(batch_indices(N, G, k, seed), forward[k])


def test_batch_indices_seed_and_cache() -> None:
    a = batch_indices(1000, 64, 0, seed=0)
    assert not torch.equal(a, batch_indices(1000, 64, 0, seed=1))
    assert len(set(a.tolist())) == 64  # within an epoch no window repeats
    a[:] = -1  # the caller owns what it gets: the cached permutation is not shared
    assert (batch_indices(1000, 64, 0, seed=0) >= 0).all()
    with pytest.raises(ValueError):
        batch_indices(0, 4, 0, 0)
    with pytest.raises(ValueError):
        batch_indices(10, 4, -1, 0)


# ---------------------------------------------------------------------------------------------------------
# Sharding


@settings(max_examples=60)
@given(B=st.integers(1, 4), R=st.integers(1, 4), m=st.integers(1, 3), S=st.integers(1, 6),
       seed=st.integers(0, 1000))
@example(B=1, R=1, m=1, S=1, seed=0)
@example(B=2, R=3, m=2, S=4, seed=0)
@example(B=3, R=3, m=1, S=2, seed=1)
def test_shards_reassemble_the_global_batch(B: int, R: int, m: int, S: int, seed: int) -> None:
    G = B * R * m
    windows_GS1 = torch.randint(0, 100, (G, S + 1), generator=torch.Generator().manual_seed(seed))
    ids, targets = [], []
    for r in range(R):
        shard = shard_microbatches(windows_GS1, r, R, B)
        assert len(shard) == m
        for k, (ids_BS, targets_BS) in enumerate(shard):
            assert ids_BS.shape == targets_BS.shape == (B, S)
            assert ids_BS.dtype == targets_BS.dtype == torch.int64
            assert ids_BS.is_contiguous() and targets_BS.is_contiguous()
            assert torch.equal(ids_BS[:, 1:], targets_BS[:, :-1])
            # Rank r's k-th microbatch is global microbatch r * m + k.
            rows = windows_GS1[(r * m + k) * B: (r * m + k + 1) * B]
            assert torch.equal(ids_BS, rows[:, :-1]) and torch.equal(targets_BS, rows[:, 1:])
            ids.append(ids_BS)
            targets.append(targets_BS)
    assert torch.equal(torch.cat(ids), windows_GS1[:, :-1])
    assert torch.equal(torch.cat(targets), windows_GS1[:, 1:])


def test_shard_errors() -> None:
    w = torch.zeros(6, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="6.*micro_batch 4"):
        shard_microbatches(w, 0, 1, 4)
    with pytest.raises(ValueError, match="6.*data_ranks 4"):
        shard_microbatches(w, 0, 4, 1)
    for rank in (-1, 3):
        with pytest.raises(ValueError, match="data_rank"):
            shard_microbatches(w, rank, 3, 2)
    with pytest.raises(ValueError, match="S >= 1"):
        shard_microbatches(torch.zeros(6, 1, dtype=torch.int64), 0, 1, 2)


def test_microbatches_compose_and_read_only_this_ranks_rows() -> None:
    ds = markov_dataset(vocab_size=8, seq_len=6, num_sequences=30, seed=2)
    G, B, R, seed = 12, 2, 3, 7
    asked = []
    original = ds.windows
    ds.windows = lambda idx: (asked.append(idx.clone()), original(idx))[1]  # spy on the rows read
    for step in (0, 1, 4):
        global_GS1 = original(batch_indices(ds.num_windows, G, step, seed))
        asked.clear()
        for r in range(R):
            got = microbatches(ds, step, global_batch=G, micro_batch=B, data_rank=r, data_ranks=R, seed=seed)
            want = shard_microbatches(global_GS1, r, R, B)
            assert len(got) == len(want) == 2
            for (ids, tgt), (ids_w, tgt_w) in zip(got, want):
                assert torch.equal(ids, ids_w) and torch.equal(tgt, tgt_w)
        assert [len(a) for a in asked] == [G // R] * R
    with pytest.raises(ValueError, match="divisible"):
        microbatches(ds, 0, global_batch=10, micro_batch=2, data_rank=0, data_ranks=3, seed=0)


def test_dataset_refuses_a_corpus_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"\[N, 5\]"):
        Dataset(name="x", vocab_size=4, seq_len=4, source=torch.zeros(3, 4, dtype=torch.int64))
