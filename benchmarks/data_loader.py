"""--data-path's loader against what training consumes, and its memory against the dataset's size.

    .venv/bin/python benchmarks/data_loader.py speed            # loader tokens/s vs training tokens/s
    .venv/bin/python benchmarks/data_loader.py memory --dir /tmp/fmoe-mem   # RSS reading 20 MB vs 2 GB

speed: a blend of two indexed datasets (0.3 / 0.7; random documents of 16..2048 tokens, each ending with
the EOD, --eod-mask-loss on) read as one data rank reads a whole global batch, step after step, at the
tiny and small presets' seq-length and global batch; against the tokens/s of training steps of the same
preset's model on one process (pp 1 x ep 1, the accumulate path) over the same data. The loader's figure
is without the background thread (the thread only moves the same work off the critical path).

memory: for each dataset size, a fresh process opens the dataset, builds the train split's stream and
reads STEPS global batches of the tiny preset (32 x 65 tokens) across it; it prints VmHWM (peak resident
set), RssAnon (the process's own memory) and RssFile (pages of the mapped files it touched, page cache
shared with every reader and given back under pressure) from /proc/self/status. Documents of 16..2048
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
    ds = documents_dataset(blend, seq_len=S, split="969,30,1", part="train", vocab_size=V, seed=1234,
                           eod_mask=EOD)
    # the first read builds epoch 0's order: once per epoch, not per step
    microbatches(ds, 0, global_batch=G, micro_batch=G, data_rank=0, data_ranks=1, seed=1234)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        microbatches(ds, step, global_batch=G, micro_batch=G, data_rank=0, data_ranks=1, seed=1234)
    return steps * G * S / (time.perf_counter() - t0)


def training_rate(preset: str, data_path: list[str], steps: int) -> float:
    """Median tokens/s of `steps` training steps (after one warm-up) of `preset`'s model, pp 1 x ep 1."""
    from fmoe.train.config import TrainConfig
    from fmoe.train.launch import _world
    from fmoe.train.loop import Trainer

    tc = TrainConfig.from_sources(preset, None, {
        "pp": 1, "ep": 1, "data_path": tuple(data_path), "tokenizer_type": "NullTokenizer", "vocab_size": V,
        "eod_mask_loss": True, "steps": steps + 1, "progress": False})
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
    for preset, (S, G) in PRESETS.items():
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


def read_child(prefix: str, steps: int) -> None:
    """The measured process: opens `prefix`, reads `steps` tiny global batches, prints its memory."""
    S, G = PRESETS["tiny"]
    before = _status()
    ds = documents_dataset(parse_data_path([prefix]), seq_len=S, split="969,30,1", part="train",
                           vocab_size=V, seed=1234, eod_mask=EOD)
    stride = max(1, ds.streams[0].num_samples // (steps * G))  # spread the reads over the whole epoch
    for step in range(steps):
        microbatches(ds, 0, global_batch=G, micro_batch=G, data_rank=0, data_ranks=1, seed=1234,
                     start=step * G * stride)
    print(json.dumps({"prefix": prefix, "bin_bytes": ds.streams[0].dataset.bin_bytes,
                      "documents": len(ds.streams[0].dataset), "before": before, "after": _status()}))


def memory(args: argparse.Namespace) -> None:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, num_tokens in (("small_20MB", 10_000_000), ("large_2GB", 1_000_000_000)):
        prefix = str(root / name)
        if not Path(prefix + ".idx").is_file():
            t0 = time.perf_counter()
            write_dataset(prefix, num_tokens, 0)
            print(f"wrote {prefix} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        out = subprocess.run([sys.executable, __file__, "child", prefix, str(args.steps)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout))
        print(out.stdout.strip(), flush=True)
    small, large = (r["after"] for r in rows)
    print(json.dumps({key + "_more_MiB": large[key] - small[key] for key in small}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--loader-steps", type=int, default=200)
    s.add_argument("--train-steps", type=int, default=3)
    m = sub.add_parser("memory")
    m.add_argument("--dir", default="/tmp/fmoe-data-memory")
    m.add_argument("--steps", type=int, default=200)
    c = sub.add_parser("child")
    c.add_argument("prefix")
    c.add_argument("steps", type=int)
    args = parser.parse_args()
    if args.part == "speed":
        speed(args)
    elif args.part == "memory":
        memory(args)
    else:
        read_child(args.prefix, args.steps)


if __name__ == "__main__":
    main()
