"""What one forward of a distillation may hold, and where a cancel lands: every training and evaluation
forward holds at most MAX_FORWARD_TOKENS tokens whatever micro_batch_size and eval_batch_size say (the
numbers do not change), and should_stop is asked before every evaluation batch and between training
micro-batches, so a cancel never waits for a whole evaluation or a whole step."""

from __future__ import annotations

import pytest
import torch

from models import distill as D
from models.base.progress import Cancelled
from models.distill import recipe as recipe_module
from tests.models.distill.kit import layout_of, recipe, run

CAP = 32  # tokens per forward in these tests: 2 sequences of 16


@pytest.fixture()
def small_cap(monkeypatch):
    monkeypatch.setattr(recipe_module, "MAX_FORWARD_TOKENS", CAP)


def forward_sizes(*models):
    """Token counts of every forward of `models` (their embedding sees each forward's ids)."""
    sizes: list[int] = []
    for model in models:
        model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: sizes.append(args[0].numel()))
    return sizes


def test_evaluation_holds_at_most_max_forward_tokens_and_gives_the_same_numbers(setup, monkeypatch):
    teacher, blocks = setup  # 12 blocks of 16 tokens
    r = recipe(eval_batch_size=12)  # all 12 in one forward, unless cut
    student = D.make_student(teacher, layout_of(teacher), r)
    whole = D.evaluate_student(student, teacher, D.DenseReference.compute(teacher, blocks, recipe=r), recipe=r)

    monkeypatch.setattr(recipe_module, "MAX_FORWARD_TOKENS", CAP)
    sizes = forward_sizes(teacher, student.model)
    reference = D.DenseReference.compute(teacher, blocks, recipe=r)
    cut = D.evaluate_student(student, teacher, reference, recipe=r)
    assert sizes == [CAP] * (3 * 6)  # dense reference: 6 teacher forwards; evaluation: 6 teacher + 6 student
    assert cut == pytest.approx(whole, rel=1e-5)
    assert not hasattr(reference, "hidden")  # no [n, S, D] kept for the whole set


def test_a_sequence_longer_than_the_cap_is_one_forward_of_its_own(setup, monkeypatch):
    monkeypatch.setattr(recipe_module, "MAX_FORWARD_TOKENS", 8)
    assert recipe(eval_batch_size=4).eval_rows(16) == 1 and recipe(micro_batch_size=2).train_rows(16) == 1
    assert recipe(eval_batch_size=4).eval_rows(2) == 4  # within the cap: as asked


def test_training_micro_batches_hold_at_most_max_forward_tokens_and_give_the_same_step(setup, monkeypatch):
    teacher, train = setup
    r = recipe(batch_size=4, micro_batch_size=4)  # 64 tokens per forward, unless cut
    batch = train[:4]
    students = [D.make_student(teacher, layout_of(teacher), r) for _ in range(2)]
    whole = D.train_step(students[0], teacher, batch, D.make_optimizer(students[0], r), step=0, recipe=r)

    monkeypatch.setattr(recipe_module, "MAX_FORWARD_TOKENS", CAP)
    sizes = forward_sizes(teacher, students[1].model)
    cut = D.train_step(students[1], teacher, batch, D.make_optimizer(students[1], r), step=0, recipe=r)
    assert sizes == [CAP] * 4  # 2 micro-batches: teacher and student each
    assert cut.loss == pytest.approx(whole.loss, rel=1e-5) and cut.grad_norm == pytest.approx(whole.grad_norm, rel=1e-4)
    for a, b in zip(students[0].parameters(), students[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def asking(stop_after: int | None = None):
    """A should_stop that counts its calls and says stop once it was asked `stop_after` times."""
    def should_stop() -> bool:
        should_stop.calls += 1  # type: ignore[attr-defined]
        return stop_after is not None and should_stop.calls > stop_after  # type: ignore[attr-defined]

    should_stop.calls = 0  # type: ignore[attr-defined]
    return should_stop


def test_should_stop_is_asked_before_every_evaluation_batch(setup, small_cap):
    teacher, blocks = setup
    r = recipe(eval_batch_size=12)
    student = D.make_student(teacher, layout_of(teacher), r)
    never = asking()
    reference = D.DenseReference.compute(teacher, blocks, recipe=r, should_stop=never)
    D.evaluate_student(student, teacher, reference, recipe=r, should_stop=never)
    assert never.calls == 6 + 6  # 12 blocks, 2 per forward: each pass asked 6 times
    with pytest.raises(Cancelled, match="an evaluation cancelled at block 6 of 12"):
        D.evaluate_student(student, teacher, reference, recipe=r, should_stop=asking(stop_after=3))
    assert student.training  # left as it was found
    with pytest.raises(Cancelled, match="the dense model's evaluation cancelled at block 0 of 12"):
        D.DenseReference.compute(teacher, blocks, recipe=r, should_stop=asking(stop_after=0))


def test_a_cancel_between_micro_batches_takes_no_step(setup, small_cap):
    teacher, train = setup
    r = recipe(batch_size=4, micro_batch_size=4)  # cut to 2 micro-batches of 2
    student = D.make_student(teacher, layout_of(teacher), r)
    before = [p.detach().clone() for p in student.parameters()]
    optimizer = D.make_optimizer(student, r)
    with pytest.raises(Cancelled, match="training step 0 cancelled at sequence 2 of 4"):
        D.train_step(student, teacher, train[:4], optimizer, step=0, recipe=r, should_stop=lambda: True)
    assert all(torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True))
    assert all(p.grad is None for p in student.parameters())


def test_a_cancel_during_the_last_evaluation_of_a_run(setup, tmp_path, small_cap):
    """After the last step the run still evaluates: a cancel there lands in that evaluation."""
    teacher, train = setup
    steps: list[int] = []
    fractions: list[float] = []
    with pytest.raises(Cancelled, match="an evaluation cancelled at block 0"):
        run(teacher, train, tmp_path, r=recipe(steps=2, eval_every=4, eval_batch_size=4),
            should_stop=lambda: len(steps) == 2, on_step=lambda stats, _last: steps.append(stats.step),
            progress=lambda _stage, f: fractions.append(f))
    # step 0's evaluation (its micro-batches), the two steps; the last evaluation cancelled before its first
    assert len(fractions) >= 3 and fractions == sorted(fractions) and fractions[0] > 0 and fractions[-1] < 1
    assert fractions[-1] - fractions[-2] == pytest.approx(fractions[-2] - fractions[-3])  # a step's share each


@pytest.mark.parametrize(("steps", "every"), [(1, 1), (6, 2), (7, 2), (10, 3), (1000, 100), (5, 10)])
def test_evaluations_counts_the_eval_steps(steps, every):
    r = D.DistillRecipe(steps=steps, eval_every=every, warmup_steps=0)
    assert r.evaluations() == len(r.eval_steps()) == len(D.eval_steps(r))


def test_the_paper_recipe_is_within_the_cap():
    paper = D.DistillRecipe()
    assert paper.train_rows(D.SEQ_LEN) == paper.micro_batch_size and paper.eval_rows(D.SEQ_LEN) == paper.eval_batch_size
