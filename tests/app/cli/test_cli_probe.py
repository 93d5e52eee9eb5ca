"""`dtp-layout optimise --probe K` on a tiny random checkpoint: the probing stage between optimising and the
export, its cost said before it trains, its pick exported and reported with every candidate's curve, and a rerun
that skips it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.cli.main import main
from models.export.serving_manifest import _layout_sha256
from models.layouts.layout import load
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen2").save_pretrained(path)
    return path


def test_optimise_with_a_probe_exports_its_pick_and_reports_the_curves(checkpoint, tmp_path, capsys):
    calib = tmp_path / "ids.npy"
    np.save(calib, np.random.default_rng(0).integers(0, 97, size=12 * 32))  # 6 calibration + 2 held-out blocks
    out = tmp_path / "run"
    argv = ["optimise", str(checkpoint), "--devices", "2", "--delta", "2", "--calib", str(calib),
            "--calib-sequences", "6", "--calib-seq-len", "32", "--restarts", "1", "--probe", "3", "--probe-steps",
            "2", "--probe-eval-sequences", "2", "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    # the cost, before any candidate trains: tokens at the plan, then the measured step and the estimate
    assert "probe: 3 candidates × 2 steps × 4 × 32 tokens = 768 training tokens" in captured.err
    assert "one step measured at" in captured.err and "probe_max_seconds=3600" in captured.err
    report = json.loads((out / "report.json").read_text())
    probe = report["probe"]
    assert list(probe["candidates"]) == ["optimised", "dtp1-optimised", "mix-0.5"]
    finals = {name: row["final_kl"] for name, row in probe["candidates"].items()}
    assert report["chosen_layout"] == probe["chosen"] == min(finals, key=finals.get)
    for row in probe["candidates"].values():
        assert row["steps"] == [0, 1, 2] and len(row["kl"]) == 3 and row["J"] is not None
    assert probe["data"]["held_out"] and probe["eval"]["skip_blocks"] == 6
    assert f"chosen {probe['chosen']}" in captured.out
    # the shards are the pick's: their manifest names it and the hash of its layout file
    chosen = load(out / "probe" / "candidates" / f"{probe['chosen']}.json")
    provenance = json.loads((out / "shards" / "manifest.json").read_text())["serving"]["provenance"]
    assert provenance["layout"] == probe["chosen"]
    assert provenance["layout_sha256"] == _layout_sha256(chosen)
    # a rerun skips the finished probe and reports the same pick
    assert main(argv) == 0
    again = capsys.readouterr()
    assert "probing: done by an earlier run" in again.err
    assert json.loads((out / "report.json").read_text())["probe"]["chosen"] == probe["chosen"]
