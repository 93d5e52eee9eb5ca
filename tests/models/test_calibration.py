"""Data specs: text, jsonl and npy sources packed into blocks, with clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models.data.calibration import CalibrationSpec, DataError, load_blocks


class CharTokenizer:
    """One token per byte: enough to check packing without a real vocabulary."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [b + 1 for b in text.encode("utf-8")]}


def test_text_file_packs_blocks_in_order(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("abcdefghijklmnopqrstuvwxyz")
    blocks = load_blocks(CalibrationSpec(str(path), sequences=3, seq_len=4, seed=0), CharTokenizer())
    assert blocks.shape == (3, 4)
    stream = [ord(c) + 1 for c in "abcdefghijkl"]
    assert sorted(blocks.tolist()) == sorted([stream[0:4], stream[4:8], stream[8:12]])


def test_seed_changes_order_not_content(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x" * 10 + "y" * 10 + "z" * 10 + "w" * 10)
    a = load_blocks(CalibrationSpec(str(path), sequences=4, seq_len=10, seed=1), CharTokenizer())
    b = load_blocks(CalibrationSpec(str(path), sequences=4, seq_len=10, seed=2), CharTokenizer())
    assert sorted(a.tolist()) == sorted(b.tolist())


def test_directory_and_jsonl_sources_join_documents_with_eos(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.txt").write_text("ab")
    (tmp_path / "d" / "2.txt").write_text("cd")
    blocks = load_blocks(CalibrationSpec(str(tmp_path / "d"), sequences=1, seq_len=5), CharTokenizer())
    assert blocks[0].tolist() == [ord("a") + 1, ord("b") + 1, 0, ord("c") + 1, ord("d") + 1]
    jl = tmp_path / "x.jsonl"
    jl.write_text("\n".join(json.dumps({"body": t}) for t in ["ab", "cd"]))
    blocks = load_blocks(CalibrationSpec(str(jl), sequences=1, seq_len=5, text_field="body"), CharTokenizer())
    assert blocks[0].tolist() == [ord("a") + 1, ord("b") + 1, 0, ord("c") + 1, ord("d") + 1]


def test_jsonl_missing_field_is_named(tmp_path):
    jl = tmp_path / "x.jsonl"
    jl.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"other": 1}) + "\n")
    with pytest.raises(DataError, match=r"x.jsonl:2: field 'text'"):
        load_blocks(CalibrationSpec(str(jl), sequences=1, seq_len=50), CharTokenizer())


def test_npy_stream_and_blocks(tmp_path):
    np.save(tmp_path / "s.npy", np.arange(20, dtype=np.int32))
    blocks = load_blocks(CalibrationSpec(str(tmp_path / "s.npy"), sequences=2, seq_len=10), vocab_size=20)
    assert sorted(blocks.tolist()) == [list(range(10)), list(range(10, 20))]
    np.save(tmp_path / "b.npy", np.arange(24).reshape(3, 8))
    blocks = load_blocks(CalibrationSpec(str(tmp_path / "b.npy"), sequences=3, seq_len=6, seed=0))
    assert sorted(blocks.tolist()) == [[0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13], [16, 17, 18, 19, 20, 21]]


@pytest.mark.parametrize(
    ("setup", "spec_kwargs", "vocab", "message"),
    [
        ("short", dict(sequences=5, seq_len=10), None, r"has 20 tokens: 2 blocks .* but 5 are needed"),
        ("vocab", dict(sequences=1, seq_len=10), 5, r"token ids must be in \[0, 4\]"),
        ("float", dict(sequences=1, seq_len=10), None, "must be integers"),
        ("missing", dict(sequences=1, seq_len=10), None, "no such"),
    ],
)
def test_npy_errors(tmp_path, setup, spec_kwargs, vocab, message):
    path = tmp_path / "t.npy"
    if setup in ("short", "vocab"):
        np.save(path, np.arange(20))
    elif setup == "float":
        np.save(path, np.zeros(20, dtype=np.float32))
    with pytest.raises(DataError, match=message):
        load_blocks(CalibrationSpec(str(path), **spec_kwargs), vocab_size=vocab)


def test_text_without_tokenizer_and_bad_spec(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello")
    with pytest.raises(DataError, match="no tokenizer"):
        load_blocks(CalibrationSpec(str(path), sequences=1, seq_len=2), None)
    with pytest.raises(DataError, match="sequences"):
        CalibrationSpec(str(path), sequences=0)
    with pytest.raises(DataError, match="no such file"):
        load_blocks(CalibrationSpec(str(tmp_path / "nope.txt"), sequences=1, seq_len=2), CharTokenizer())


def test_corpus_source_reads_real_text():
    blocks = load_blocks(CalibrationSpec("corpus:shakespeare", sequences=2, seq_len=64), CharTokenizer())
    assert blocks.shape == (2, 64)
    assert int(blocks.max()) < 256
