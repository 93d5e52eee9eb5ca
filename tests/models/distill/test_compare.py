"""The whole comparison: layouts by name, and run_distill's metrics, summary and figure."""

from __future__ import annotations

import json

import numpy as np
import pytest

from models import distill as D
from models.base.layout_format import LayoutError
from models.data.calibration import CalibrationSpec
from models.families import model_shape
from models.layouts import layout as lay
from models.schedules.grammar import dtp_spec
from tests.models.distill.kit import VOCAB, layout_of, recipe
from tests.tiny import tiny_model


def test_resolve_layouts_by_name(tmp_path):
    model = tiny_model("llama")
    shape = model_shape(model.config)
    stored = lay.random(shape, 2, 1, seed=42).with_name("optimised", {"J": 4.5})
    stored.save(tmp_path / "layouts" / "optimised.json")
    stored.with_name("mine").save(tmp_path / "mine.json")
    got = D.resolve_layouts(["optimised", "contiguous", "random-5", "random:6", str(tmp_path / "mine.json")],
                            shape=shape, devices=2, delta=1, layouts_dir=tmp_path / "layouts")
    assert list(got) == ["optimised", "contiguous", "random-5", "random-6", "mine"]
    with pytest.raises(D.DistillError, match="two entries"):
        D.resolve_layouts(["random-5", "random:5"], shape=shape, devices=2, delta=1)
    assert np.array_equal(got["optimised"].neuron_device, stored.neuron_device)
    assert got["optimised"].score == {"J": 4.5}
    assert np.array_equal(got["random-5"].neuron_device, lay.random(shape, 2, 1, seed=5).neuron_device)
    with pytest.raises(LayoutError, match="it has: optimised"):
        D.resolve_layouts(["heads-only"], shape=shape, devices=2, delta=1, layouts_dir=tmp_path / "layouts")
    with pytest.raises(LayoutError, match="--from"):
        D.resolve_layouts(["optimised"], shape=shape, devices=2, delta=1)
    with pytest.raises(LayoutError, match="devices=2"):
        D.resolve_layouts(["optimised"], shape=shape, devices=4, delta=1, layouts_dir=tmp_path / "layouts")


def test_run_distill_compares_layouts_and_writes_the_summary(tmp_path):
    teacher = tiny_model("qwen2")
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, VOCAB, size=40 * 16))
    spec = D.DistillSpec(layouts=("optimised", "contiguous"), devices=2, schedule=dtp_spec(1), seeds=(0, 1),
                         recipe=recipe(steps=4),
                         train=CalibrationSpec(str(tmp_path / "ids.npy"), sequences=16, seq_len=16),
                         eval=CalibrationSpec(str(tmp_path / "ids.npy"), sequences=4, seq_len=16))
    layout_of(teacher, seed=9).with_name("optimised", {"J": 3.0}).save(tmp_path / "layouts" / "optimised.json")
    seen = []
    summary = D.run_distill(spec, teacher=teacher, tokenizer=None, out_dir=tmp_path / "out",
                            layouts_dir=tmp_path / "layouts", model_id="tiny", on_eval=seen.append)
    assert len(seen) == 2 * 2 * 3  # layouts × seeds × evaluations (0, 2, 4)
    out = tmp_path / "out"
    rows = (out / "metrics.csv").read_text().splitlines()
    assert rows[0] == "layout,seed,step,kl,ppl,loss,lr" and len(rows) == 1 + 12
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary and summary["format"] == D.SUMMARY_FORMAT
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    opt = summary["layouts"]["optimised"]
    assert opt["steps"] == [0, 2, 4] and opt["J"] == 3.0 and set(opt["seeds"]) == {"0", "1"}
    assert opt["kl"][1] == pytest.approx(np.mean([opt["seeds"][s]["kl"][1] for s in opt["seeds"]]))
    head = summary["headline"]
    assert head["reference"] == "contiguous" and len(head["multipliers"]) == 2
    assert "dense perplexity" in D.summary_table(summary)
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["contiguous", "optimised"]
    assert (out / "runs" / "optimised" / "seed-1" / "checkpoint" / "run_state.json").exists()


def test_progress_moves_through_the_reference_and_the_evaluations_not_only_the_steps(tmp_path):
    """The stage sat at 0 % through the dense reference and step 0's evaluation (90 s on SmolLM2), which
    made its ETA wild: progress counts token passes (a step: teacher forward, student forward and backward
    over its blocks = 4; an evaluation: teacher and student forward = 2; the reference: teacher = 1), told
    after every evaluation micro-batch and every step. The sequence below is that count written out by hand."""
    teacher = tiny_model("qwen2")
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, VOCAB, size=40 * 16))
    spec = D.DistillSpec(layouts=("contiguous",), devices=2, schedule=dtp_spec(1), seeds=(0,),
                         recipe=recipe(steps=4),  # evals 0, 2, 4
                         train=CalibrationSpec(str(tmp_path / "ids.npy"), sequences=16, seq_len=16),
                         eval=CalibrationSpec(str(tmp_path / "ids.npy"), sequences=4, seq_len=16))
    told: list[tuple[str, float]] = []
    D.run_distill(spec, teacher=teacher, tokenizer=None, out_dir=tmp_path / "out", model_id="tiny", plot=False,
                  progress=lambda stage, fraction: told.append((stage, fraction)))
    # 4 evaluation blocks × 16 tokens in micro-batches of 2 blocks; steps of 4 blocks × 16 tokens
    reference, evaluation, step = 1 * 64, 2 * 64, 4 * 4 * 16
    total = reference + 3 * evaluation + 4 * step
    done, expected = 0.0, []
    for kind in ["ref", "eval", "step", "step", "eval", "step", "step", "eval"]:
        if kind == "step":
            done += step
            expected.append(done)
        else:  # two micro-batches, each half of it
            for _ in range(2):
                done += (reference if kind == "ref" else evaluation) / 2
                expected.append(done)
    assert {stage for stage, _ in told} == {"distilling"}
    assert [f for _, f in told] == pytest.approx([d / total for d in expected])
    assert told[1][1] > 0 and told[-1][1] == pytest.approx(1.0)  # before any optimiser step: no longer 0
