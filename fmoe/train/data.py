"""The data layer of `fmoe train`: token sources, fixed-length windows, and the sharded batch stream.

    ds = markov_dataset(vocab_size=64, seq_len=64, num_sequences=16384, seed=0)   # or file_dataset(...)
    for ids_BS, targets_BS in microbatches(ds, step, global_batch=G, micro_batch=B,
                                           data_rank=r, data_ranks=R, seed=seed): ...

Legend: B sequences per microbatch, S positions, V vocabulary, N windows (or sequences), G global batch in
sequences; `windows_NS1` is [N, S + 1] (a window holds S inputs and their S next-token targets).

- The synthetic source is a Markov chain whose entropy rate is known exactly, so a trained model's loss
  has a floor to be compared against (`Dataset.floor`).
- File sources follow nanoGPT: a flat binary of uint16 / uint32 tokens (`ndarray.tofile`), or a text
  file at byte level. Both are memory-mapped; only the rows a rank asks for are read.
- The batch of global step k is a pure function of (num_windows, G, k, seed): resuming at step k needs no
  other data state, and each epoch visits every window exactly once. In general a step reads the stream
  positions [start, start + G) (start = the samples consumed before it, k x G at a constant batch size),
  through the source's `samples(positions, seed)`; `--data-path`'s documents (fmoe/train/documents.py)
  are a source of the same interface.
- Documents: every source gives its tokens as they are (targets are always tokens); what --eod-mask-loss,
  --reset-position-ids and --reset-attention-mask do with the EODs of --data-path's documents is the
  model's, from the ids on the device (fmoe/packing.py), so MTP still embeds the true next token.
- Everything here lives on the host, `device="cpu"` spelled out (not torch's default device): the trainer
  moves each microbatch to its rank's device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fmoe._checks import choice, integer, real

__all__ = [
    "Dataset",
    "MarkovChain",
    "batch_indices",
    "byte_file",
    "chain_from_transition",
    "file_dataset",
    "markov_chain",
    "markov_corpus",
    "markov_dataset",
    "microbatches",
    "shard_microbatches",
    "stream_indices",
    "token_file",
]

_TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_FILE_KINDS = ("bin16", "bin32", "text")
_EPOCH_SEED_STRIDE = 1_000_003
# torch.Generator.manual_seed takes at most 64 bits; this bound keeps seed * stride + epoch inside them.
MAX_SEED = 2**40  # data seeds below it (fmoe.train.config checks --seed before launch)


# ---------------------------------------------------------------------------------------------------------
# Synthetic Markov corpus


@dataclass(frozen=True, eq=False)
class MarkovChain:
    """A first-order Markov chain over V tokens (eq=False: tensor fields have no single truth value).

    transition_VV: float64 [V, V], row i = P(next token | current token i); rows sum to 1.
    stationary_V: float64 [V], the distribution pi with pi @ P = pi, sum 1.
    entropy_rate: nats per token, -sum_i pi_i sum_j P_ij log P_ij: the lowest mean next-token loss any
        model can reach on a stationary sequence of this chain.
    """

    transition_VV: torch.Tensor
    stationary_V: torch.Tensor
    entropy_rate: float


def chain_from_transition(transition_VV: torch.Tensor) -> MarkovChain:
    """Return the MarkovChain of a row-stochastic [V, V] matrix (stationary distribution and entropy rate
    computed exactly in float64).

    The chain must have a unique stationary distribution (e.g. irreducible); ValueError otherwise, or when
    the matrix is not square, has negative entries, or rows that do not sum to 1.
    """
    P_VV = torch.as_tensor(transition_VV, dtype=torch.float64, device="cpu")
    if P_VV.dim() != 2 or P_VV.shape[0] != P_VV.shape[1] or P_VV.shape[0] == 0:
        raise ValueError(f"transition_VV must be a non-empty square matrix, got shape {tuple(P_VV.shape)}")
    if not bool(torch.isfinite(P_VV).all()) or bool((P_VV < 0).any()):
        raise ValueError("transition_VV must have finite, non-negative entries")
    row_error = float((P_VV.sum(dim=1) - 1).abs().max())
    if row_error > 1e-9:
        raise ValueError(f"transition_VV rows must sum to 1 (largest error {row_error:.3g})")
    V = P_VV.shape[0]
    # pi (P - I) = 0 with sum(pi) = 1, solved as one least-squares system: exact to rounding, unlike a
    # fixed number of power iterations whose error depends on the chain's mixing time.
    A_V1V = torch.cat([P_VV.T - torch.eye(V, dtype=torch.float64, device="cpu"),
                       torch.ones(1, V, dtype=torch.float64, device="cpu")])
    b_V1 = torch.cat([torch.zeros(V, dtype=torch.float64, device="cpu"),
                      torch.ones(1, dtype=torch.float64, device="cpu")])
    # Full column rank <=> the eigenvalue 1 is simple <=> one stationary distribution (else lstsq would
    # quietly return one of many).
    if int(torch.linalg.matrix_rank(A_V1V)) < V:
        raise ValueError("transition_VV has no unique stationary distribution (the chain is reducible)")
    pi_V = torch.linalg.lstsq(A_V1V, b_V1.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    pi_V = pi_V.clamp(min=0)
    pi_V = pi_V / pi_V.sum()
    residual = float((pi_V @ P_VV - pi_V).abs().max())
    if residual > 1e-9:
        raise ValueError(f"transition_VV: no stationary distribution found (residual {residual:.3g})")
    # xlogy(0, 0) = 0: a zero transition contributes no entropy (0 log 0 = 0), where P * log P gives NaN.
    entropy_rate = float(-(pi_V * torch.special.xlogy(P_VV, P_VV).sum(dim=1)).sum())
    return MarkovChain(transition_VV=P_VV, stationary_V=pi_V, entropy_rate=entropy_rate)


def markov_chain(vocab_size: int, seed: int, sharpness: float = 3.0) -> MarkovChain:
    """Return a random MarkovChain over `vocab_size` tokens: rows softmax(sharpness * randn(V, V)) in float64
    from a Generator seeded with `seed`.

    Larger `sharpness` gives peakier rows and a lower entropy rate; the default 3.0 puts V = 64 at about
    1.77 nats/token (log 64 = 4.16), far enough below uniform that learning is visible in the loss.
    """
    V = integer("vocab_size", vocab_size)
    sharpness = real("sharpness", sharpness, 0.0, strict=False)
    generator = torch.Generator().manual_seed(integer("seed", seed, minimum=0))
    logits_VV = sharpness * torch.randn(V, V, generator=generator, dtype=torch.float64, device="cpu")
    return chain_from_transition(torch.softmax(logits_VV, dim=1))


def markov_corpus(chain: MarkovChain, num_sequences: int, length: int, seed: int) -> torch.Tensor:
    """Return int64 [N, length]: N independent sequences of `chain`, each started from the stationary
    distribution, so the next-token conditional entropy at every position equals `chain.entropy_rate`.

    Drawn from a Generator seeded with `seed`, all N rows at once per position, by inverting the
    cumulative distribution of each row's next token at a uniform draw (the first token whose cumulative
    probability exceeds it): a search per row instead of torch.multinomial's pass over all V
    probabilities of every row, which made building the default corpus take seconds on every rank.
    """
    N = integer("num_sequences", num_sequences)
    L = integer("length", length)
    generator = torch.Generator().manual_seed(integer("seed", seed, minimum=0))
    V = chain.transition_VV.shape[0]
    cdf_VV = chain.transition_VV.cumsum(1)
    ids_NL = torch.empty(N, L, dtype=torch.int64, device="cpu")
    u_LN = torch.rand(L, N, 1, generator=generator, dtype=torch.float64, device="cpu")
    # a draw above a row's last cumulative sum (1 up to rounding) takes the row's last possible token
    last_V = (V - 1) - (chain.transition_VV.flip(1) > 0).to(torch.int64).argmax(1)
    start_V = chain.stationary_V
    first_last = (V - 1) - int((start_V.flip(0) > 0).to(torch.int64).argmax())
    ids_NL[:, 0] = torch.searchsorted(start_V.cumsum(0), u_LN[0, :, 0], right=True).clamp(max=first_last)
    for t in range(1, L):
        prev_N = ids_NL[:, t - 1]
        drawn_N = torch.searchsorted(cdf_VV.index_select(0, prev_N), u_LN[t], right=True)[:, 0]
        ids_NL[:, t] = torch.minimum(drawn_N, last_V.index_select(0, prev_N))
    return ids_NL


# ---------------------------------------------------------------------------------------------------------
# File sources


def _check_file(path: str | Path, itemsize: int) -> Path:
    """Return `path` as a Path; FileNotFoundError / ValueError (naming it) if missing, empty or ragged."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist (or is not a file)")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"token file {path} is empty")
    if size % itemsize:
        raise ValueError(f"token file {path} has {size} bytes, not a multiple of the token size {itemsize}")
    return path


def token_file(path: str | Path, dtype: str) -> np.memmap:
    """Return the tokens of a flat binary file (as written by `ndarray.tofile`) as a read-only 1-D memmap of
    `dtype` ("uint16" or "uint32"); nothing is read until indexed."""
    choice("dtype", dtype, tuple(_TOKEN_DTYPES))
    np_dtype = _TOKEN_DTYPES[dtype]
    path = _check_file(path, np.dtype(np_dtype).itemsize)
    return np.memmap(path, dtype=np_dtype, mode="r")


def byte_file(path: str | Path) -> np.memmap:
    """Return the bytes of a file (text at byte level, vocabulary 256) as a read-only 1-D uint8 memmap."""
    path = _check_file(path, 1)
    return np.memmap(path, dtype=np.uint8, mode="r")


# ---------------------------------------------------------------------------------------------------------
# Windows


class Dataset:
    """A set of `num_windows` token windows of S + 1 = seq_len + 1 tokens (ids = w[:-1], targets = w[1:]).

    source: the Markov corpus int64 [N, S + 1] (one sequence per window), or for a file the flat 1-D memmap
        of its tokens, cut into non-overlapping windows (the tail that fills no window is unused).
    floor: the entropy rate in nats/token for a Markov source (the best reachable mean loss), else None.
    path: the file of a file source, else None.
    """

    def __init__(self, *, name: str, vocab_size: int, seq_len: int, source: torch.Tensor | np.memmap,
                 floor: float | None = None, path: Path | None = None) -> None:
        self.name = name
        self.vocab_size = integer("vocab_size", vocab_size)
        self.seq_len = integer("seq_len", seq_len)
        self.floor = floor
        self.path = path
        self.source = source
        window = self.seq_len + 1
        if isinstance(source, torch.Tensor):
            if source.dim() != 2 or source.shape[1] != window:
                raise ValueError(f"{name}: corpus must be [N, {window}], got {tuple(source.shape)}")
            self.num_windows = int(source.shape[0])
        else:
            self.num_windows = len(source) // window
        if self.num_windows == 0:
            raise ValueError(f"{name} has {len(source)} tokens; one window needs {window} "
                             f"(seq_len {self.seq_len} + 1)")

    def windows(self, indices_N: torch.Tensor) -> torch.Tensor:
        """Return int64 [n, S + 1]: the windows `indices_N` (int [n], each in [0, num_windows)), in order.

        For a file only those rows are read from the memmap; ValueError if one holds a token >= vocab_size.
        """
        indices_N = torch.as_tensor(indices_N, device="cpu")
        if indices_N.dim() != 1 or indices_N.dtype.is_floating_point or indices_N.dtype == torch.bool:
            raise ValueError(f"indices_N must be a 1-D integer tensor, got {indices_N.dtype} "
                             f"{tuple(indices_N.shape)}")
        if indices_N.numel() and (int(indices_N.min()) < 0 or int(indices_N.max()) >= self.num_windows):
            raise IndexError(f"{self.name}: window indices must lie in [0, {self.num_windows}), got "
                             f"[{int(indices_N.min())}, {int(indices_N.max())}]")
        if isinstance(self.source, torch.Tensor):
            return self.source[indices_N.long()]
        window = self.seq_len + 1
        # A 2-D view of the memmap (no read); fancy indexing then copies just the requested rows.
        rows_NW = self.source[: self.num_windows * window].reshape(self.num_windows, window)
        windows_NS1 = torch.from_numpy(np.asarray(rows_NW[indices_N.numpy()], dtype=np.int64))
        if windows_NS1.numel() and int(windows_NS1.max()) >= self.vocab_size:
            raise ValueError(f"token file {self.path} holds token {int(windows_NS1.max())}, outside the "
                             f"vocabulary of size {self.vocab_size} (was it made for a larger vocabulary?)")
        return windows_NS1

    def samples(self, positions_P: torch.Tensor, seed: int) -> torch.Tensor:
        """Return int64 [P, S + 1]: the windows at stream positions `positions_P` (int [P], >= 0) of the
        seeded stream (`stream_indices`)."""
        return self.windows(stream_indices(self.num_windows, positions_P, seed))

    def describe(self) -> str:
        """Return one line naming the source, its windows and its loss floor (if known)."""
        floor = f"floor {self.floor:.3f} nats/token" if self.floor is not None else "no known floor"
        return f"{self.name}: {self.num_windows} windows of {self.seq_len + 1} tokens, {floor}"

    def __repr__(self) -> str:
        return f"Dataset({self.describe()})"


def markov_dataset(vocab_size: int, seq_len: int, num_sequences: int, seed: int) -> Dataset:
    """Return a Dataset of `num_sequences` Markov windows of seq_len + 1 tokens (markov_chain(vocab_size,
    seed), corpus drawn with seed + 1); its floor is the chain's entropy rate."""
    chain = markov_chain(vocab_size, seed)
    corpus_NS1 = markov_corpus(chain, num_sequences, integer("seq_len", seq_len) + 1, seed + 1)
    return Dataset(name=f"markov(V={vocab_size}, seed={seed})", vocab_size=vocab_size, seq_len=seq_len,
                   source=corpus_NS1, floor=chain.entropy_rate)


def file_dataset(path: str | Path, kind: str, seq_len: int, vocab_size: int) -> Dataset:
    """Return a memory-mapped Dataset of a token file: `kind` "bin16" / "bin32" (flat uint16 / uint32
    tokens) or "text" (bytes; needs vocab_size >= 256). Windows are non-overlapping; floor is None."""
    choice("kind", kind, _FILE_KINDS)
    vocab_size = integer("vocab_size", vocab_size)
    if kind == "text":
        if vocab_size < 256:
            raise ValueError(f"a text file is read as bytes (256 values); vocab_size {vocab_size} < 256")
        tokens = byte_file(path)
    else:
        tokens = token_file(path, "uint16" if kind == "bin16" else "uint32")
    return Dataset(name=f"{kind}({path}, V={vocab_size})", vocab_size=vocab_size, seq_len=seq_len,
                   source=tokens, path=Path(path))


# ---------------------------------------------------------------------------------------------------------
# Sampling


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """int64 [num_windows]: the visiting order of `epoch`. Cached: consecutive steps share an epoch.
    Callers must not modify the returned tensor (it is the cache's)."""
    generator = torch.Generator().manual_seed(seed * _EPOCH_SEED_STRIDE + epoch)
    return torch.randperm(num_windows, generator=generator, device="cpu")


def batch_indices(num_windows: int, global_batch: int, step: int, seed: int) -> torch.Tensor:
    """Return int64 [G]: the window indices of global step `step` (0-based): `stream_indices` of the
    positions step * G + j, j < G."""
    G = integer("global_batch", global_batch)
    step = integer("step", step, minimum=0)
    return stream_indices(num_windows, step * G + torch.arange(G, dtype=torch.int64, device="cpu"), seed)


def stream_indices(num_windows: int, positions_P: torch.Tensor, seed: int) -> torch.Tensor:
    """Return int64 [P]: the window indices at stream positions `positions_P` (int [P], >= 0).

    Position p of the stream is window perm_e[p % num_windows] of epoch e = p // num_windows,
    perm_e = randperm(num_windows) seeded with seed * 1_000_003 + e. A batch may straddle epochs.
    """
    N = integer("num_windows", num_windows)
    seed = integer("seed", seed, minimum=0)
    if seed >= MAX_SEED:
        raise ValueError(f"seed must be < 2**40, got {seed}")
    p_P = torch.as_tensor(positions_P, dtype=torch.int64, device="cpu")
    if p_P.numel() and int(p_P.min()) < 0:
        raise ValueError(f"stream positions must be >= 0, got {int(p_P.min())}")
    epoch_P, slot_P = p_P // N, p_P % N
    out_P = torch.empty_like(p_P)
    for epoch in epoch_P.unique().tolist():
        mask_P = epoch_P == epoch
        out_P[mask_P] = _epoch_permutation(N, seed, epoch)[slot_P[mask_P]]
    return out_P


def _rank_rows(global_batch: int, data_rank: int, data_ranks: int, micro_batch: int) -> tuple[int, int]:
    """Return (first row, m): data rank r owns rows [first, first + m * micro_batch) of the global batch."""
    G = integer("global_batch", global_batch)
    B = integer("micro_batch", micro_batch)
    R = integer("data_ranks", data_ranks)
    r = integer("data_rank", data_rank, minimum=0)
    if r >= R:
        raise ValueError(f"data_rank must lie in [0, {R}), got {r}")
    if G % (B * R):
        raise ValueError(f"global batch {G} is not divisible by micro_batch {B} x data_ranks {R} = {B * R}")
    m = G // (B * R)
    return r * m * B, m


def shard_microbatches(windows_GS1: torch.Tensor, data_rank: int, data_ranks: int,
                       micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return data rank r's m = G / (micro_batch * R) microbatches [(ids_BS, targets_BS)], each int64
    contiguous [micro_batch, S] with ids = w[:, :-1] and targets = w[:, 1:].

    The global batch windows_GS1 [G, S + 1] (stream order) is cut into G / micro_batch microbatches of
    consecutive rows; rank r takes the contiguous run [r * m, (r + 1) * m) of them.
    """
    if windows_GS1.dim() != 2 or windows_GS1.shape[1] < 2:
        raise ValueError(f"windows_GS1 must be [G, S + 1] with S >= 1, got {tuple(windows_GS1.shape)}")
    first, m = _rank_rows(windows_GS1.shape[0], data_rank, data_ranks, micro_batch)
    out = []
    for k in range(m):
        w_BS1 = windows_GS1[first + k * micro_batch: first + (k + 1) * micro_batch].long()
        out.append((w_BS1[:, :-1].contiguous(), w_BS1[:, 1:].contiguous()))
    return out


def microbatches(dataset: Dataset, step: int, *, global_batch: int, micro_batch: int, data_rank: int,
                 data_ranks: int, seed: int,
                 start: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return data rank r's microbatches [(ids_BS, targets_BS)] of global step `step`: shard_microbatches of
    the samples at stream positions [start, start + G) (`start` default step x G), reading only the G / R
    of this rank."""
    first, m = _rank_rows(global_batch, data_rank, data_ranks, micro_batch)
    start = integer("step", step, minimum=0) * global_batch if start is None else integer("start", start, 0)
    positions_M = start + first + torch.arange(m * micro_batch, dtype=torch.int64, device="cpu")
    return shard_microbatches(dataset.samples(positions_M, seed), 0, 1, micro_batch)
