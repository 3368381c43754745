"""Megatron's indexed dataset: a `.bin` of tokens and its `.idx`, read memory-mapped and written alike.

    ds = IndexedDataset("corpus_text_document")       # corpus_text_document.bin / .idx
    tokens = ds[i]                                     # sequence i: a read-only numpy view, nothing copied
    with IndexedWriter("out_text_document", np.uint16) as w:
        w.add_document(ids, lengths=[len(ids)])        # one document of one sequence

The layout (megatron/core/datasets/indexed_dataset.py writes and reads it; all little-endian):
    .idx: b"MMIDIDX\\x00\\x00", u64 version 1, u8 dtype code, u64 N sequences, u64 D + 1 document
          indices, then int32 lengths [N], int64 byte pointers into .bin [N], int64 document indices
          [D + 1] (0, then after each document the number of sequences so far); a multimodal index adds
          int8 modes [N] after them, which this reader leaves unread.
    .bin: the sequences' tokens back to back, in the dtype of the code.
Dtype codes are Megatron's `DType`: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
8 uint16; tokens must be an integer dtype. Megatron's GPT dataset counts sequences as its documents (a
corpus preprocessed without sentence splitting has one sequence per document), and so does fmoe.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from types import TracebackType

import numpy as np

__all__ = ["DTYPE_CODES", "IndexedDataset", "IndexedWriter", "optimal_dtype"]

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                            6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_PREAMBLE = len(HEADER) + 8 + 1 + 8 + 8  # header, version, code, N, D + 1: 34 bytes
# `read` (the samples' path) copies its tokens out of the .bin's map, then madvise(MADV_DONTNEED)s the
# 2 MiB-aligned window around them. A fault on a mapped file maps the pages around it into the process too
# (fault-around, 64 KiB; readahead fills the page cache further), so without it a process that touched a few
# thousand samples of a 2 GB corpus held +744 MiB of resident set over one reading 20 MB (MADV_RANDOM:
# still +350 MiB). DONTNEED on a read-only file map only unmaps: the pages stay in the page cache, a later
# read faults them back in. Fault-around never crosses a 2 MiB page-table boundary, so the window holds
# every page the read mapped (benchmarks/data_loader.py memory, BENCHMARKS.md "Data loader").
_MAPPED_READ = 2 << 20


def optimal_dtype(vocab_size: int) -> type[np.generic]:
    """The token dtype Megatron's preprocess_data.py picks for a vocabulary: uint16 below 65500, else
    int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """The sequences of `prefix`.bin / `prefix`.idx: opening reads the 34-byte preamble only; the index and
    the .bin are memory-mapped, and `read` gives the pages it touched back to the kernel (`_MAPPED_READ`).

    dtype: the tokens' numpy dtype; lengths_N int32, pointers_N int64 (bytes into .bin) and
    document_indices_D1 int64 are read-only views of the .idx map. ValueError (naming the file) for a
    missing file, a bad header, version or dtype code, an index that does not fit its file, or sequences
    that run past the end of the .bin.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        bin_path, idx_path = _paths(prefix)
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise ValueError(f"--data-path {self.prefix}: no file {p} (an indexed dataset is PREFIX.bin "
                                 "and PREFIX.idx, as fmoe preprocess or Megatron's preprocess_data.py write)")
        with open(idx_path, "rb") as f:
            head = f.read(_PREAMBLE)
        if len(head) < _PREAMBLE or head[:len(HEADER)] != HEADER:
            raise ValueError(f"{idx_path} is not a Megatron index (no {HEADER!r} header)")
        version, code, n, d1 = struct.unpack("<QBQQ", head[len(HEADER):])
        if version != VERSION:
            raise ValueError(f"{idx_path} has index version {version}; fmoe reads version {VERSION}")
        if code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]).kind not in "ui":
            raise ValueError(f"{idx_path} has dtype code {code}: tokens need an integer code "
                             f"({', '.join(f'{c} {np.dtype(t).name}' for c, t in DTYPE_CODES.items())})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        need = _PREAMBLE + n * (4 + 8) + d1 * 8
        size = idx_path.stat().st_size
        if size < need or d1 < 1:
            raise ValueError(f"{idx_path} is truncated: {n} sequences and {d1} document indices need "
                             f"{need} bytes, the file has {size}")
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.lengths_N = np.frombuffer(idx, dtype="<i4", count=n, offset=_PREAMBLE)
        self.pointers_N = np.frombuffer(idx, dtype="<i8", count=n, offset=_PREAMBLE + 4 * n)
        self.document_indices_D1 = np.frombuffer(idx, dtype="<i8", count=d1, offset=_PREAMBLE + 12 * n)
        bin_size = bin_path.stat().st_size
        if n:
            end = int(self.pointers_N[-1]) + int(self.lengths_N[-1]) * self.dtype.itemsize
            if end > bin_size:
                raise ValueError(f"{bin_path} has {bin_size} bytes; its index {idx_path} reaches byte {end} "
                                 f"(a partial copy, or the .bin of another dataset?)")
        self.bin_path, self.bin_bytes = bin_path, bin_size
        self._tokens: np.ndarray | None = None
        with open(bin_path, "rb") as f:  # the map outlives the descriptor
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if bin_size else None

    @property
    def tokens(self) -> np.ndarray:
        """The whole .bin as a read-only memory map of the token dtype (mapped on first use)."""
        if self._tokens is None:
            # an empty .bin cannot be mapped: a dataset of empty sequences reads from an empty array
            self._tokens = (np.memmap(self.bin_path, dtype=self.dtype.newbyteorder("<"), mode="r")
                            if self.bin_bytes else np.empty(0, dtype=self.dtype))
        return self._tokens

    def __len__(self) -> int:
        """The number of sequences N."""
        return len(self.lengths_N)

    @property
    def num_documents(self) -> int:
        """Documents D (the document index holds D + 1 boundaries)."""
        return len(self.document_indices_D1) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence i's tokens: a read-only view of the .bin map (nothing is read until used)."""
        start = int(self.pointers_N[i]) // self.dtype.itemsize
        return self.tokens[start: start + int(self.lengths_N[i])]

    def read(self, i: int, offset: int, count: int) -> np.ndarray:
        """Up to `count` tokens of sequence i from token `offset` on (fewer where it ends), as int64: copied
        out of the .bin's map, whose pages around them are then dropped from this process (`_MAPPED_READ`)."""
        count = max(0, min(count, int(self.lengths_N[i]) - offset))
        if not count:
            return np.empty(0, dtype=np.int64)
        size = self.dtype.itemsize
        lo = int(self.pointers_N[i]) + offset * size
        tokens = np.frombuffer(self._map, dtype=self.dtype.newbyteorder("<"), count=count, offset=lo)
        out = tokens.astype(np.int64)
        del tokens  # the map's exported buffer
        a = lo // _MAPPED_READ * _MAPPED_READ
        b = min(self.bin_bytes, -(-(lo + count * size) // _MAPPED_READ) * _MAPPED_READ)
        self._map.madvise(mmap.MADV_DONTNEED, a, b - a)
        return out


class IndexedWriter:
    """Writes `prefix`.bin as documents come and `prefix`.idx on close, in Megatron's layout (module
    docstring): what megatron-core's IndexedDataset reads. Use as a context manager; a failure inside the
    block leaves no .idx (the dataset is not complete)."""

    def __init__(self, prefix: str | Path, dtype: type[np.generic]) -> None:
        if np.dtype(dtype) not in _CODE_OF or np.dtype(dtype).kind not in "ui":
            raise ValueError(f"IndexedWriter: tokens need an integer dtype of Megatron's codes, got {dtype}")
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.bin_path, self.idx_path = _paths(prefix)
        self.lengths: list[int] = []
        self.document_indices = [0]
        self._file = open(self.bin_path, "wb")  # noqa: SIM115 - closed in close()

    def add_document(self, tokens: np.ndarray | list[int], lengths: list[int]) -> None:
        """Appends one document: `tokens` (its sequences back to back) cut into sequences of `lengths`
        (summing to len(tokens)); ValueError for a token the dtype cannot hold."""
        arr = np.asarray(tokens, dtype=np.int64)
        if sum(lengths) != arr.size:
            raise ValueError(f"add_document: lengths sum to {sum(lengths)}, the document has {arr.size} "
                             "tokens")
        info = np.iinfo(self.dtype)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise ValueError(f"add_document: token {int(arr.max())} does not fit {self.dtype.name}")
        self._file.write(arr.astype(self.dtype).tobytes())
        self.lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.lengths))

    def close(self) -> None:
        """Closes the .bin and writes the .idx."""
        self._file.close()
        lengths = np.asarray(self.lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self.idx_path, "wb") as f:
            f.write(HEADER + struct.pack("<QBQQ", VERSION, _CODE_OF[np.dtype(self.dtype.name)], len(lengths),
                                         len(self.document_indices)))
            f.write(lengths.tobytes() + pointers.tobytes()
                    + np.asarray(self.document_indices, dtype="<i8").tobytes())

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()
