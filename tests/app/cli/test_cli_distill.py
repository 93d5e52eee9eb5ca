"""`dtp-layout distill` on a tiny random checkpoint and an `optimise`-style output directory."""

from __future__ import annotations

import csv
import io
import json
import sys

import numpy as np
import pytest

from app.cli.main import main
from models.families import model_shape
from models.layouts import layout as lay
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    model = tiny_model("llama")
    model.save_pretrained(root / "model")
    shape = model_shape(model.config)
    layouts = root / "opt" / "layouts"
    lay.random(shape, 2, 1, seed=11).with_name("optimised", {"J": 4.2}).save(layouts / "optimised.json")
    lay.contiguous(shape, 2, 1).save(layouts / "contiguous.json")
    rng = np.random.default_rng(0)
    np.save(root / "train.npy", rng.integers(0, 97, size=40 * 16))
    np.save(root / "eval.npy", rng.integers(0, 97, size=4 * 16))
    return root


def distill_args(root, out, *extra):
    return ["distill", str(root / "model"), "--layouts", "optimised,contiguous,random-5", "--from", str(root / "opt"),
            "--devices", "2", "--delta", "1", "--data", str(root / "train.npy"), "--eval-data", str(root / "eval.npy"),
            "--seq-len", "16", "--eval-blocks", "4", "--steps", "4", "--batch-size", "4", "--micro-batch-size", "2",
            "--warmup", "1", "--lr", "1e-3", "--min-lr", "1e-4", "--eval-every", "2", "--checkpoint-every", "1",
            "--logit-chunk", "16", "--device", "cpu", "--out", str(out), *extra]


def test_distill_writes_metrics_summary_and_plot_then_resumes(workdir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(distill_args(workdir, out)) == 0
    printed = capsys.readouterr()
    assert "KL@4" in printed.out
    said = json.loads((out / "summary.json").read_text())["headline"]["said"]  # the rule's per-seed speedup
    assert said.startswith(("optimised ", "contiguous is at")) and said in printed.out
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["layout", "seed", "step", "kl", "ppl", "loss", "lr"]
    assert len(rows) == 3 * 3  # three layouts, evaluations at steps 0, 2, 4
    assert {r["layout"] for r in rows} == {"optimised", "contiguous", "random-5"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layouts"]["optimised"]["J"] == 4.2 and summary["devices"] == 2
    assert summary["recipe"]["lr"] == 1e-3 and summary["recipe"]["betas"] == [0.9, 0.95]
    assert summary["headline"]["reference"] == "contiguous"
    assert (out / "curves.png").stat().st_size > 1000

    # Same command again: every run is complete, nothing trains, the same summary comes out.
    assert main(distill_args(workdir, out)) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["layouts"] == summary["layouts"]
    # --overwrite starts over; a changed recipe over old runs is refused with a message.
    assert main(distill_args(workdir, out, "--lr", "5e-4")) == 2
    assert "different configuration" in capsys.readouterr().err
    assert main(distill_args(workdir, out, "--lr", "5e-4", "--overwrite", "--layouts", "contiguous",
                             "--seeds", "0,1")) == 0
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["layout"], r["seed"]) for r in rows} == {("contiguous", "0"), ("contiguous", "1")}


def test_distill_user_errors_exit_2(workdir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(distill_args(workdir, out, "--layouts", "optimised,heads-only")) == 2
    err = capsys.readouterr().err
    assert "heads-only" in err and "it has: contiguous, optimised" in err
    assert main(distill_args(workdir, out, "--from", str(tmp_path))) == 2
    assert "no layouts/ directory" in capsys.readouterr().err
    assert main(distill_args(workdir, out, "--batch-size", "3")) == 2
    assert "multiple of micro_batch_size" in capsys.readouterr().err
    assert main(distill_args(workdir, out, "--devices", "3")) == 2
    assert "does not divide" in capsys.readouterr().err
    assert main(distill_args(workdir, out, "--seeds", "a")) == 2
    assert not (out / "runs").exists()


def test_progress_bar_shows_step_loss_eval_kl_and_eta(monkeypatch):
    from app.cli.commands.distill import _Bars
    from models.distill import EvalRecord, StepStats
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    bars = _Bars(10)
    bars.start("optimised", 0)
    last = EvalRecord("optimised", 0, 4, 1.25, 100.0, 2.0, 1e-4, 0, 0.0)
    for step in range(4, 7):  # resumed at step 4
        bars.step("optimised", 0, StepStats(step=step, loss=1.5, kl=1.2, ce=3.0, grad_norm=1.0, lr=1e-4), last)
    bars.close()
    line = err.getvalue().split("\r")[-1]
    assert "optimised seed 0" in line and "7/10" in line and "loss=1.5000" in line and "eval KL=1.2500@4" in line
    assert "<" in line  # tqdm's elapsed<remaining


def test_distill_and_eval_hold_out_the_calibration_blocks_of_from(workdir, tmp_path, capsys):
    """--from's report.json names its calibration: on the same text (here a copy under another name),
    training starts after those blocks and evaluation after both; --allow-overlap keeps the specs and
    reports the overlap. `eval --from` holds the calibration blocks out the same way."""
    import shutil

    opt = tmp_path / "opt"
    shutil.copytree(workdir / "opt", opt)
    shutil.copy(workdir / "train.npy", tmp_path / "calib-copy.npy")
    (opt / "report.json").write_text(json.dumps({"calibration": {
        "source": str(tmp_path / "calib-copy.npy"), "sequences": 8, "seq_len": 16, "seed": 0, "text_field": "text",
        "skip_blocks": 0}}))
    base = ["distill", str(workdir / "model"), "--layouts", "contiguous", "--from", str(opt), "--devices", "2",
            "--data", str(workdir / "train.npy"), "--eval-data", str(workdir / "train.npy"), "--seq-len", "16",
            "--eval-blocks", "2", "--steps", "1", "--batch-size", "4", "--micro-batch-size", "4", "--warmup", "0",
            "--eval-every", "1", "--logit-chunk", "16", "--device", "cpu"]
    assert main([*base, "--out", str(tmp_path / "held")]) == 0
    assert "data: train: skip_blocks 0 → 8" in capsys.readouterr().out
    summary = json.loads((tmp_path / "held" / "summary.json").read_text())
    assert (summary["train"]["skip_blocks"], summary["eval"]["skip_blocks"]) == (8, 12)
    assert summary["data"]["held_out"] and summary["data"]["parts"]["calibration"]["end"] == 128

    assert main([*base, "--allow-overlap", "--out", str(tmp_path / "forced")]) == 0
    assert "overlap (allowed): calibration and train share 64 tokens" in capsys.readouterr().out
    forced = json.loads((tmp_path / "forced" / "summary.json").read_text())
    assert forced["train"]["skip_blocks"] == 0 and not forced["data"]["held_out"]
    assert {tuple(o["parts"]) for o in forced["data"]["overlaps"]} == {
        ("calibration", "train"), ("calibration", "eval"), ("train", "eval")}

    assert main(["eval", str(workdir / "model"), "--from", str(opt), "--layout", "contiguous", "--devices", "2",
                 "--data", str(workdir / "train.npy"), "--blocks", "2", "--seq-len", "16", "--device", "cpu",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["data"]["parts"]["eval"]["skip_blocks"] == 8 and result["data"]["held_out"]
