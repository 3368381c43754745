"""Tokenize JSON lines into Megatron indexed datasets (the flags of Megatron's tools/preprocess_data.py).

Examples:
  fmoe preprocess --input corpus.jsonl --output-prefix data/corpus --tokenizer-type HuggingFaceTokenizer \
      --tokenizer-model tokenizer.json --append-eod --workers 4      # data/corpus_text_document.bin/.idx
  fmoe train --data-path data/corpus_text_document --tokenizer-type HuggingFaceTokenizer \
      --tokenizer-model tokenizer.json ...

Each line of --input is a JSON object; each --json-keys key's text (or list of texts, one sequence each)
becomes one document of `{prefix}_{key}_document`, encoded without special tokens, the EOD appended after
its last sequence with --append-eod. A document whose text encodes to nothing is kept as an empty
document, as Megatron's builder does. --workers processes encode in parallel; the output is the same for
any number of them (lines are written in input order).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections.abc import Iterator

from fmoe.train.indexed import IndexedWriter, optimal_dtype
from fmoe.train.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer

_tokenizer: Tokenizer | None = None  # a worker's own, built once by _init


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers `fmoe preprocess`'s options (Megatron's names) on `parser`."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument("--input", required=True, help="JSON lines file, one document per line")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys of each line to tokenize")
    parser.add_argument("--output-prefix", required=True, help="writes {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", help="tokenizer.json (or its directory) / sentencepiece .model")
    parser.add_argument("--vocab-size", type=int, help="NullTokenizer: ids 0..V-1, EOD V")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    parser.add_argument("--workers", type=int, default=1, help="encoding processes")
    parser.add_argument("--log-interval", type=int, default=100000, help="documents between progress lines")


def _init(kind: str, model: str | None, vocab_size: int | None) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(kind, model, vocab_size)


def _encode(job: tuple[int, str, tuple[str, ...], bool]) -> list[tuple[list[int], list[int]]] | str:
    """One line -> per key (ids, sequence lengths); or the one-line error naming the line."""
    number, line, keys, append_eod = job
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"line {number} is not JSON ({exc.msg})"
    out = []
    for key in keys:
        if not isinstance(record, dict) or key not in record:
            return f"line {number} has no key {key!r} (--json-keys)"
        texts = record[key] if isinstance(record[key], list) else [record[key]]
        ids: list[int] = []
        lengths: list[int] = []
        for text in texts:
            if not isinstance(text, str):
                return f"line {number}: {key!r} holds {type(text).__name__}, not text"
            seq = _tokenizer.encode(text)
            if seq:
                ids += seq
                lengths.append(len(seq))
        if ids and append_eod:
            ids.append(_tokenizer.eod)
            lengths[-1] += 1
        out.append((ids, lengths))
    return out


def _jobs(path: str, keys: tuple[str, ...], append_eod: bool) -> Iterator[tuple[int, str, tuple, bool]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line, keys, append_eod


def preprocess(input_path: str, json_keys: list[str], output_prefix: str, tokenizer_type: str,
               tokenizer_model: str | None = None, vocab_size: int | None = None, append_eod: bool = False,
               workers: int = 1, log_interval: int = 100000) -> dict[str, str]:
    """Writes one indexed dataset per key (module docstring); returns key -> its prefix. ValueError with one
    line naming the input line or flag at fault (the partial outputs then have no .idx)."""
    tok = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
    if workers < 1:
        raise ValueError(f"--workers must be a positive integer, got {workers}")
    prefixes = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    writers = [IndexedWriter(p, optimal_dtype(tok.vocab_size)) for p in prefixes.values()]
    jobs = _jobs(input_path, tuple(json_keys), append_eod)
    t0, done = time.perf_counter(), 0
    pool = multiprocessing.get_context("spawn").Pool(workers, _init, (tokenizer_type, tokenizer_model,
                                                                        vocab_size)) if workers > 1 else None
    try:
        if pool is None:
            _init(tokenizer_type, tokenizer_model, vocab_size)
            results = map(_encode, jobs)
        else:
            results = pool.imap(_encode, jobs, chunksize=64)
        for result in results:
            if isinstance(result, str):
                raise ValueError(f"--input {input_path}: {result}")
            for writer, (ids, lengths) in zip(writers, result):
                writer.add_document(ids, lengths)
            done += 1
            if done % log_interval == 0:
                rate = done / (time.perf_counter() - t0)
                print(f"fmoe preprocess: {done} documents, {rate:.0f} documents/s", file=sys.stderr,
                      flush=True)
    except BaseException:
        for writer in writers:
            writer.__exit__(ValueError, None, None)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    for writer in writers:
        writer.close()
    return prefixes


def run(args: argparse.Namespace) -> int:
    """Runs `fmoe preprocess`; returns 0, or 2 with one `fmoe preprocess: error: ...` line."""
    try:
        out = preprocess(args.input, args.json_keys, args.output_prefix, args.tokenizer_type,
                         args.tokenizer_model, args.vocab_size, args.append_eod, args.workers,
                         args.log_interval)
    except (ValueError, OSError) as exc:
        print(f"fmoe preprocess: error: {str(exc).splitlines()[0]}")
        return 2
    for key, prefix in out.items():
        print(f"fmoe preprocess: {key} -> {prefix}.bin / .idx")
    return 0
