"""The training probe (models/probe): its candidates, its pick against each candidate trained and evaluated on
its own by models.distill, its cost and the refusal of a probe over its time budget.

The pick is checked where it is knowable: every candidate is distilled again, independently (its own run
directory, `distill_run`), and its final student evaluated with `evaluate_student` on held-out blocks loaded
here from the calibration text after the training blocks; the probe's KL per candidate must be those, and its
pick their argmin. The time estimate is checked against the token passes written out here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.affinity.edges import schedule_affinity_pass
from models.data.calibration import CalibrationSpec, load_blocks
from models.distill.checkpoint import CHECKPOINT_DIR, checkpoint_to_read, read_run_state, restore
from models.distill.evaluation import DenseReference, evaluate_student
from models.distill.run import distill_run
from models.distill.student import make_student
from models.distill.train import make_optimizer
from models.families import model_shape
from models.layouts import layout as lay
from models.optimise import score
from models.optimise.problem import edges_of
from models.probe import probe as P
from models.probe.candidates import mixture, probe_candidates
from models.probe.spec import PROBE_BATCH, ProbeError, ProbeSpec
from models.schedules.grammar import parse_schedule, resolve_schedule
from models.variants.set import build_layouts, neuron_agreement, objective_affinity
from tests.tiny import tiny_model

VOCAB, SEQ = 97, 16

DTP2 = parse_schedule("dtp:2")  # what the students simulate (the layouts' own δ)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny llama, a token file, its calibration blocks and a dtp:2 affinity at L = 2."""
    root = tmp_path_factory.mktemp("probe")
    model = tiny_model("llama")
    ids = root / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, VOCAB, size=64 * SEQ))
    calibration = CalibrationSpec(str(ids), sequences=8, seq_len=SEQ)
    blocks = load_blocks(calibration, None, vocab_size=VOCAB)
    schedule = resolve_schedule("dtp:2", 3, 2)
    result = schedule_affinity_pass(model, blocks, schedule=schedule, batch_size=4)
    return model, calibration, result, schedule


def test_the_candidates_are_the_issues_kinds_distinct_and_scored_in_j_sigma(setup):
    _, _, result, schedule = setup
    optimised = build_layouts(result, devices=2, delta=2, restarts=1, schedule=schedule)["optimised"]
    got = probe_candidates(result, count=4, devices=2, delta=2, score_name="fo", schedule=schedule, restarts=1,
                           optimised=optimised)
    assert list(got) == ["optimised", "dtp1-optimised", "mix-0.5", "optimised-seed1"]
    assert np.array_equal(got["optimised"].neuron_device, optimised.neuron_device)
    assert [c.score["candidate"]["objective_weight"] for c in got.values()] == [1.0, 0.0, 0.5, 1.0]
    for a in got.values():  # distinct up to a relabelling of the devices
        for b in got.values():
            if a is not b:
                same = neuron_agreement(a, b)
                assert not (same["neurons"] == 1.0 and same["kv_groups"] == 1.0), (a.name, b.name)
    sigma = objective_affinity(result, "fo", schedule)
    for cand in got.values():  # each reports its J_σ of dtp:2, whatever objective built it
        assert cand.score["J"] == pytest.approx(score(sigma, cand.kv_group_device, cand.neuron_device, devices=2).J)
    # J_σ picks `optimised` among them (the optimiser's own objective): the probe exists because training may not
    assert got["optimised"].score["J"] >= got["dtp1-optimised"].score["J"] - 1e-9


def test_the_mixture_is_the_weighted_sum_of_the_two_objectives(setup):
    _, _, result, schedule = setup
    sigma = edges_of(objective_affinity(result, "fo", schedule))
    chain = edges_of(objective_affinity(result, "fo", None))
    shape = model_shape(tiny_model("llama").config)
    for weight in (0.25, 0.5, 0.75):
        mixed = mixture(sigma, chain, weight)
        for seed in range(5):
            r = lay.random(shape, 2, 2, seed=seed)
            js = score(sigma, r.kv_group_device, r.neuron_device, devices=2).J
            j1 = score(chain, r.kv_group_device, r.neuron_device, devices=2).J
            jm = score(mixed, r.kv_group_device, r.neuron_device, devices=2).J
            assert jm == pytest.approx(weight * js + (1 - weight) * j1, rel=1e-9)
    with pytest.raises(ValueError, match="weight"):
        mixture(sigma, chain, 1.0)


def _independent_kl(model, layout, recipe, train_blocks, held_out, run_dir, schedule):
    """The candidate trained on its own (`distill_run`) and its final student evaluated on `held_out`."""
    reference = DenseReference.compute(model, held_out, recipe=recipe)
    distill_run(teacher=model, layout=layout, seed=0, recipe=recipe, train_blocks=train_blocks, reference=reference,
                run_dir=run_dir, keep_checkpoint=True, schedule=schedule)
    student = make_student(model, layout, recipe, schedule)
    found = checkpoint_to_read(run_dir / CHECKPOINT_DIR)
    restore(found, read_run_state(found), student, make_optimizer(student, recipe))
    kl, _ = evaluate_student(student, model, reference, recipe=recipe)
    return kl


def test_the_probe_picks_the_candidate_with_the_lowest_held_out_kl(setup, tmp_path):
    model, calibration, _, _ = setup
    shape = model_shape(model.config)
    candidates = {"contiguous": lay.contiguous(shape, 2, 2), "random-5": lay.random(shape, 2, 2, seed=5),
                  "random-9": lay.random(shape, 2, 2, seed=9)}
    probe = ProbeSpec(candidates=3, steps=3, eval_sequences=4)
    said = []
    record = P.run_probe(probe, teacher=model, tokenizer=None, candidates=candidates, calibration=calibration,
                         schedule=DTP2, out_dir=tmp_path / "probe",
                         announce=said.append)
    assert record["format"] == P.PROBE_FORMAT and said and "about" in said[0]
    # held out: the blocks after the 8 the probe trained on (the calibration blocks themselves)
    assert record["data"]["held_out"] and record["eval"]["skip_blocks"] == calibration.sequences
    train_blocks = load_blocks(calibration, None, vocab_size=VOCAB)
    held_out = load_blocks(CalibrationSpec(calibration.source, sequences=4, seq_len=SEQ, skip_blocks=8), None,
                           vocab_size=VOCAB)
    assert not any(torch.equal(h, t) for h in held_out for t in train_blocks)
    independent = {name: _independent_kl(model, layout, probe.recipe(), train_blocks, held_out,
                                         tmp_path / "alone" / name, DTP2)
                   for name, layout in candidates.items()}
    probed = {name: row["final_kl"] for name, row in record["candidates"].items()}
    assert probed == pytest.approx(independent, rel=1e-5)
    assert record["chosen"] == min(independent, key=independent.get)
    assert len(set(probed.values())) == 3  # the pick is not a tie broken by order
    for row in record["candidates"].values():  # each candidate's curve: step 0, then every ceil(S/4) steps, and S
        assert row["steps"] == [0, 1, 2, 3] and len(row["kl"]) == 4
    chosen = P.chosen_layout(tmp_path / "probe", P.read_probe(tmp_path / "probe"))
    assert np.array_equal(chosen.neuron_device, candidates[record["chosen"]].neuron_device)
    cost = json.loads((tmp_path / "probe" / P.COST_FILE).read_text())
    assert cost["training_tokens"] == 3 * 3 * PROBE_BATCH * SEQ and cost["estimated_seconds"] > 0
    # rerun over the same directory: the finished runs are read back, the same pick
    again = P.run_probe(probe, teacher=model, tokenizer=None, candidates=candidates, calibration=calibration,
                        schedule=DTP2, out_dir=tmp_path / "probe")
    assert again["chosen"] == record["chosen"] and again["candidates"] == record["candidates"]


def test_the_time_estimate_counts_every_token_pass_at_the_measured_rate():
    probe = ProbeSpec(candidates=3, steps=10, eval_sequences=8)
    recipe = probe.recipe()
    cost = probe.cost(32)
    step_seconds = 2.0
    # written out: a step is 4 passes of B × S tokens (teacher forward, student forward and backward), an
    # evaluation 2 passes of the held-out tokens, the dense reference one; evaluations at 0, 3, 6, 9, 10
    per_pass = step_seconds / (4 * PROBE_BATCH * 32)
    evaluations = len(range(0, 10, 3)) + 1
    passes = 3 * (10 * 4 * PROBE_BATCH * 32 + evaluations * 2 * 8 * 32) + 8 * 32
    assert recipe.eval_steps() == [0, 3, 6, 9, 10] and cost.evaluations == evaluations
    assert P.estimate_seconds(cost, recipe, step_seconds) == pytest.approx(passes * per_pass)
    assert cost.training_tokens == 3 * 10 * PROBE_BATCH * 32
    assert cost.eval_tokens == (3 * evaluations + 1) * 8 * 32


def test_a_probe_over_its_time_budget_is_refused_before_it_trains(setup, tmp_path, monkeypatch):
    model, calibration, _, _ = setup
    shape = model_shape(model.config)
    candidates = {"contiguous": lay.contiguous(shape, 2, 2), "random-5": lay.random(shape, 2, 2, seed=5)}
    monkeypatch.setattr(P, "measure_step", lambda *a, **k: 30.0)  # a slow machine: 30 s a step
    said = []
    with pytest.raises(ProbeError, match="probe_max_seconds=600") as refused:
        P.run_probe(ProbeSpec(candidates=2, steps=20, eval_sequences=4, max_seconds=600), teacher=model,
                    tokenizer=None, candidates=candidates, calibration=calibration, schedule=DTP2,
                    out_dir=tmp_path / "probe", announce=said.append)
    assert refused.value.field == "probe_max_seconds"
    assert said and "30.00 s" in said[0]  # the cost was told before the refusal
    assert json.loads((tmp_path / "probe" / P.COST_FILE).read_text())["estimated_seconds"] > 600
    assert not (tmp_path / "probe" / P.RUNS_DIR).exists()  # nothing trained


def test_the_probe_spec_refuses_what_cannot_run_naming_the_field():
    with pytest.raises(ProbeError, match="0 \\(no probe\\) or 2") as one:
        ProbeSpec(candidates=1)
    assert one.value.field == "probe"
    with pytest.raises(ProbeError) as steps:
        ProbeSpec(candidates=2, steps=0)
    assert steps.value.field == "probe_steps"
    with pytest.raises(ProbeError, match=r"calibration\.sequences must be ≥ 4") as few:
        ProbeSpec(candidates=2).check_calibration(3)
    assert few.value.field == "calibration.sequences"
