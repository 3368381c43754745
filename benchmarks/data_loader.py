"""--data-path's loader against what training consumes, and its memory against the dataset's size.

    .venv/bin/python benchmarks/data_loader.py speed            # loader tokens/s vs training tokens/s
    .venv/bin/python benchmarks/data_loader.py memory --dir /tmp/fmoe-mem   # RSS reading 20 MB vs 2 GB

speed: a blend of two indexed datasets (0.3 / 0.7; random documents of 16..2048 tokens, each ending with
the EOD) read as one data rank reads a whole global batch, step after step, and its documents made
(fmoe.packing.pack_documents, all three flags, on the host here; training makes them on its device), at
the tiny and small presets' seq-length and global batch; against the tokens/s of training steps of the
same preset's model on one process (pp 1 x ep 1, the accumulate path) over the same data with
--reset-position-ids --reset-attention-mask --eod-mask-loss. The loader's figure
is without the background thread (the thread only moves the same work off the critical path).

memory: for each dataset size and each way of reading the .bin, a fresh process opens the dataset, builds
the train split's stream and reads STEPS global batches of the tiny preset (32 x 65 tokens) across it; it
prints VmHWM (peak resident set), RssAnon (the process's own memory) and RssFile (pages of the mapped files
it touched, page cache shared with every reader and given back under pressure) from /proc/self/status.
Readers, interleaved per size: "mapped" (fmoe's: copied out of the .bin's map, the window then
madvise(MADV_DONTNEED)ed), "mapped-kept" (the same copy out of the map, pages left mapped) and "pread"
(os.pread of the bytes, no map of the .bin). Before each child the whole .bin is read once, so it sits in
the page cache (as right after preprocessing, or on a machine that read it before): a mapped reader's
worst case, since a fault maps the cached pages around it into the process. Documents of 16..2048
tokens: 2 GB of uint16 is about 1M documents, whose per-epoch order and running token count are the
arrays that grow with the corpus (8 bytes each per document).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fmoe.packing import pack_documents
from fmoe.train.data import microbatches
from fmoe.train.documents import documents_dataset, parse_data_path
from fmoe.train.indexed import IndexedWriter

V, EOD = 4096, 4095
PRESETS = {"tiny": (64, 32), "small": (128, 64)}  # seq_length, global batch


def write_dataset(prefix: str, num_tokens: int, seed: int) -> None:
    """Random documents of 16..2048 tokens (the last of each the EOD) up to about `num_tokens` tokens,
    written in chunks of sequences (Megatron's GPT counts sequences as its documents)."""
    rng = np.random.default_rng(seed)
    written = 0
    with IndexedWriter(prefix, np.uint16) as w:
        while written < num_tokens:
            lengths = rng.integers(16, 2049, size=4096)
            tokens = rng.integers(0, EOD, size=int(lengths.sum()), dtype=np.uint16)
            tokens[np.cumsum(lengths) - 1] = EOD
            w.add_document(tokens, lengths.tolist())
            written += int(lengths.sum())


def loader_rate(blend: list, S: int, G: int, steps: int) -> float:
    """Tokens/s of reading `steps` consecutive global batches (S + 1 tokens per sample) on one rank."""
    ds = documents_dataset(blend, seq_len=S, split="969,30,1", part="train", vocab_size=V, seed=1234)
    # the first read builds epoch 0's order: once per epoch, not per step
    microbatches(ds, 0, global_batch=G, micro_batch=G, data_rank=0, data_ranks=1, seed=1234)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for ids, _ in microbatches(ds, step, global_batch=G, micro_batch=G, data_rank=0, data_ranks=1,
                                   seed=1234):
            pack_documents(ids, EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    return steps * G * S / (time.perf_counter() - t0)


def training_rate(preset: str, data_path: list[str], steps: int) -> float:
    """Median tokens/s of `steps` training steps (after one warm-up) of `preset`'s model, pp 1 x ep 1."""
    from fmoe.train.config import TrainConfig
    from fmoe.train.launch import _world
    from fmoe.train.loop import Trainer

    tc = TrainConfig.from_sources(preset, None, {
        "pp": 1, "ep": 1, "data_path": tuple(data_path), "tokenizer_type": "NullTokenizer", "vocab_size": V,
        "eod_mask_loss": True, "reset_position_ids": True, "reset_attention_mask": True, "steps": steps + 1,
        "progress": False})
    world = _world(tc, 0, f"file://{tempfile.mktemp()}", 0, 1)
    try:
        trainer = Trainer(tc, world)
        trainer.step()
        rates = [trainer.step()["tokens_per_s"] for _ in range(steps)]
    finally:
        torch.distributed.destroy_process_group()
    return float(np.median(rates))


def speed(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp())
    write_dataset(str(root / "a"), 3_000_000, 0)
    write_dataset(str(root / "b"), 7_000_000, 1)
    data_path = ["0.3", str(root / "a"), "0.7", str(root / "b")]
    blend = parse_data_path(data_path)
    for preset in args.presets:
        S, G = PRESETS[preset]
        load = loader_rate(blend, S, G, args.loader_steps)
        train = training_rate(preset, data_path, args.train_steps)
        print(json.dumps({"preset": preset, "seq_length": S, "global_batch": G,
                          "loader_tokens_per_s": round(load), "training_tokens_per_s": round(train),
                          "ratio": round(load / train, 1)}), flush=True)


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) // 1024  # MiB
    return out


READERS = ("mapped", "mapped-kept", "pread")


def _use_reader(reader: str) -> None:
    """Replaces IndexedDataset.read in this process by the `reader` compared against fmoe's ("mapped")."""
    import os

    from fmoe.train.indexed import IndexedDataset

    if reader == "mapped":
        return

    def read(self: IndexedDataset, i: int, offset: int, count: int) -> np.ndarray:
        count = max(0, min(count, int(self.lengths_N[i]) - offset))
        size, lo = self.dtype.itemsize, int(self.pointers_N[i]) + offset * self.dtype.itemsize
        if reader == "pread":
            fd = self.__dict__.setdefault("_pread_fd", os.open(self.bin_path, os.O_RDONLY))
            return np.frombuffer(os.pread(fd, count * size, lo), dtype=self.dtype).astype(np.int64)
        return np.frombuffer(self._map, dtype=self.dtype, count=count, offset=lo).astype(np.int64)

    IndexedDataset.read = read


def read_child(prefix: str, steps: int, reader: str) -> None:
    """The measured process: opens `prefix`, reads `steps` tiny global batches with `reader`, prints its
    memory."""
    _use_reader(reader)
    S, G = PRESETS["tiny"]
    before = _status()
    ds = documents_dataset(parse_data_path([prefix]), seq_len=S, split="969,30,1", part="train",
                           vocab_size=V, seed=1234)
    stride = max(1, ds.streams[0].num_samples // (steps * G))  # spread the reads over the whole epoch
    for step in range(steps):
        microbatches(ds, 0, global_batch=G, micro_batch=G, data_rank=0, data_ranks=1, seed=1234,
                     start=step * G * stride)
    print(json.dumps({"prefix": prefix, "reader": reader, "bin_bytes": ds.streams[0].dataset.bin_bytes,
                      "documents": len(ds.streams[0].dataset), "before": before, "after": _status()}))


def _cache(path: str) -> None:
    """Reads the file once, so its pages are in the page cache."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def memory(args: argparse.Namespace) -> None:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    sizes = (("small_20MB", 10_000_000), ("large_2GB", 1_000_000_000))
    for name, num_tokens in sizes:
        prefix = str(root / name)
        if not Path(prefix + ".idx").is_file():
            t0 = time.perf_counter()
            write_dataset(prefix, num_tokens, 0)
            print(f"wrote {prefix} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    after: dict[tuple[str, str], dict] = {}
    for k, reader in enumerate(READERS * 2):  # two rounds, sizes in turn, the order rotated each round
        for name, _ in sizes if k < len(READERS) else sizes[::-1]:
            _cache(str(root / name) + ".bin")
            cmd = [sys.executable, __file__, "child", str(root / name), str(args.steps), reader]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout)
            print(out.stdout.strip(), flush=True)
            # the round's figure kept per (reader, size): the larger of the two (the conservative one)
            old = after.get((reader, name))
            after[(reader, name)] = row["after"] if old is None else {k2: max(old[k2], v) for k2, v in
                                                                     row["after"].items()}
    for reader in READERS:
        small, large = after[(reader, sizes[0][0])], after[(reader, sizes[1][0])]
        print(json.dumps({"reader": reader, **{key + "_more_MiB": large[key] - small[key] for key in small}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--loader-steps", type=int, default=200)
    s.add_argument("--train-steps", type=int, default=3)
    s.add_argument("--presets", nargs="+", choices=tuple(PRESETS), default=tuple(PRESETS))
    m = sub.add_parser("memory")
    m.add_argument("--dir", default="/tmp/fmoe-data-memory")
    m.add_argument("--steps", type=int, default=200)
    c = sub.add_parser("child")
    c.add_argument("prefix")
    c.add_argument("steps", type=int)
    c.add_argument("reader", choices=READERS)
    args = parser.parse_args()
    if args.part == "speed":
        speed(args)
    elif args.part == "memory":
        memory(args)
    else:
        read_child(args.prefix, args.steps, args.reader)


if __name__ == "__main__":
    main()
