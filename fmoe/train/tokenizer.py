"""Tokenizers by Megatron's `--tokenizer-type` names: what `fmoe preprocess` encodes with and what gives
`fmoe train` its vocabulary size and end-of-document (EOD) token.

    tok = build_tokenizer("HuggingFaceTokenizer", "tokenizer.json")
    ids = tok.encode("some text")          # list[int], no special tokens added
    tok.vocab_size, tok.eod                # 32000, 2
    padded_vocab_size(tok.vocab_size, 128, tp=2)   # Megatron's --make-vocab-size-divisible-by padding

- HuggingFaceTokenizer: a tokenizer.json, or a directory holding one, read with the `tokenizers` library
  (pip install 'fmoe[data]'); the vocabulary counts the added tokens, as `len(AutoTokenizer)`. The EOD is
  the eos_token of the directory's tokenizer_config.json, else the first special added token named like
  an end of text (EOD_NAMES).
- SentencePieceTokenizer (and GPTSentencePieceTokenizer, Llama2Tokenizer): a .model file read with
  `sentencepiece`; the vocabulary is its pieces, the EOD its eos id (megatron-core's sentencepiece library).
- ByteLevelTokenizer: UTF-8 bytes 0..255 and the EOD 256, a vocabulary of 257 (no file).
- NullTokenizer: text is whitespace-separated token ids. In `fmoe preprocess`, as Megatron's, `--vocab-size
  V` gives ids 0..V-1 and the EOD V; in `fmoe train` --vocab-size is the model's vocabulary and the EOD
  its last id (train a dataset preprocessed with V on --vocab-size V + 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TOKENIZER_TYPES", "Tokenizer", "build_tokenizer", "padded_vocab_size"]

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "ByteLevelTokenizer", "NullTokenizer")
EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
_NEEDS_FILE = TOKENIZER_TYPES[:4]


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer: `kind` (its --tokenizer-type), `vocab_size` (ids 0..vocab_size-1), `eod` (the
    end-of-document id) and the library object `impl` that encodes (None for byte level and null)."""

    kind: str
    vocab_size: int
    eod: int
    impl: Any = None

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without special tokens (the EOD is appended by the caller)."""
        if self.kind == "HuggingFaceTokenizer":
            return self.impl.encode(text, add_special_tokens=False).ids
        if self.kind == "ByteLevelTokenizer":
            return list(text.encode("utf-8"))
        if self.kind == "NullTokenizer":
            return [int(x) for x in text.split()]
        return self.impl.encode(text, out_type=int)


def _library(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        raise ValueError(f"--tokenizer-type needs the {name} package: pip install 'fmoe[data]'") from None


def _hf_eod(impl: Any, directory: Path | None, where: str) -> int:
    config = directory / "tokenizer_config.json" if directory is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        name = eos.get("content") if isinstance(eos, dict) else eos
        if name is not None and impl.token_to_id(name) is not None:
            return int(impl.token_to_id(name))
    added = {t.content for t in impl.get_added_tokens_decoder().values() if t.special}
    for name in EOD_NAMES:
        if name in added:
            return int(impl.token_to_id(name))
    raise ValueError(f"{where} names no end-of-document token (no eos_token in a tokenizer_config.json, no "
                     f"special token among {', '.join(EOD_NAMES)}): add one to the tokenizer")


def build_tokenizer(kind: str, model: str | None = None, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer of `--tokenizer-type kind` (module docstring): `model` its file or directory, and for
    NullTokenizer `vocab_size` the V of ids 0..V-1 (EOD V). ValueError naming the flag for an unknown
    type, a missing file, a missing library or a tokenizer without an end-of-document token."""
    if kind not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type must be one of {', '.join(TOKENIZER_TYPES)}, got {kind!r}")
    if kind in _NEEDS_FILE and (model is None or not Path(model).exists()):
        raise ValueError(f"--tokenizer-type {kind} reads --tokenizer-model: " + (
            "give its file" if model is None else f"no such file or directory {model}"))
    if kind == "ByteLevelTokenizer":
        return Tokenizer(kind, 257, 256)
    if kind == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ValueError("--tokenizer-type NullTokenizer reads ids as they are: give --vocab-size")
        return Tokenizer(kind, vocab_size + 1, vocab_size)
    path = Path(model)
    if kind == "HuggingFaceTokenizer":
        tokenizers = _library("tokenizers")
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"--tokenizer-model {model}: no tokenizer.json there")
        try:
            impl = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library's own error types (a Rust panic message)
            raise ValueError(f"--tokenizer-model {model}: not a tokenizers file ({exc})") from None
        eod = _hf_eod(impl, path if path.is_dir() else file.parent, f"--tokenizer-model {model}")
        return Tokenizer(kind, impl.get_vocab_size(with_added_tokens=True), eod, impl)
    spm = _library("sentencepiece")
    try:
        impl = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as exc:  # sentencepiece raises OSError / RuntimeError for an unreadable model
        raise ValueError(f"--tokenizer-model {model}: not a sentencepiece model ({exc})") from None
    if impl.eos_id() < 0:
        raise ValueError(f"--tokenizer-model {model} has no end-of-sentence piece (eos_id -1): train it with "
                         "one (sentencepiece's default eos_id=2)")
    return Tokenizer(kind, impl.get_piece_size(), impl.eos_id(), impl)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron's `_vocab_size_with_padding`: the smallest multiple of divisible_by x tp >= vocab_size."""
    if divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be a positive integer, got {divisible_by}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
