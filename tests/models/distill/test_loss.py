"""The chunked KL + CE loss and its hand-formed gradient, against full logits and autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models import distill as D
from models.evaluation.evaluate import evaluate
from models.sim.dtp import DTPModel
from tests.models.distill.kit import layout_of, recipe
from tests.tiny import tiny_model, tokens


def reference_loss(student: DTPModel, teacher, ids: torch.Tensor, ce_weight: float = 0.1) -> torch.Tensor:
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


def _literal_chunk(student_logits, teacher_logits, targets, kl_scale, ce_scale):
    """The per-token definitions, one token and one vocabulary entry at a time, in float64."""
    kl = ce = teacher_ce = 0.0
    grad = []
    for s_row, t_row, target in zip(student_logits.double().tolist(), teacher_logits.double().tolist(),
                                    targets.tolist(), strict=True):
        zs, zt = sum(math.exp(x) for x in s_row), sum(math.exp(x) for x in t_row)
        q, p = [math.exp(x) / zs for x in s_row], [math.exp(x) / zt for x in t_row]
        kl += sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q, strict=True))
        row = [kl_scale * (qv - pv) for pv, qv in zip(p, q, strict=True)]
        if target != -100:
            ce -= math.log(q[target])
            teacher_ce -= math.log(p[target])
            row = [g + ce_scale * (qv - (v == target)) for v, (g, qv) in enumerate(zip(row, q, strict=True))]
        grad.append(row)
    return kl, ce, teacher_ce, torch.tensor(grad, dtype=torch.float64)


def test_kl_ce_chunk_matches_the_literal_definitions():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, 11, generator=g) * 3, torch.randn(6, 11, generator=g) * 3
    targets = torch.tensor([3, 0, -100, 10, 7, -100])
    stats = D.kl_ce_chunk(student, teacher, targets, grad_scales=(0.25, 0.05))
    kl, ce, teacher_ce, grad = _literal_chunk(student, teacher, targets, 0.25, 0.05)
    assert stats.kl == pytest.approx(kl, rel=1e-5) and stats.ce == pytest.approx(ce, rel=1e-5)
    assert stats.teacher_ce == pytest.approx(teacher_ce, rel=1e-5)
    torch.testing.assert_close(stats.grad.double(), grad, atol=1e-7, rtol=1e-5)
    assert D.kl_ce_chunk(student, teacher, targets).grad is None


def test_eval_and_distillation_measure_the_same_kl():
    """`dtp-layout eval` and a distillation run's step-0 evaluation share one implementation."""
    teacher = tiny_model("qwen3")
    layout = layout_of(teacher)
    blocks = tokens(4, 16)
    r = recipe(logit_chunk=7)
    reference = D.DenseReference.compute(teacher, blocks, recipe=r)
    kl, ppl = D.evaluate_student(D.make_student(teacher, layout, r), teacher, reference, recipe=r)
    result = evaluate(teacher, layout, blocks, batch_size=3)
    assert result.kl == pytest.approx(kl, rel=1e-5) and result.dtp_ppl == pytest.approx(ppl, rel=1e-5)
    assert result.dense_ppl == pytest.approx(reference.dense_ppl, rel=1e-5)
