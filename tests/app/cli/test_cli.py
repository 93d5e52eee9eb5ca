"""The CLI end to end on a tiny random checkpoint saved to disk."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from app.cli.main import main
from models.export.files import load_rank_shards
from tests.tiny import tiny_model, tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen3").save_pretrained(path)
    return path


def test_export_writes_checkpoint_and_shards(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["export", str(checkpoint), "--layout", "random:3", "--devices", "2", "--delta", "1",
                 "--out", str(out), "--device", "cpu"])
    assert code == 0
    assert "rank shards" in capsys.readouterr().out
    dense = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    permuted = AutoModelForCausalLM.from_pretrained(out / "checkpoint").eval()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(permuted(ids).logits, dense(ids).logits, atol=1e-4, rtol=0)
    _, layout = load_rank_shards(out / "shards")
    assert layout.name == "random-3" and layout.devices == 2
    # Exporting again without --overwrite is a user error, not a traceback.
    assert main(["export", str(checkpoint), "--devices", "2", "--out", str(out), "--device", "cpu"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_export_makes_the_shards_for_a_schedule(checkpoint, tmp_path, capsys):
    """--schedule goes into the manifest (canonical; without it, the layout's dtp:δ); a dtp schedule gives the
    layout its δ; a schedule that does not fit the model is refused before the weights load."""
    out = tmp_path / "out"
    assert main(["export", str(checkpoint), "--devices", "2", "--schedule", "spd:2,0", "--out", str(out),
                 "--device", "cpu"]) == 0
    assert "made for schedule spd:0,2" in capsys.readouterr().out
    manifest = json.loads((out / "shards" / "manifest.json").read_text())
    assert (manifest["schedule"], manifest["delta"]) == ("spd:0,2", 1)
    assert main(["export", str(checkpoint), "--devices", "2", "--schedule", "dtp:2", "--out", str(tmp_path / "d2"),
                 "--device", "cpu"]) == 0
    manifest = json.loads((tmp_path / "d2" / "shards" / "manifest.json").read_text())
    assert (manifest["schedule"], manifest["delta"], manifest["layout"]["delta"]) == ("dtp:2", 2, 2)
    capsys.readouterr()
    for argv, message in ((["--schedule", "pt:4"], "D must be in 1 .. 3"),
                          (["--schedule", "dtp:2", "--delta", "1"], "disagree")):
        assert main(["export", str(checkpoint), "--devices", "2", *argv, "--out", str(tmp_path / "x"),
                     "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert message in err and "loading " not in err


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bf16") / "model"
    tiny_model("qwen3").to(torch.bfloat16).save_pretrained(path)
    return path


def test_export_keeps_the_source_dtype_unless_told(bf16_checkpoint, tmp_path):
    """A bf16 checkpoint computed in fp32 exports bf16 (not twice its size); --export-dtype overrides it,
    and the manifest records both dtypes."""
    from safetensors.torch import load_file

    source = load_file(str(bf16_checkpoint / "model.safetensors"))
    sizes = {}
    for flag, stored in ((None, torch.bfloat16), ("float32", torch.float32)):
        out = tmp_path / (flag or "auto")
        extra = ["--export-dtype", flag] if flag else []
        assert main(["export", str(bf16_checkpoint), "--devices", "2", "--out", str(out), "--device", "cpu",
                     "--dtype", "float32", *extra]) == 0
        manifest = json.loads((out / "shards" / "manifest.json").read_text())
        assert manifest["dtype"] == str(stored).removeprefix("torch.") and manifest["compute_dtype"] == "float32"
        ckpt = load_file(str(out / "checkpoint" / "model.safetensors"))
        assert {t.dtype for t in ckpt.values()} == {stored}
        assert json.loads((out / "checkpoint" / "config.json").read_text())["dtype"] == manifest["dtype"]
        shard = load_file(str(out / "shards" / manifest["files"][0]["name"]))
        assert {t.dtype for t in shard.values()} == {stored}
        # not permuted by a layout: the embedding comes back exactly (bf16 → fp32 → bf16 is lossless)
        assert torch.equal(ckpt["model.embed_tokens.weight"].to(torch.bfloat16), source["model.embed_tokens.weight"])
        sizes[flag] = (out / "checkpoint" / "model.safetensors").stat().st_size
    assert sizes[None] < 0.6 * sizes["float32"]


def test_optimise_report_records_export_dtypes(bf16_checkpoint, tmp_path):
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 97, size=4 * 16))
    out = tmp_path / "run"
    assert main(["optimise", str(bf16_checkpoint), "--devices", "2", "--calib", str(tmp_path / "ids.npy"),
                 "--calib-sequences", "4", "--calib-seq-len", "16", "--restarts", "0", "--out", str(out),
                 "--device", "cpu"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["export"] == {"dtype": "bfloat16", "compute_dtype": "float32"}
    assert report["calibration_identity"].startswith("sha256:")


def test_eval_on_npy_tokens_prints_json(checkpoint, tmp_path, capsys):
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 97, size=4 * 16))
    code = main(["eval", str(checkpoint), "--devices", "2", "--delta", "1", "--data", str(tmp_path / "ids.npy"),
                 "--blocks", "4", "--seq-len", "16", "--json", "--device", "cpu"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["blocks"] == 4 and result["tokens"] == 64 and result["layout"] == "contiguous"
    assert result["kl"] > 0 and result["dense_ppl"] > 1 and result["dtp_ppl"] > 1
    # δ=0 is the dense model: no KL, same perplexity.
    main(["eval", str(checkpoint), "--devices", "2", "--delta", "0", "--data", str(tmp_path / "ids.npy"),
          "--blocks", "4", "--seq-len", "16", "--json", "--device", "cpu"])
    zero = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert zero["kl"] == pytest.approx(0.0, abs=1e-6)
    assert zero["dtp_ppl"] == pytest.approx(zero["dense_ppl"], rel=1e-5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "3"], "does not divide num_kv_groups=4"),
        (["--devices", "2", "--delta", "9"], "delta must be an integer in"),
        (["--devices", "2", "--layout", "random:x"], "random:SEED"),
        (["--devices", "2", "--layout", "nope.json"], "expected 'contiguous'"),
        (["--devices", "2", "--layout", "optimised"], "--from DIR"),
        (["--devices", "2", "--from", "/nonexistent/run"], "no layouts/ directory"),
    ],
)
def test_eval_user_errors(checkpoint, tmp_path, capsys, argv, message):
    np.save(tmp_path / "ids.npy", np.arange(64) % 97)
    code = main(["eval", str(checkpoint), "--data", str(tmp_path / "ids.npy"), "--blocks", "2",
                 "--seq-len", "16", "--device", "cpu", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_eval_reads_a_layout_by_name_from_an_optimise_output(checkpoint, tmp_path, capsys):
    from models.families import model_shape
    from models.layouts.layout import random

    shape = model_shape(AutoModelForCausalLM.from_pretrained(checkpoint).config)
    random(shape, 2, 1, seed=4).with_name("optimised", {"J": 1.0}).save(tmp_path / "opt" / "layouts" / "optimised.json")
    np.save(tmp_path / "ids.npy", np.arange(64) % 97)
    args = ["eval", str(checkpoint), "--devices", "2", "--data", str(tmp_path / "ids.npy"), "--blocks", "2",
            "--seq-len", "16", "--json", "--device", "cpu"]
    assert main([*args, "--layout", "optimised", "--from", str(tmp_path / "opt")]) == 0
    stored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--layout", "random-4"]) == 0  # what the stored layout holds, built from its seed
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stored["layout"] == "optimised" and built["layout"] == "random-4"
    assert stored["kl"] == pytest.approx(built["kl"], rel=1e-6)


def test_unsupported_and_missing_models(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "missing"), "--devices", "2", "--data", "corpus:shakespeare"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["eval", "not a hub id!", "--devices", "2", "--data", "corpus:shakespeare"]) == 2
    assert "hub id" in capsys.readouterr().err


def test_help_does_not_import_torch():
    """--help reads the score, dtype and layout names from dependency-free modules: no torch, no numpy."""
    code = ("import sys; from app.cli.main import build_parser; build_parser(); "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
