"""Real text any machine has: the Python standard library's sources as JSON lines, and a byte-level BPE
tokenizer trained on them locally with `tokenizers` (nothing downloaded).

    python -m fmoe.examples.stdlib_text --out data --vocab-size 4096
    # data/stdlib.jsonl ({"text": <a module's source>} per line) and data/tokenizer.json (EOD <|endoftext|>)

then `fmoe preprocess` and `fmoe train --data-path` (README.md, docs/data.md).
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

EOD = "<|endoftext|>"


def stdlib_sources(limit: int | None = None) -> Iterator[str]:
    """The text of the standard library's .py files (sorted paths, so every machine with the same Python
    reads them in one order), at most `limit` of them; files that are not UTF-8 are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    count = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or (limit is not None and count >= limit):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            count += 1
            yield text


def train_bpe(texts: list[str], vocab_size: int, path: str | Path) -> None:
    """Trains a byte-level BPE of `vocab_size` on `texts` (EOD the special token <|endoftext|>) and saves
    it as a tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))


def main(argv: list[str] | None = None) -> int:
    """Writes OUT/stdlib.jsonl and OUT/tokenizer.json (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write into")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary (with <|endoftext|>)")
    parser.add_argument("--limit", type=int, help="at most this many source files")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = list(stdlib_sources(args.limit))
    with open(out / "stdlib.jsonl", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    train_bpe(texts, args.vocab_size, out / "tokenizer.json")
    print(f"{out / 'stdlib.jsonl'}: {len(texts)} files, {sum(map(len, texts))} characters; "
          f"{out / 'tokenizer.json'}: BPE of {args.vocab_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
