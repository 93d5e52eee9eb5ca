"""bench/lookahead_score.py: one layout's look-ahead is one AdamW step on KL + w·CE, written out by hand here
(autograd on full logits, clipping and the update without torch.optim), and the command scores every arm of
a tiny trained set and counts the separated pairs each score orders."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from bench import lookahead_score as la
from bench import schedule_experiment as exp
from models.base.shapes import ModelShape
from models.distill.evaluation import DenseReference
from models.distill.recipe import DistillRecipe
from models.distill.student import make_student
from models.layouts import layout as layout_mod
from models.schedules.grammar import parse_schedule
from tests.bench.sets_kit import quick_trained_set
from tests.tiny import tiny_model, tokens


def _kl_and_ce_sums(student, teacher, ids):
    """(Σ KL(dense ‖ student) over every token, Σ student −log q(next token)) from the full logits."""
    logq = F.log_softmax(student(ids), dim=-1)  # [B, S, V]
    logp = F.log_softmax(teacher(ids).logits, dim=-1)  # [B, S, V]
    kl = (logp.exp() * (logp - logq)).sum()
    ce = -logq[:, :-1].gather(-1, ids[:, 1:, None]).sum()
    return kl, ce


def _hand_lookahead(teacher, layout, schedule, recipe, batch, blocks):
    """The look-ahead written out: the loss by autograd, the global-norm clip and one AdamW update by hand."""
    student = make_student(teacher, layout, recipe, schedule)
    params = [p for p in student.parameters() if p.requires_grad]
    with torch.no_grad():
        before = float(_kl_and_ce_sums(student, teacher, blocks)[0]) / blocks.numel()
    b, s = batch.shape
    kl, ce = _kl_and_ce_sums(student, teacher, batch)
    grads = torch.autograd.grad(kl / (b * s) + recipe.ce_weight * ce / (b * (s - 1)), params)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    max_norm = recipe.grad_clip if recipe.grad_clip > 0 else math.inf
    clip = min(1.0, max_norm / (norm + 1e-6))  # torch's clip_grads_with_norm_: max_norm / (norm + 1e-6), at most 1
    lr, (b1, b2), eps, wd = recipe.lr, recipe.betas, recipe.adam_eps, recipe.weight_decay
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            g = g * clip
            m, v = (1 - b1) * g, (1 - b2) * g * g  # the first step from zero moments
            m_hat, v_hat = m / (1 - b1), v / (1 - b2)
            p.mul_(1 - lr * wd)  # decoupled weight decay
            p.sub_(lr * m_hat / (v_hat.sqrt() + eps))
        after = float(_kl_and_ce_sums(student, teacher, blocks)[0]) / blocks.numel()
    return before, after, norm


def test_the_lookahead_is_one_clipped_adamw_step_on_kl_plus_weighted_ce():
    teacher = tiny_model("llama", num_hidden_layers=2)
    layout = layout_mod.random(ModelShape("llama", 2, 4, 8, 96, 48, 6), 2, seed=5)
    schedule = parse_schedule("dtp:2")
    # two micro-batches, logit chunks that cut the tokens unevenly, weight decay on, and clipping active. The
    # first AdamW step is lr·g/(|g| + ε) per weight, so a clip by c only moves ε to ε/c: an ε near the gradients'
    # size is what lets the comparison see the clip (checked below, as is the weight decay)
    recipe = la.peak_step_recipe(DistillRecipe(steps=50, warmup_steps=5, batch_size=2, micro_batch_size=1, lr=1e-2,
                                               adam_eps=1e-3, weight_decay=0.5, grad_clip=0.5, logit_chunk=7,
                                               eval_batch_size=2))
    batch, blocks = tokens(batch=2, seq=16, seed=3), tokens(batch=3, seq=20, seed=4)
    reference = DenseReference.compute(teacher, blocks, recipe=recipe)
    got = la.lookahead(teacher, layout, schedule, recipe, batch, reference)

    before, after, norm = _hand_lookahead(teacher, layout, schedule, recipe, batch, blocks)
    assert norm > recipe.grad_clip  # the clip scaled the step
    assert got["lr"] == 1e-2  # the peak lr at step 0, no warm-up
    torch.testing.assert_close(got["kl_before"], before, rtol=1e-5, atol=0)
    torch.testing.assert_close(got["grad_norm"], norm, rtol=1e-5, atol=0)
    torch.testing.assert_close(got["kl_after"], after, rtol=1e-5, atol=0)
    assert got["drop"] == got["kl_before"] - got["kl_after"]
    # the comparison is sharp: the step, its clip and its weight decay each move the KL far beyond the tolerance
    unclipped = _hand_lookahead(teacher, layout, schedule, dataclasses.replace(recipe, grad_clip=0.0), batch, blocks)
    undecayed = _hand_lookahead(teacher, layout, schedule, dataclasses.replace(recipe, weight_decay=0.0), batch, blocks)
    for other in (before, unclipped[1], undecayed[1]):
        assert abs(other - after) > 100 * 1e-5 * after, (before, after, unclipped, undecayed)


def test_the_command_scores_every_trained_arm_and_counts_the_pairs_each_score_orders(tmp_path):
    common, work, trained = quick_trained_set(tmp_path, *exp.RECORDED_SETS)
    out_file = tmp_path / "out.json"
    la.main(["--set", " ".join([str(work), "dtp:2", str(work / "result-dtp-2.json"), *common]),
             "--score-source", str(tmp_path / "one.npy"), "--score-sequences", "3", "--score-seq-len", "32",
             "--out", str(out_file)])
    out = json.loads(out_file.read_text())
    assert out["rule"] == la.RULE and out["drop_rule"] == la.DROP_RULE
    row = out["sets"][0]
    finals = trained["final_kl"]
    assert set(row["arms"]) == set(finals) == {"optimised", "optimised-other", "contiguous", "random-1000"}
    assert row["final_kl"] == finals and row["lr"] == 1e-4
    for arm, r in row["arms"].items():
        assert r["lr"] == 1e-4 and r["grad_norm"] > 0 and r["kl_after"] > 0, arm
        assert r["drop"] == pytest.approx(r["kl_before"] - r["kl_after"], abs=1e-12), arm
    # the batch: the quick recipe's one training block, past the 3 scoring blocks (and the 2 calibration ones)
    assert row["batch"]["sequences"] == 1 and row["batch"]["seq_len"] == 32 and row["batch"]["skip_blocks"] == 3

    # every score's counts, recounted from the file's own numbers (higher: better, KLs negated)
    values = {"lookahead_kl": {a: -r["kl_after"] for a, r in row["arms"].items()},
              "drop": {a: r["drop"] for a, r in row["arms"].items()},
              "step0_kl": {a: -r["kl_before"] for a, r in row["arms"].items()},
              "J_damage": trained["predictors"]["J_damage"]}
    pairs = [(a, b) for a in finals for b in finals if a != b and max(finals[a]) < min(finals[b])]
    assert pairs  # the counts below are about something
    for name, score in values.items():
        ordered, separated, wrong = row["ordered"][name]
        assert separated == len(pairs) and ordered + len(wrong) == separated, name
        assert sorted(wrong) == sorted(f"{a}<{b}" for a, b in pairs if not score[a] > score[b]), name
        assert row["orders_every_pair"][name] == (not wrong), name
    assert out["orders_every_pair"] == {n: row["orders_every_pair"][n] for n in la.CANDIDATES}


def test_the_step_runs_at_the_peak_lr_without_touching_the_rest_of_the_recipe():
    recipe = DistillRecipe(steps=50, warmup_steps=5, lr=1e-4, min_lr=1e-5)
    peak = la.peak_step_recipe(recipe)
    assert peak.warmup_steps == 0 and dataclasses.replace(peak, warmup_steps=5) == recipe
