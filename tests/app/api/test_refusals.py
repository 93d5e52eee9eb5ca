"""Issue 27: every refusal a worker can make of a valid job spec is also the API's, at submit.

The rules are declared once (models/run/rules.py RULES); for each one a job can meet, a spec that breaks it is
run by a worker (the job row written straight to the database, no submit check: `run_job` claims and runs it,
on SQLite, in this process) and sent to POST /v1/jobs. The worker fails the job, before any weight is read,
with the rule's message (its plan, or its loading stage and the model check before it); the API answers 422
naming the rule's field with the same message.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import Job, database, utcnow
from app.core.events import SUBMITTED, record
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from models.run.rules import LOCAL_ONLY, RULES
from tests.service_kit import CALIB, TINY_MODEL, make_settings, provision, spec

WIDE_MOE = "wide-moe"  # a config only: Qwen3-30B-A3B's FFN width on a tiny residual (tests/models/moe_kit.py)

STREAMS = "streams"  # replaced by a max_memory the tiny model's run must stream under, and fits streamed
DISTIL = {"layouts": ["optimised"], "steps": 1}  # one batch of 16 training blocks: the recipe's default

# rule → (the spec's overrides, the field the refusal names)
CASES: dict[str, tuple[dict, str]] = {
    "stability-halves": ({"stability": True, "calibration": {"sequences": 1}}, "calibration.sequences"),
    "distill-layouts": ({"distill": {**DISTIL, "layouts": ["random-1005"]}}, "distill.layouts.0"),
    "distill-train-blocks": ({"distill": {**DISTIL, "train": {"source": CALIB, "sequences": 4}}},
                             "distill.train.sequences"),
    "devices": ({"devices": 3}, "devices"),
    "delta": ({"delta": 9}, "delta"),
    "schedule-fits": ({"schedule": "spd:7"}, "schedule"),
    "memory-fits": ({"max_memory": "64KiB"}, "max_memory"),
    "streamed-distill": ({"max_memory": STREAMS, "distill": DISTIL}, "max_memory"),
    "streamed-spd-auto": ({"max_memory": STREAMS, "schedule": "spd:auto:1"}, "schedule"),
    "streamed-edges": ({"max_memory": STREAMS, "delta": 2}, "schedule"),
    # fits in memory (~1 GiB), but one of its dtp:2 neuron → neuron edges holds ~360 GiB while scored
    "edges-memory": ({"model": {"id": WIDE_MOE}, "max_memory": "4GiB", "delta": 2}, "schedule"),
}


def test_every_rule_a_job_can_meet_has_a_case():
    assert set(CASES) == set(RULES) - LOCAL_ONLY


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("refusals"), device="cpu", max_active_jobs=100)
    upgrade(settings.database_url)
    provision(settings)
    from tests.models.moe_kit import wide_moe_config

    wide_moe_config().save_pretrained(settings.models_dir / WIDE_MOE)  # config.json: no weight to read
    with TestClient(create_app(settings)) as client:
        yield settings, client


def _streaming_limit(settings) -> str:
    """A limit the base spec's run does not fit in memory under (so it streams) but fits streamed."""
    import torch

    from models.streaming.layer_source import StreamedModel
    from models.streaming.memory_plan import plan_memory

    config = StreamedModel.open(settings.models_dir / TINY_MODEL, dtype=torch.float32).config
    need = plan_memory(config, dtype="float32", command="optimise", limit=None, tokens=8 * 32, batch_tokens=4 * 32,
                       export=True)
    assert need.streamed < need.in_memory - 1
    return str(need.in_memory - 1)


def _body(settings, overrides: dict) -> dict:
    if overrides.get("max_memory") == STREAMS:
        overrides = {**overrides, "max_memory": _streaming_limit(settings)}
    return spec(**overrides)


def _worker_error(settings, body: dict) -> str | None:
    """Run the job as a worker does, without the submit check: its error (None: it did not fail)."""
    from worker.entry import run_job

    db = database(settings.database_url)
    valid = JobSpec.model_validate(body)  # a valid spec: what is refused is what it asks of the run
    with db.transaction() as session:
        job = Job(spec=valid.model_dump(mode="json"), fingerprint="r" * 64, model_id=valid.model.id, revision=None,
                  devices=valid.devices, schedule=valid.effective_schedule(), score=valid.score, status="queued",
                  owner=None, enqueued_at=utcnow())
        session.add(job)
        session.flush()
        record(session, job.id, SUBMITTED)
        job_id = job.id
    assert run_job(job_id, settings=settings, db=db, worker="test:refusals") == "failed"
    with db.session() as session:
        stored = session.get(Job, job_id)
        assert stored is not None
        assert stored.error_stage in (None, "loading"), stored.error_stage  # refused before any weight is read
        return stored.error


@pytest.mark.parametrize("rule", sorted(CASES))
def test_what_a_worker_refuses_the_submit_check_refuses(world, rule):
    settings, client = world
    overrides, field = CASES[rule]
    body = _body(settings, overrides)
    error = _worker_error(settings, body)
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert field in errors, errors
    # the same text (a worker that re-checks the model's config before loading it names the field first)
    assert error is not None and error.removeprefix(f"{field}: ") == errors[field], (errors[field], error)
