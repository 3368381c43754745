"""fmoe's indexed datasets, preprocess, blends and splits against megatron-core itself (a dev dependency:
pip install megatron-core==0.16.1, no Transformer Engine needed).

Both ways: a dataset written by megatron-core's IndexedDatasetBuilder is read by fmoe token for token (every
integer dtype code, empty documents, multi-sequence documents), and one written by `fmoe preprocess` is
read back by megatron-core's IndexedDataset as the tokenizer's encoding of each line plus the EOD. The blend
table against megatron-core's compiled build_blending_indices, the document split against its builder's
bookends.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fmoe.cli.main import main
from fmoe.examples.stdlib_text import train_bpe
from fmoe.train.documents import blend_table
from fmoe.train.indexed import IndexedDataset, IndexedWriter
from fmoe.train.splits import split_bounds
from fmoe.train.tokenizer import build_tokenizer

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": expected on CPU
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers_cpp
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

INT_DTYPES = (np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16)

documents = st.lists(st.lists(st.lists(st.integers(0, 120), min_size=0, max_size=9), min_size=0, max_size=3),
                     min_size=1, max_size=12)  # documents of sequences of tokens


@settings(max_examples=40)
@given(docs=documents, dtype=st.sampled_from(INT_DTYPES))
@example(docs=[[]], dtype=np.uint16)                      # one empty document, no sequence at all
@example(docs=[[[1, 2, 3]], [], [[4], [5, 6]]], dtype=np.int32)  # an empty document between two
def test_megatron_builder_output_is_read_token_for_token(tmp_path_factory, docs, dtype) -> None:
    prefix = str(tmp_path_factory.mktemp("mb") / "ds")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.tensor(seq, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")

    ours = IndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert ours.dtype == np.dtype(dtype) and len(ours) == len(flat)
    assert [ours[i].tolist() for i in range(len(ours))] == flat
    want_docs = np.cumsum([0] + [len(doc) for doc in docs])
    assert ours.document_indices_D1.tolist() == want_docs.tolist() and ours.num_documents == len(docs)
    for i, seq in enumerate(flat):  # the offset reads the stream uses
        for offset in range(len(seq)):
            assert ours.read(i, offset, 2).tolist() == seq[offset: offset + 2]


@settings(max_examples=40)
@given(docs=documents, dtype=st.sampled_from(INT_DTYPES))
@example(docs=[[[7]], [], [[], [0, 255]]], dtype=np.uint8)  # empty documents and an empty sequence
def test_fmoe_writer_output_is_read_by_megatron(tmp_path_factory, docs, dtype) -> None:
    # megatron-core cannot map an empty .bin (numpy refuses to mmap 0 bytes): a dataset of no token at all is
    # the one case it does not read, and fmoe does (the test above)
    assume(any(seq for doc in docs for seq in doc))
    prefix = str(tmp_path_factory.mktemp("fw") / "ds")
    with IndexedWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document([t for seq in doc for t in seq], [len(seq) for seq in doc])
    theirs = MegatronIndexed(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert theirs.index.dtype == dtype and len(theirs) == len(flat)
    assert [theirs[i].tolist() for i in range(len(flat))] == flat
    assert theirs.document_indices.tolist() == np.cumsum([0] + [len(doc) for doc in docs]).tolist()


def _corpus(tmp: Path) -> tuple[Path, list[str]]:
    texts = ["def f(x):\n    return x + 1\n", "héllo wörld ✓", "", "import os\nprint(os.sep)\n" * 3,
             "class A:\n    pass\n"]
    path = tmp / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t, "title": t[:5]}) + "\n" for t in texts))
    return path, texts


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "SentencePieceTokenizer", "ByteLevelTokenizer"])
def test_fmoe_preprocess_is_read_by_megatron_as_each_line_encoded_plus_eod(tmp_path, kind) -> None:
    path, texts = _corpus(tmp_path)
    model = None
    if kind == "HuggingFaceTokenizer":
        model = tmp_path / "tokenizer.json"
        train_bpe(texts * 20, 300, model)
    elif kind == "SentencePieceTokenizer":
        import sentencepiece as spm

        model = tmp_path / "sp.model"
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts * 20), model_prefix=str(tmp_path / "sp"),
                                       vocab_size=34, character_coverage=1.0, minloglevel=2,
                                       hard_vocab_limit=False)
    flags = ["--tokenizer-model", str(model)] if model else []
    code = main(["preprocess", "--input", str(path), "--json-keys", "text", "title", "--output-prefix",
                 str(tmp_path / "out"), "--tokenizer-type", kind, *flags, "--append-eod"])
    assert code == 0
    tok = build_tokenizer(kind, str(model) if model else None)
    for key in ("text", "title"):
        theirs = MegatronIndexed(str(tmp_path / f"out_{key}_document"))
        want = [tok.encode(t if key == "text" else t[:5]) for t in texts]
        want = [ids + [tok.eod] for ids in want if ids]  # an empty text: an empty document, no sequence
        assert [theirs[i].tolist() for i in range(len(theirs))] == want
        assert len(theirs.document_indices) == len(texts) + 1  # the empty document is still a document
        assert theirs.index.dtype == np.uint16
    assert all(theirs[i][-1] == tok.eod for i in range(len(theirs)))


def test_preprocess_output_does_not_depend_on_the_workers(tmp_path) -> None:
    path, texts = _corpus(tmp_path)
    path.write_text(path.read_text() * 40)  # 200 lines: more than one chunk per worker
    for workers in (1, 3):
        assert main(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / f"w{workers}"),
                     "--tokenizer-type", "ByteLevelTokenizer", "--append-eod", "--workers",
                     str(workers)]) == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{ext}").read_bytes() == (
            tmp_path / f"w3_text_document{ext}").read_bytes()


def test_preprocess_errors_name_the_line_and_leave_no_index(tmp_path, capsys) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    code = main(["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / "o"),
                 "--tokenizer-type", "ByteLevelTokenizer"])
    out = capsys.readouterr().out
    assert code == 2 and "line 2 has no key 'text'" in out and len(out.strip().splitlines()) == 1
    assert not (tmp_path / "o_text_document.idx").exists()


@settings(max_examples=30)
@given(weights=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=5).filter(lambda w: sum(w) > 0.1))
@example(weights=[0.3, 0.7])
@example(weights=[1.0, 0.0, 1.0])  # a zero weight takes no position
@example(weights=[1.0, 1.0, 1.0])  # ties go to the first prefix
def test_blend_table_equals_megatrons_build_blending_indices(weights) -> None:
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    size = 3000
    index = np.zeros(size, dtype=np.int16)
    sample = np.zeros(size, dtype=np.int64)
    helpers_cpp.build_blending_indices(index, sample, w, len(w), size, False)
    ours = blend_table(w.tolist(), size)
    assert ours.prefix_K.tolist() == index.tolist()
    assert ours.rank_K.tolist() == sample.tolist()


@pytest.mark.parametrize("split", ["969,30,1", "98,2", "1,1,1", "100", "0,1,0", "7,0,3"])
@pytest.mark.parametrize("n", [1, 7, 100, 12345])
def test_document_split_bounds_equal_megatrons(split: str, n: int) -> None:
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    want = [range(int(round(a * n)), int(round(b * n))) if m is not None else range(0)
            for m in matrix for (a, b) in [m or (0, 0)]]
    got = split_bounds(n, split)
    for g, w in zip(got, want):
        assert list(g) == list(w), (split, n, got, want)


def test_bad_index_files_fail_with_one_line_naming_the_file(tmp_path) -> None:
    prefix = str(tmp_path / "ds")
    with IndexedWriter(prefix, np.uint16) as w:
        w.add_document([1, 2, 3, 4], [4])
    idx = Path(prefix + ".idx")
    good = idx.read_bytes()
    cases = {b"XXXXXXXXX" + good[9:]: "not a Megatron index",
             good[:9] + (2).to_bytes(8, "little") + good[17:]: "index version 2",
             good[:17] + bytes([6]) + good[18:]: "dtype code 6",
             good[:40]: "is truncated"}
    for data, words in cases.items():
        idx.write_bytes(data)
        with pytest.raises(ValueError, match=words) as info:
            IndexedDataset(prefix)
        assert str(idx) in str(info.value) and "\n" not in str(info.value)
    idx.write_bytes(good)
    Path(prefix + ".bin").write_bytes(b"\0" * 6)  # a .bin shorter than its index says
    with pytest.raises(ValueError, match="reaches byte 8"):
        IndexedDataset(prefix)
    with pytest.raises(ValueError, match="no file .*missing.idx"):
        IndexedDataset(str(tmp_path / "missing"))
