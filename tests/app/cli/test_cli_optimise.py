"""`dtp-layout optimise` and `dtp-layout layout` on a tiny random checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from app.cli.main import main
from models.affinity import AffinityResult
from models.layouts.layout import load
from models.layouts.set import affinity_for
from models.optimise import is_block_optimal
from tests.tiny import tiny_model, tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen2").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "ids.npy"
    np.save(path, np.random.default_rng(0).integers(0, 97, size=6 * 32))
    return path


def test_optimise_writes_everything(checkpoint, calib, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["optimise", str(checkpoint), "--devices", "2", "--delta", "1", "--calib", str(calib),
                 "--calib-sequences", "6", "--calib-seq-len", "32", "--random", "3", "--ablations",
                 "--out", str(out), "--device", "cpu", "--batch-size", "4"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "random expectation" in printed and "anti-optimised" in printed
    names = {p.stem for p in (out / "layouts").glob("*.json")}
    # The paper's seven spread layouts, and (restarts 4 by default) the equal-restarts reference.
    assert names == {"optimised", "contiguous", "random-1000", "random-1001", "random-1002", "anti-optimised",
                     "heads-only", "neurons-only", "add-score", "4-layers", "8-layers", "12-layers",
                     "optimised-restarts-0"}
    report = json.loads((out / "report.json").read_text())
    assert report["restarts"] == 4 and report["paper_procedure"] is False
    assert any("paper" in note and "restarts=0" in note for note in report["notes"])
    assert report["layouts"]["neurons-only"]["restarts"] == report["layouts"]["optimised-restarts-0"]["restarts"] == 0
    scores = {k: v["J"] for k, v in report["layouts"].items()}
    assert scores["optimised"] >= max(v for k, v in scores.items() if k != "optimised") - 1e-12
    assert scores["anti-optimised"] <= min(scores.values()) + 1e-12
    assert report["random_expectation"] == pytest.approx((2 * 3 - 1) / 2)
    assert report["tokens"] == 6 * 32 and report["devices"] == 2 and report["delta"] == 1
    assert {"torch", "transformers", "dtp-layout"} <= set(report["versions"])
    for rep in report["layouts"].values():
        assert len(rep["up_fraction"]) == 3 and len(rep["down_fraction"]) == 2
        assert rep["J"] == pytest.approx(sum(rep["up_fraction"]) + sum(rep["down_fraction"]))
    # The exported checkpoint is the optimised layout's permutation and keeps the dense logits.
    best = load(out / "layouts" / "optimised.json")
    assert json.loads((out / "checkpoint" / "dtp_layout.json").read_text())["neuron_device"] == (
        best.neuron_device.tolist())
    dense = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    permuted = AutoModelForCausalLM.from_pretrained(out / "checkpoint").eval()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(permuted(ids).logits, dense(ids).logits, atol=1e-4, rtol=0)
    affinity = affinity_for(AffinityResult.load(out / "affinity.safetensors"), "fo")
    assert is_block_optimal(affinity, best.kv_group_device, best.neuron_device, devices=2)


def test_delta_above_one_is_noted_and_no_export(checkpoint, calib, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["optimise", str(checkpoint), "--devices", "2", "--delta", "2", "--calib", str(calib),
                 "--calib-sequences", "2", "--calib-seq-len", "32", "--no-export", "--out", str(out),
                 "--device", "cpu"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert any("δ=1" in note for note in report["notes"])
    assert not (out / "checkpoint").exists() and not (out / "shards").exists()
    assert "export" not in report["seconds"]


def test_layout_command_variants(checkpoint, calib, tmp_path, capsys):
    out = tmp_path / "run"
    main(["optimise", str(checkpoint), "--devices", "2", "--calib", str(calib), "--calib-sequences", "2",
          "--calib-seq-len", "32", "--no-export", "--out", str(out), "--device", "cpu"])
    aff = str(out / "affinity.safetensors")
    assert main(["layout", "--affinity", aff, "--devices", "2", "--out", str(tmp_path / "o.json")]) == 0
    assert main(["layout", "--affinity", aff, "--devices", "2", "--minimise", "--name", "anti",
                 "--out", str(tmp_path / "a.json")]) == 0
    assert main(["layout", "--affinity", aff, "--devices", "2", "--neurons-only", "--layers", "0,2",
                 "--out", str(tmp_path / "n.json")]) == 0
    best, anti, part = load(tmp_path / "o.json"), load(tmp_path / "a.json"), load(tmp_path / "n.json")
    assert best.score["J"] > anti.score["J"] and anti.name == "anti"
    contiguous_heads = np.repeat(np.arange(2), 2)
    assert (part.kv_group_device == contiguous_heads).all()
    assert (part.neuron_device[1] == np.repeat(np.arange(2), 48)).all()  # layer 1 not in the subset
    # Errors name the problem.
    assert main(["layout", "--affinity", aff, "--devices", "3", "--out", str(tmp_path / "x.json")]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert main(["layout", "--affinity", str(tmp_path / "o.json"), "--devices", "2",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "affinity" in capsys.readouterr().err


def test_optimise_refuses_bad_devices_before_loading(checkpoint, calib, tmp_path, capsys):
    assert main(["optimise", str(checkpoint), "--devices", "3", "--calib", str(calib), "--out",
                 str(tmp_path / "r"), "--device", "cpu"]) == 2
    assert "valid L for this model: 1, 2, 4" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
