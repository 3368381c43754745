"""What a run trains on, as flags give it and as a checkpoint records it.

    values = resolve_vocab(values)        # --tokenizer-type: the vocabulary from the tokenizer, padded
    problem = check_data_source(tc)       # raises ValueError, one line naming the flag
    ident = data_identity(tc)             # recorded in a checkpoint's meta.json ("data")
    diff = data_diff(saved, ident)        # what a resume or load would change: ["split: ...", ...]

The identity is what decides which tokens step k reads: the source (the Markov corpus and its sizes, a
file and its kind, or --data-path's prefixes and weights), --split, --seq-length, --seed (the order), the
tokenizer's EOD mask, and each file's size and a digest of its ends (so a file re-tokenized in place is
noticed). Paths are compared as given: a copy of the data elsewhere is a difference the user overrides
with --override-data.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from fmoe.train.tokenizer import Tokenizer, build_tokenizer, padded_vocab_size

# a fmoe.train.config.TrainConfig, named and not imported: the config reads this module (its checks and
# the tokenizer's vocabulary), so an import back, even for types, would close a circle
TrainConfig = Any

SAMPLE_BYTES = 1 << 16  # hashed at each end of a data file: cheap, and catches another file or version


def resolve_vocab(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (TrainConfig fields) with vocab_size set from --tokenizer-type / --tokenizer-model when it
    is not given: the tokenizer's vocabulary padded to a multiple of --make-vocab-size-divisible-by x tp
    (Megatron's). NullTokenizer takes --vocab-size as it is."""
    kind = values.get("tokenizer_type")
    if kind in (None, "NullTokenizer") or "vocab_size" in values:
        return values
    tok = build_tokenizer(kind, values.get("tokenizer_model"))
    multiple = values.get("make_vocab_size_divisible_by", 128)
    return {**values, "vocab_size": padded_vocab_size(tok.vocab_size, multiple, values.get("tp", 1))}


def run_tokenizer(tc: TrainConfig) -> Tokenizer | None:
    """The run's tokenizer (None without --tokenizer-type); NullTokenizer's EOD is the last id of
    --vocab-size (fmoe/train/tokenizer.py)."""
    if tc.tokenizer_type is None:
        return None
    if tc.tokenizer_type == "NullTokenizer":
        return Tokenizer("NullTokenizer", tc.vocab_size, tc.vocab_size - 1)
    return build_tokenizer(tc.tokenizer_type, tc.tokenizer_model)


def eod_mask(tc: TrainConfig) -> int | None:
    """The EOD id whose next-token targets take no loss (--eod-mask-loss), else None."""
    return run_tokenizer(tc).eod if tc.eod_mask_loss else None


def check_data_source(tc: TrainConfig) -> None:
    """--data-path, the tokenizer flags and --eod-mask-loss, with what they need of each other: ValueError,
    one line naming the flag. Opens each prefix's index (memory-mapped: reads its header)."""
    tok = run_tokenizer(tc)
    if tok is not None and tc.vocab_size < tok.vocab_size:
        raise ValueError(f"--vocab-size {tc.vocab_size} is smaller than --tokenizer-model's vocabulary of "
                         f"{tok.vocab_size}: leave --vocab-size out (it is then padded from the tokenizer's)")
    if tc.eod_mask_loss:
        if tok is None:
            raise ValueError("--eod-mask-loss masks the token after each end of document: give "
                             "--tokenizer-type (and --tokenizer-model) to name the EOD token")
        if tc.mtp:
            raise ValueError("--eod-mask-loss with --mtp: MTP embeds the target of each position, which the "
                             "mask replaces after an EOD (not supported yet; leave one out)")
    if tc.data_path is None:
        return
    if tc.data != "markov":
        raise ValueError(f"give --data ({tc.data}) or --data-path, not both")
    from fmoe.train.documents import documents_dataset, parse_data_path

    blend = parse_data_path(tc.data_path)
    for part in ("train", "valid") if tc.eval_interval else ("train",):
        documents_dataset(blend, seq_len=tc.seq_length, split=tc.split, part=part, vocab_size=tc.vocab_size,
                          seed=tc.seed)


def file_fingerprint(path: str) -> str:
    """A file's size and the sha256 of its first and last SAMPLE_BYTES (or why it cannot be read)."""
    try:
        size = os.path.getsize(path)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    except OSError as exc:  # compared like any other value
        return f"unreadable ({type(exc).__name__})"
    return f"{size} bytes, sha256 of its ends {h.hexdigest()[:16]}"


def data_identity(tc: TrainConfig) -> dict[str, Any]:
    """What decides the run's tokens (module docstring), as JSON-ready values."""
    out: dict[str, Any] = {"seq_length": tc.seq_length, "seed": tc.seed}
    if tc.data_path is not None:
        from fmoe.train.documents import parse_data_path

        blend = parse_data_path(tc.data_path)
        out["source"] = "data-path"
        out["blend"] = [[w, p] for w, p in blend]
        out["split"] = tc.split
        out["files"] = {p + ext: file_fingerprint(p + ext) for _, p in blend for ext in (".bin", ".idx")}
        out["eod_mask"] = eod_mask(tc)
    elif tc.data == "markov":
        out["source"] = "markov"
        out["vocab_size"], out["markov_sequences"] = tc.vocab_size, tc.markov_sequences
    else:
        out["source"] = f"{tc.data_kind} file {tc.data}"
        out["split"] = tc.split
        out["files"] = {tc.data: file_fingerprint(tc.data)}
    return out


def saved_identity(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The data identity a checkpoint records: its meta "data", or for an older fmoe train checkpoint the
    one its config gives (without file digests); None for a checkpoint not written by fmoe train."""
    if isinstance(meta.get("data"), dict):
        return meta["data"]
    saved = meta.get("config", {})
    if "data" not in saved or "seed" not in saved:
        return None
    out = {"seq_length": saved.get("seq_length"), "seed": saved["seed"]}
    if saved["data"] == "markov":
        out.update(source="markov", vocab_size=saved.get("vocab_size"),
                   markov_sequences=saved.get("markov_sequences"))
    else:
        out.update(source=f"{saved.get('data_kind')} file {saved['data']}", split=saved.get("split"))
    return out


def data_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys where a checkpoint's data identity and this run's differ, each "key: checkpoint X, this
    run Y" (keys the checkpoint does not record are not compared)."""
    if saved.get("source") != now.get("source"):
        return [f"source: checkpoint {saved.get('source')!r}, this run {now.get('source')!r}"]
    out = []
    for key in saved:
        if key == "files":
            for path in sorted(set(saved["files"]) | set(now.get("files", {}))):
                a, b = saved["files"].get(path), now.get("files", {}).get(path)
                if a != b:
                    out.append(f"{path}: checkpoint {a or 'not read'}, this run {b or 'not read'}")
        elif saved[key] != now.get(key):
            out.append(f"{key}: checkpoint {saved[key]!r}, this run {now.get(key)!r}")
    return out
