"""bench/schedule_gpu_short.py: the files the GPU short run carries, made here, and the run on them alone.

On a tiny model and one token stream shared by calibration, training and evaluation, so that the held-out
placement shows: calibration blocks first, training after them, evaluation after both
(models.data.heldout); the second domain is its own file.
"""

from __future__ import annotations

import json

import numpy as np

from bench import schedule_experiment as exp
from bench import schedule_gpu_short as gs
from tests.tiny import tiny_model

SMALL = ["--devices", "2", "--steps", "2", "--batch-size", "1", "--seq-len", "32", "--eval-every", "1",
         "--eval-blocks", "2", "--eval2-blocks", "2", "--calib-sequences", "2", "--calib-seq-len", "32",
         "--restarts", "0"]


def test_prepare_writes_the_placed_tokens_and_layouts_and_the_run_reads_only_them(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    text = np.random.default_rng(0).integers(0, 97, size=16 * 32)
    np.save(tmp_path / "text.npy", text)
    np.save(tmp_path / "other.npy", np.random.default_rng(1).integers(0, 97, size=4 * 32))
    out = tmp_path / "gpu-short"
    sources = ["--calib", str(tmp_path / "text.npy"), "--train", str(tmp_path / "text.npy"),
               "--eval", str(tmp_path / "text.npy"), "--eval2", str(tmp_path / "other.npy")]
    made = gs.main(["prepare", "--out", str(out), "--model", str(model_dir), *SMALL, *sources])
    assert made["layouts"] == ["contiguous.json", "optimised.json", "random-1000.json"] and made["parts"] == []
    data = {name: np.load(out / "data" / f"{name}.npy") for name in gs.DATA_FILES}
    assert all(a.dtype == np.uint16 for a in data.values())
    # calibration: tokens 0-63; training (2 steps × 1 × 32) after it: 64-127; evaluation (2 × 32) after both
    assert data["calib"].tolist() == text[:64].tolist()
    assert data["train"].tolist() == text[64:128].tolist()
    assert data["eval"].tolist() == text[128:192].tolist()
    assert data["eval2"].tolist() == np.load(tmp_path / "other.npy")[:64].tolist()

    layouts = out / "work" / "layouts" / "dtp-1"
    before = {p.name: p.stat().st_mtime_ns for p in layouts.glob("*.json")}
    runs = tmp_path / "runs"
    row = exp.main([*gs.experiment_flags(out), "--model", str(model_dir), *SMALL, "--runs-dir", str(runs)])["dtp:1"]
    assert {p.name: p.stat().st_mtime_ns for p in layouts.glob("*.json")} == before  # carried, not rebuilt
    assert {arm: len(v) for arm, v in row["final_kl"].items()} == {"optimised": 3, "contiguous": 3, "random-1000": 3}
    saved = json.loads((runs / "dtp-1-2steps.json").read_text())
    assert saved["setup"]["preset"] == "gpu-short" and saved["setup"]["train"].endswith("train.npy")
    assert len(saved["runs"]) == 9 and all(len(r["primary"]) == 3 for r in saved["runs"])  # steps 0, 1, 2


def test_the_model_is_split_in_parts_a_call_can_carry_and_cat_joins_them(tmp_path, monkeypatch):
    monkeypatch.setattr(gs, "PART_BYTES", 1000)
    model = tmp_path / "m.gguf"
    model.write_bytes(bytes(range(256)) * 10)  # 2,560 bytes: parts of 1,000, 1,000 and 560
    parts = gs.split(model, tmp_path)
    assert [p.stat().st_size for p in parts] == [1000, 1000, 560]
    assert b"".join(p.read_bytes() for p in parts) == model.read_bytes()
