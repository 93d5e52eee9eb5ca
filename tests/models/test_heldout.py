"""Held out means held out: decided on what the specs resolve to (content, token ranges), not their spelling."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from models import distill as D
from models.data import heldout
from models.data.calibration import CalibrationSpec
from models.schedules.grammar import dtp_spec
from tests.tiny import tiny_model


def _text(tmp_path, name="a.txt", words=3000):
    path = tmp_path / name
    path.write_text(" ".join(f"w{i}" for i in range(words)))
    return path


def test_identity_is_the_content_not_the_spelling(tmp_path, monkeypatch):
    a = _text(tmp_path)
    (tmp_path / "copy").mkdir()
    b = shutil.copy(a, tmp_path / "copy" / "b.txt")
    monkeypatch.chdir(tmp_path)
    ids = {heldout.source_identity(s) for s in (str(a), "a.txt", "./copy/../a.txt", str(b))}
    assert len(ids) == 1
    (tmp_path / "c.txt").write_text("other text")
    assert heldout.source_identity("c.txt") not in ids
    # hf sources: the defaults spelt out (config none, split train) are the same dataset
    assert heldout.source_identity("hf:o/d") == heldout.source_identity("hf:o/d::train")
    assert heldout.source_identity("hf:o/d::test") != heldout.source_identity("hf:o/d")


def test_corpus_name_and_its_file_are_one_text(tmp_path, monkeypatch):
    monkeypatch.setenv("DTP_LAYOUT_CORPUS_DIR", str(tmp_path))
    shakespeare = _text(tmp_path, "shakespeare.txt")
    assert heldout.source_identity("corpus:shakespeare") == heldout.source_identity(str(shakespeare))


def test_training_skips_calibration_and_evaluation_skips_both(tmp_path):
    a = str(_text(tmp_path))
    cal = CalibrationSpec(a, sequences=4, seq_len=32)  # tokens [0, 128)
    train = CalibrationSpec(str(tmp_path / "." / "a.txt"), sequences=5, seq_len=16)  # same file, other spelling
    ev = CalibrationSpec(a, sequences=2, seq_len=64)
    placed = heldout.place(train, ev, calibration=cal)
    assert placed.train.skip_blocks == 8  # 128 tokens / 16
    assert placed.eval.skip_blocks == 4  # after training: (8 + 5) · 16 = 208 tokens → ⌈208/64⌉
    assert placed.overlaps == () and placed.as_dict()["held_out"]
    assert [m["part"] for m in placed.moved] == ["train", "eval"]
    spans = {p.name: p.span for p in placed.parts}
    assert spans == {"calibration": (0, 128), "train": (128, 208), "eval": (256, 384)}


def test_user_forced_overlap_is_kept_and_reported(tmp_path):
    a = str(_text(tmp_path))
    cal = CalibrationSpec(a, sequences=4, seq_len=32)
    train = CalibrationSpec(a, sequences=5, seq_len=16, skip_blocks=2)  # [32, 112)
    ev = CalibrationSpec(a, sequences=1, seq_len=64)  # [0, 64)
    placed = heldout.place(train, ev, calibration=cal, allow_overlap=True)
    assert (placed.train, placed.eval) == (train, ev)
    got = {tuple(o["parts"]): o["overlap"] for o in placed.overlaps}
    assert got == {("calibration", "train"): 80, ("calibration", "eval"): 64, ("train", "eval"): 32}
    assert not placed.as_dict()["held_out"]
    assert any("share 32 tokens" in line for line in heldout.describe_dict(placed.as_dict()))


def test_different_texts_are_left_alone(tmp_path):
    a, b = str(_text(tmp_path, "a.txt")), str(_text(tmp_path, "b.txt", words=10))
    cal = CalibrationSpec(a, sequences=4, seq_len=32)
    placed = heldout.place(CalibrationSpec(b, sequences=2, seq_len=8), CalibrationSpec(a, sequences=1, seq_len=8),
                           calibration=cal, calibration_identity="sha256:recorded-elsewhere")
    assert placed.train.skip_blocks == 0 and placed.eval.skip_blocks == 0 and not placed.moved


def test_two_dimensional_npy_counts_rows(tmp_path):
    np.save(tmp_path / "blocks.npy", np.arange(20 * 32).reshape(20, 32))
    src = str(tmp_path / "blocks.npy")
    placed = heldout.place(CalibrationSpec(src, sequences=3, seq_len=16), CalibrationSpec(src, sequences=2, seq_len=32),
                           calibration=CalibrationSpec(src, sequences=4, seq_len=32))
    assert (placed.train.skip_blocks, placed.eval.skip_blocks) == (4, 7)  # rows, whatever the seq_len


def test_distill_reads_held_out_blocks_and_reports_them(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(60 * 8))  # token i at position i
    ids = str(tmp_path / "ids.npy")
    spec = D.DistillSpec(layouts=("contiguous",), devices=2, schedule=dtp_spec(1),
                         calibration=CalibrationSpec(ids, sequences=5, seq_len=8),
                         train=CalibrationSpec(ids, sequences=10, seq_len=8),
                         eval=CalibrationSpec(ids, sequences=2, seq_len=16))
    train, evaluation = D.load_data(spec, tokenizer=None, vocab_size=1000)
    assert int(train.min()) == 40 and int(train.max()) == 119  # after the 5 calibration blocks of 8
    assert int(evaluation.min()) >= 120
    forced = D.DistillSpec(**{**spec.__dict__, "allow_overlap": True})
    train_forced, _ = D.load_data(forced, tokenizer=None, vocab_size=1000)
    assert int(train_forced.min()) == 0
    assert D.place_data(forced).overlaps[0]["parts"] == ["calibration", "train"]


@pytest.mark.parametrize("allow", [False, True])
def test_summary_json_records_the_placement(tmp_path, allow):
    model = tiny_model()
    vocab = model.config.vocab_size
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, vocab, 40 * 8))
    ids = str(tmp_path / "ids.npy")
    recipe = D.DistillRecipe(steps=1, batch_size=2, micro_batch_size=2, eval_every=1, eval_batch_size=2,
                             warmup_steps=0, logit_chunk=16)
    spec = D.DistillSpec(layouts=("contiguous",), devices=2, schedule=dtp_spec(1), recipe=recipe, allow_overlap=allow,
                         calibration=CalibrationSpec(ids, sequences=4, seq_len=8),
                         train=CalibrationSpec(ids, sequences=2, seq_len=8),
                         eval=CalibrationSpec(ids, sequences=2, seq_len=8))
    summary = D.run_distill(spec, teacher=model, tokenizer=None, out_dir=tmp_path / "out", plot=False)
    data = summary["data"]
    assert data["allow_overlap"] is allow and data["held_out"] is not allow
    assert summary["train"]["skip_blocks"] == (0 if allow else 4)
    assert summary["eval"]["skip_blocks"] == (0 if allow else 6)
