"""One run: the KL falls, logs and checkpoints, resume after a kill or SIGKILL, cancellation."""

from __future__ import annotations

import json

import pytest
import torch

from models import distill as D
from models.base.progress import Cancelled
from tests.models.distill.kit import recipe, run


def test_a_few_steps_reduce_the_kl_on_the_training_data(setup, tmp_path):
    teacher, train = setup
    result = run(teacher, train, tmp_path, r=recipe(steps=8, eval_every=8), reference_blocks=train)
    first, last = result.records[0], result.records[-1]
    assert (first.step, last.step) == (0, 8)
    assert last.kl < 0.8 * first.kl
    assert result.steps[-1].loss < result.steps[0].loss


def test_run_writes_logs_and_resume_after_kill_gives_the_same_curve(setup, tmp_path):
    teacher, train = setup
    whole = run(teacher, train, tmp_path / "whole")
    assert [r.step for r in whole.records] == [0, 2, 4, 6]

    class Killed(Exception):
        pass

    def kill_at_step_5(stats, last):
        if stats.step == 4:  # after 5 steps: the last checkpoint is at step 4
            raise Killed

    with pytest.raises(Killed):
        run(teacher, train, tmp_path / "resumed", on_step=kill_at_step_5)
    ckpt_dir = tmp_path / "resumed"
    assert [json.loads((ckpt_dir / "metrics.json").read_text())["records"][-1]["step"]] == [4]
    assert not list(ckpt_dir.glob(".*tmp*"))  # atomic writes leave nothing behind
    seen, restored = [], []
    resumed = run(teacher, train, ckpt_dir, on_eval=seen.append, on_restore=restored.extend)
    assert resumed.resumed_from == 4
    assert [r.step for r in restored] == [0, 2, 4]
    assert [r.step for r in seen] == [6]  # only the evaluations past the checkpoint are redone
    assert [r.step for r in resumed.records] == [0, 2, 4, 6]
    for a, b in zip(whole.records, resumed.records, strict=True):
        assert a.kl == pytest.approx(b.kl, rel=1e-6, abs=1e-9) and a.ppl == pytest.approx(b.ppl, rel=1e-6)
        assert (a.loss is None and b.loss is None) or a.loss == pytest.approx(b.loss, rel=1e-6)
    lines = (ckpt_dir / "metrics.csv").read_text().splitlines()
    assert lines[0] == "layout,seed,step,kl,ppl,loss,lr" and len(lines) == 5
    assert lines[1].split(",")[5] == ""  # no training loss before the first step
    assert len((ckpt_dir / "steps.csv").read_text().splitlines()) == 7
    doc = json.loads((ckpt_dir / "metrics.json").read_text())
    assert doc["complete"] and doc["format"] == D.RUN_FORMAT

    # A finished run is not trained again; a different configuration is refused, not resumed.
    again = run(teacher, train, ckpt_dir, on_step=kill_at_step_5)
    assert [r.kl for r in again.records] == [r.kl for r in resumed.records]
    with pytest.raises(D.DistillError, match="different configuration"):
        run(teacher, train, tmp_path / "whole", r=recipe(lr=1e-3))


def test_should_stop_cancels_between_steps(setup, tmp_path):
    teacher, train = setup
    fractions, steps = [], []
    with pytest.raises(Cancelled, match="cancelled at step 3"):  # asked once 3 steps are done
        run(teacher, train, tmp_path, should_stop=lambda: len(steps) >= 3,
            on_step=lambda stats, _last: steps.append(stats.step),
            progress=lambda stage, f: fractions.append((stage, f)))
    # the evaluations at steps 0 and 2 and the 3 steps, each moving the bar (tests/models/distill/test_compare.py
    # checks the amounts); the run stopped before its end
    assert {stage for stage, _ in fractions} == {"distilling"}
    values = [f for _, f in fractions]
    assert values == sorted(values) and values[0] > 0 and values[-1] < 1


KILLED_CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {repo!r})
from pathlib import Path
from models import distill as D
from tests.models.distill.kit import layout_of, recipe
from tests.tiny import tiny_model

torch.set_num_threads(1)
teacher = tiny_model("qwen3")
train = torch.randint(0, 97, (12, 16), generator=torch.Generator().manual_seed(5))
reference = D.DenseReference.compute(teacher, train[:4], recipe=recipe())

def die(stats, last):
    if stats.step == 4:  # SIGKILL: no exception handling, no cleanup
        os.kill(os.getpid(), signal.SIGKILL)

D.distill_run(teacher=teacher, layout=layout_of(teacher), seed=1, recipe=recipe(), train_blocks=train,
              reference=reference, run_dir=Path({run_dir!r}), on_step=die)
"""


def test_resume_after_sigkill_of_the_process(setup, tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    teacher, train = setup
    repo = str(Path(__file__).resolve().parents[3])
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD.format(repo=repo, run_dir=str(tmp_path / "run"))],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the child's thread count: the same float reductions
    try:
        resumed = run(teacher, train, tmp_path / "run")
        whole = run(teacher, train, tmp_path / "whole")
    finally:
        torch.set_num_threads(threads)
    assert resumed.resumed_from == 4
    for a, b in zip(whole.records, resumed.records, strict=True):
        assert a.step == b.step and a.kl == pytest.approx(b.kl, rel=1e-6, abs=1e-9)


def test_on_eval_student_gets_the_weights_each_evaluation_measured(setup, tmp_path):
    """A study's further evaluation set reads the student right after each evaluation: evaluating that student
    on the run's own reference again gives the record's KL, at every evaluation step, and it is refused on a
    sharded run (whole on no rank)."""
    teacher, train = setup
    reference = D.DenseReference.compute(teacher, train, recipe=recipe())
    again: dict[int, float] = {}

    def measure(record: D.EvalRecord, student: torch.nn.Module) -> None:
        again[record.step], _ = D.evaluate_student(student, teacher, reference, recipe=recipe())

    result = run(teacher, train, tmp_path / "a", reference_blocks=train, on_eval_student=measure)
    assert sorted(again) == [r.step for r in result.records] == [0, 2, 4, 6]
    for r in result.records:
        assert again[r.step] == pytest.approx(r.kl, rel=1e-9)  # the same weights, the same blocks
    with pytest.raises(D.DistillError, match="world_size=2"):
        run(teacher, train, tmp_path / "b", reference_blocks=train, on_eval_student=measure, world_size=2)
