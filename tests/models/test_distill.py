"""Distillation on tiny random models: the loss, its gradient, the schedule, freezing, resume, comparison."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import distill as D
from models import layout as lay
from models.affinity import Cancelled
from models.calibration import CalibrationSpec
from models.families import model_shape
from tests.tiny import tiny_model, tokens

VOCAB = 97


def recipe(**overrides) -> D.DistillRecipe:
    base = dict(steps=6, batch_size=4, micro_batch_size=2, lr=2e-3, min_lr=2e-4, warmup_steps=2, eval_every=2,
                checkpoint_every=1, logit_chunk=10, eval_batch_size=2)
    return D.DistillRecipe(**{**base, **overrides})


def layout_of(model, seed: int = 3, devices: int = 2) -> lay.Layout:
    return lay.random(model_shape(model.config), devices, 1, seed=seed)


def reference_loss(student: D.DTPModel, teacher, ids: torch.Tensor, ce_weight: float = 0.1) -> torch.Tensor:
    """KL(teacher ‖ student) per token + ce_weight · CE per predicted token, from full logits."""
    logq = F.log_softmax(student(ids).float(), dim=-1)  # [B, S, V]
    with torch.no_grad():
        logp = F.log_softmax(teacher(ids).logits.float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    ce = F.nll_loss(logq[:, :-1].reshape(-1, logq.shape[-1]), ids[:, 1:].reshape(-1))
    return kl + ce_weight * ce


@pytest.mark.parametrize("case", ["llama", "llama-tied-headdim", "qwen3"])
def test_step_zero_loss_and_gradient_match_full_logits(case):
    teacher = tiny_model(case)
    r = recipe()
    student = D.make_student(teacher, layout_of(teacher), r)
    ids = tokens(4, 12)
    expected = reference_loss(student, teacher, ids)
    expected.backward()
    grads = {n: p.grad.clone() for n, p in D.trainable_parameters(student)}
    student.zero_grad(set_to_none=True)

    optimizer = D.make_optimizer(student, r)
    before = {n: p.detach().clone() for n, p in D.trainable_parameters(student)}
    # train_step's gradient (micro-batches of 2, chunks of 10 tokens): check it before the update.
    sums = D.LossSums()
    for micro in ids.split(2):
        sums.add(D.loss_and_backward(student, teacher, micro, recipe=r, kl_norm=48, ce_norm=44))
    for name, p in D.trainable_parameters(student):
        torch.testing.assert_close(p.grad, grads[name], atol=1e-6, rtol=1e-4, msg=name)
    student.zero_grad(set_to_none=True)
    stats = D.train_step(student, teacher, ids, optimizer, step=0, recipe=r)
    assert stats.loss == pytest.approx(expected.item(), rel=1e-5)
    assert stats.loss == pytest.approx(sums.kl / 48 + 0.1 * sums.ce / 44, rel=1e-6)
    assert stats.lr == pytest.approx(r.lr / r.warmup_steps)
    assert any(not torch.equal(p, before[n]) for n, p in D.trainable_parameters(student))


def test_chunk_size_does_not_change_the_loss():
    teacher = tiny_model("qwen2")
    ids = tokens(2, 16)
    losses = []
    for chunk in (1, 7, 32, 1000):
        r = recipe(logit_chunk=chunk)
        student = D.make_student(teacher, layout_of(teacher), r)
        sums = D.loss_and_backward(student, teacher, ids, recipe=r, kl_norm=32, ce_norm=30)
        losses.append((sums.kl, sums.ce))
    for kl, ce in losses[1:]:
        assert kl == pytest.approx(losses[0][0], rel=1e-5) and ce == pytest.approx(losses[0][1], rel=1e-5)


def test_gradient_checkpointing_and_cpu_bf16_autocast():
    teacher = tiny_model("llama")
    ids = tokens(2, 12)
    grads = {}
    for ckpt in (False, True):
        student = D.make_student(teacher, layout_of(teacher), recipe(gradient_checkpointing=ckpt))
        student.train()
        D.loss_and_backward(student, teacher, ids, recipe=recipe(), kl_norm=24, ce_norm=22)
        grads[ckpt] = {n: p.grad for n, p in D.trainable_parameters(student)}
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, atol=1e-6, rtol=1e-5)
    r16 = recipe(autocast="bf16")
    student = D.make_student(teacher, layout_of(teacher), r16)
    fp32 = D.loss_and_backward(D.make_student(teacher, layout_of(teacher), recipe()), teacher, ids, recipe=recipe(),
                               kl_norm=24, ce_norm=22)
    bf16 = D.loss_and_backward(student, teacher, ids, recipe=r16, kl_norm=24, ce_norm=22)
    assert bf16.kl == pytest.approx(fp32.kl, rel=0.1)
    assert all(p.dtype == torch.float32 for p in student.parameters())  # fp32 master weights


def test_learning_rate_schedule_matches_the_formula():
    r = D.DistillRecipe(steps=1000, warmup_steps=100, lr=5e-5, min_lr=5e-6)
    assert D.learning_rate(0, r) == pytest.approx(5e-7)
    assert D.learning_rate(49, r) == pytest.approx(2.5e-5)
    assert D.learning_rate(99, r) == pytest.approx(5e-5)
    assert D.learning_rate(100, r) == pytest.approx(5e-5)
    assert D.learning_rate(550, r) == pytest.approx(5e-6 + 4.5e-5 * 0.5)  # half way through the cosine
    assert D.learning_rate(325, r) == pytest.approx(5e-6 + 4.5e-5 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert D.learning_rate(999, r) == pytest.approx(5e-6, rel=1e-3)
    assert D.learning_rate(1000, r) == pytest.approx(5e-6)
    lrs = [D.learning_rate(s, r) for s in range(100, 1000)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    assert D.learning_rate(0, D.DistillRecipe(warmup_steps=0)) == pytest.approx(5e-5)


@pytest.mark.parametrize("case", ["llama", "llama-tied-headdim"])
def test_frozen_embeddings_stay_bit_identical_and_teacher_is_untouched(case):
    teacher = tiny_model(case)
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    r = recipe()
    student = D.make_student(teacher, layout_of(teacher), r)
    assert not {id(p) for p in student.parameters()} & {id(p) for p in teacher.parameters()}
    emb = student.model.model.embed_tokens.weight
    emb0, head0 = emb.detach().clone(), student.model.lm_head.weight.detach().clone()
    optimizer = D.make_optimizer(student, r)
    for step in range(3):
        D.train_step(student, teacher, tokens(4, 12, seed=step), optimizer, step=step, recipe=r)
    assert torch.equal(emb, emb0) and not emb.requires_grad
    tied = teacher.config.tie_word_embeddings
    # An untied LM head trains by default (only the embeddings are frozen); a tied one is the embedding.
    assert torch.equal(student.model.lm_head.weight, head0) == tied
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, teacher_state[k]), k
    frozen_head = D.make_student(teacher, layout_of(teacher), recipe(freeze_lm_head=True))
    assert not frozen_head.model.lm_head.weight.requires_grad


def test_batch_order_depends_only_on_seed_and_step():
    order = [D.batch_indices(s, batch_size=4, num_blocks=10, seed=7) for s in range(5)]  # 2 epochs
    flat = np.concatenate(order)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert not np.array_equal(flat[:10], flat[10:20])  # each epoch has its own order
    again = D.batch_indices(3, batch_size=4, num_blocks=10, seed=7)
    assert np.array_equal(again, order[3])
    other = np.concatenate([D.batch_indices(s, batch_size=4, num_blocks=10, seed=8) for s in range(5)])
    assert sorted(other[:10]) == sorted(flat[:10]) and not np.array_equal(other, flat)


@pytest.fixture()
def setup():
    teacher = tiny_model("qwen3")
    g = torch.Generator().manual_seed(5)
    train = torch.randint(0, VOCAB, (12, 16), generator=g)  # [n, S]
    return teacher, train


def run(teacher, train, run_dir, r=None, reference_blocks=None, **kw):
    r = r or recipe()
    blocks = train[:4] if reference_blocks is None else reference_blocks
    reference = D.DenseReference.compute(teacher, blocks, recipe=r)
    return D.distill_run(teacher=teacher, layout=layout_of(teacher), seed=1, recipe=r, train_blocks=train,
                         reference=reference, run_dir=run_dir, **kw)


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
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] > 3

    fractions = []
    with pytest.raises(Cancelled, match="step 3"):
        run(teacher, train, tmp_path, should_stop=stop, progress=lambda stage, f: fractions.append((stage, f)))
    assert fractions == [("distilling", 1 / 6), ("distilling", 2 / 6), ("distilling", 3 / 6)]


def test_reach_step_and_multipliers():
    steps = [0, 100, 200, 300]
    assert D.reach_step(steps, [5.0, 3.0, 2.0, 1.5], 2.5) == pytest.approx(150.0)
    assert D.reach_step(steps, [5.0, 3.0, 2.0, 1.5], 6.0) == 0.0
    assert D.reach_step(steps, [5.0, 3.0, 2.0, 1.5], 1.0) is None
    ref = (steps, [5.0, 4.0, 3.0, 2.0])
    cand = (steps, [5.0, 3.0, 2.0, 1.5])
    rows = D.multipliers(ref, cand)
    assert [r["step"] for r in rows] == [100, 200, 300]
    assert rows[0]["candidate_step"] == pytest.approx(50.0) and rows[0]["multiplier"] == pytest.approx(2.0)
    assert rows[1]["candidate_step"] == pytest.approx(100.0) and rows[1]["multiplier"] == pytest.approx(2.0)
    assert rows[2]["candidate_step"] == pytest.approx(200.0) and rows[2]["multiplier"] == pytest.approx(1.5)
    curves = {"contiguous": {"steps": steps, "kl": ref[1]}, "optimised": {"steps": steps, "kl": cand[1]}}
    head = D.headline(curves, reference="contiguous", candidate="optimised")
    assert head["candidate_step_to_reference_final_kl"] == pytest.approx(200.0)
    assert D.headline(curves, reference="contiguous", candidate="nope") is None


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
    with pytest.raises(lay.LayoutError, match="it has: optimised"):
        D.resolve_layouts(["heads-only"], shape=shape, devices=2, delta=1, layouts_dir=tmp_path / "layouts")
    with pytest.raises(lay.LayoutError, match="--from"):
        D.resolve_layouts(["optimised"], shape=shape, devices=2, delta=1)
    with pytest.raises(lay.LayoutError, match="devices=2"):
        D.resolve_layouts(["optimised"], shape=shape, devices=4, delta=1, layouts_dir=tmp_path / "layouts")


def test_recipe_and_spec_validation():
    with pytest.raises(D.DistillError, match="multiple of micro_batch_size"):
        D.DistillRecipe(batch_size=6, micro_batch_size=4)
    with pytest.raises(D.DistillError, match="min_lr"):
        D.DistillRecipe(lr=1e-5, min_lr=1e-4)
    with pytest.raises(D.DistillError, match="steps"):
        D.DistillRecipe(steps=0)
    with pytest.raises(D.DistillError, match="unknown field"):
        D.DistillRecipe.from_dict({"lr": 1e-4, "learning_rate": 1})
    assert D.DistillRecipe.from_dict(D.DistillRecipe().as_dict()) == D.DistillRecipe()
    spec = CalibrationSpec("x.npy", sequences=4, seq_len=8)
    with pytest.raises(D.DistillError, match="duplicates"):
        D.DistillSpec(layouts=("contiguous", "contiguous"), train=spec, eval=spec, devices=2)
    with pytest.raises(D.DistillError, match="seeds"):
        D.DistillSpec(layouts=("contiguous",), train=spec, eval=spec, devices=2, seeds=(1, 1))


def test_run_distill_compares_layouts_and_writes_the_summary(tmp_path):
    teacher = tiny_model("qwen2")
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, VOCAB, size=40 * 16))
    spec = D.DistillSpec(layouts=("optimised", "contiguous"), devices=2, seeds=(0, 1), recipe=recipe(steps=4),
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
    assert (out / "runs" / "optimised" / "seed-1" / "checkpoint.pt").exists()


def test_evaluation_skips_past_the_training_text_of_the_same_source(tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(40 * 8))  # token i at position i
    spec = D.DistillSpec(layouts=("contiguous",), devices=2,
                         train=CalibrationSpec(str(tmp_path / "ids.npy"), sequences=10, seq_len=8, seed=3),
                         eval=CalibrationSpec(str(tmp_path / "ids.npy"), sequences=4, seq_len=16))
    train, evaluation = D.load_data(spec, tokenizer=None, vocab_size=1000)
    assert train.shape == (10, 8) and evaluation.shape == (4, 16)
    assert int(train.max()) < 80 <= int(evaluation.min())
    # The spec's seed does not reorder the blocks: each run's training seed does (batch_indices).
    reseeded = D.DistillSpec(layouts=("contiguous",), devices=2, train=replace(spec.train, seed=0), eval=spec.eval)
    assert torch.equal(D.load_data(reseeded, tokenizer=None, vocab_size=1000)[0], train)


KILLED_CHILD = """
import os, signal, sys, torch
sys.path.insert(0, {repo!r})
from pathlib import Path
from models import distill as D
from tests.models.test_distill import layout_of, recipe
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
    repo = str(Path(__file__).resolve().parents[2])
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
