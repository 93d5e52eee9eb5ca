"""Progress a job shows while a stage runs (issue 30, item 10): the affinity stage's fraction moves
through the layers of each micro-batch (not only once a whole micro-batch of every layer is done),
and the ETA the monitor writes moves between two reports instead of freezing at the last figure."""

from __future__ import annotations

import time

import torch

from app.core.caller import OPEN
from app.core.db import Job, database
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import submit_job
from models.affinity.edges import schedule_affinity_pass
from models.affinity.scoring import affinity_pass
from models.schedules.grammar import resolve_schedule
from tests.service_kit import make_settings, provision, spec
from tests.tiny import tiny_model
from worker.jobs import Lease, Monitor, claim


def _running_job(tmp_path):
    settings = make_settings(tmp_path / "var", device="cpu")
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    provision(settings)
    db = database(settings.database_url)
    with db.session() as session:
        job = submit_job(session=session, settings=settings, spec=JobSpec.model_validate(spec()), caller=OPEN,
                         enqueue=lambda _jid: None)
    claimed = claim(db, job.id, worker="w:1", lease_s=30)
    assert claimed is not None
    with db.transaction() as session:  # in the affinity stage, as JobRun.enter leaves it
        session.get(Job, job.id).stage = "affinity"
    return db, job.id


def _shown(db, job_id):
    with db.session() as session:
        job = session.get(Job, job_id)
        return job.progress, job.eta_s


def test_the_affinity_fraction_moves_through_the_layers_and_the_eta_between_reports(tmp_path):
    db, job_id = _running_job(tmp_path)
    monitor = Monitor(db, Lease(job_id, "w:1", 1), 30)
    monitor.start_stage("affinity")
    model = tiny_model("llama")  # 3 layers
    blocks = torch.randint(0, 97, (4, 16))
    shown = []

    def progress(stage, fraction):
        time.sleep(0.05)  # each layer takes a while, as a real model's do
        monitor.report(fraction)
        monitor.flush()  # what the monitor's next tick writes
        shown.append(_shown(db, job_id))

    affinity_pass(model, blocks, batch_size=4, progress=progress)  # one micro-batch of all the blocks
    fractions = [f for f, _ in shown]
    # One micro-batch: a fraction per layer (before: one report, 1.0, at the end of the micro-batch).
    assert len(fractions) == 3 and fractions == sorted(fractions) and len(set(fractions)) == 3, fractions
    assert 0 < fractions[0] < 1 and fractions[-1] == 1.0
    assert all(eta is not None and eta > 0 for _, eta in shown[:-1]), shown

    # Between two reports the ETA counts down (before: written once per report, then frozen).
    monitor.start_stage("affinity")
    time.sleep(0.3)
    monitor.report(0.25)  # ETA ≈ 0.3 · 0.75 / 0.25 = 0.9 s
    monitor.flush()
    first = _shown(db, job_id)
    time.sleep(0.3)
    monitor.flush()  # no report since
    second = _shown(db, job_id)
    assert first[0] == second[0] == 0.25
    assert first[1] is not None and second[1] is not None
    assert 0.15 <= first[1] - second[1] <= 0.6, (first, second)

    # Once the stage is done (its row says so), and while the next one starts, nothing of it is written.
    monitor.stage_done()
    with db.transaction() as session:
        session.get(Job, job_id).progress = 1.0
    monitor.flush()
    assert _shown(db, job_id)[0] == 1.0
    monitor.report(0.5)  # a late report of the old stage, the row already in the next one
    with db.transaction() as session:
        row = session.get(Job, job_id)
        row.stage, row.progress, row.eta_s = "optimising", 0.0, None
    monitor.flush()
    assert _shown(db, job_id) == (0.0, None)


def test_the_edges_pass_reports_per_layer_too():
    seen = []
    schedule_affinity_pass(tiny_model("llama"), torch.randint(0, 97, (2, 8)), schedule=resolve_schedule("pt:3", 3, 2),
                           batch_size=2, progress=lambda _stage, f: seen.append(f))
    # the chain's pass (3 layers) then the edges' (3 layers), each in half of the stage
    assert len(seen) >= 6 and seen == sorted(seen) and seen[-1] == 1.0, seen


def test_a_distillation_job_shows_its_fraction_per_step_and_an_eta_that_moves(tmp_path, inject_faults):
    """The job's row as the API reads it, sampled while a real (tiny) distillation job runs in this
    process: the distilling stage's fraction steps through the optimiser steps, and between two steps
    the ETA shown changes (the monitor writes it every tick; before, only with each report)."""
    import threading

    from tests.service_kit import TINY_DISTILL
    from worker.entry import run_job

    settings = make_settings(tmp_path / "var", device="cpu", lease_s=0.6)  # the monitor ticks every 0.2 s
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    provision(settings)
    db = database(settings.database_url)
    body = spec(export=False, random_layouts=0, ablations=False, distill={**TINY_DISTILL, "layouts": ["optimised"],
                                                                          "steps": 6})
    with db.session() as session:
        job = submit_job(session=session, settings=settings, spec=JobSpec.model_validate(body), caller=OPEN,
                         enqueue=lambda _jid: None)
    inject_faults(stage_delay_s=0.15)  # each step (and micro-batch) takes a while
    result: list[str] = []
    runner = threading.Thread(target=lambda: result.append(run_job(job.id, settings=settings, db=db, worker="w:1")))
    runner.start()
    samples = []
    while runner.is_alive():
        with db.session() as session:
            row = session.get(Job, job.id)
            samples.append((row.stage, row.progress, row.eta_s))
        time.sleep(0.05)
    runner.join()
    assert result == ["succeeded"], result
    distilling = [(f, eta) for stage, f, eta in samples if stage == "distilling" and f is not None and 0 < f < 1]
    fractions = sorted({f for f, _ in distilling})
    assert len(fractions) >= 4, fractions  # 6 steps: the fraction moves step by step
    # the same fraction (no new report) shown with different ETAs: it counts down between steps
    by_fraction: dict[float, set[float]] = {}
    for f, eta in distilling:
        if eta is not None:
            by_fraction.setdefault(f, set()).add(round(eta, 3))
    assert any(len(etas) >= 2 for etas in by_fraction.values()), by_fraction
