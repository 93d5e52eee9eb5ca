"""One conversion per model, on the worker's path (jobs run in process on SQLite, as a worker runs them):
a tenant's first job on a GGUF model converts it into STORAGE_ROOT/converted/<tenant scope>/, the
tenant's later jobs load that copy without converting again, another tenant's job converts its own, and
the layouts are those of a run that dequantises the GGUF directly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sqlalchemy import select

from app.core.caller import Caller
from app.core.db import LayoutRow, database
from app.core.events import job_events
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import submit_job
from app.core.storage.root import Storage, tenant_scope
from models.io.converted import MANIFEST
from tests.service_kit import make_settings, provision, spec
from tests.tiny import GGUF_TINY, tiny_gguf
from worker.entry import run_job

CALIB = "calib/ids96.npy"  # token ids below the tiny GGUF's vocabulary of 96


@pytest.fixture
def embedded(tmp_path):
    settings = make_settings(tmp_path, device="cpu")
    upgrade(settings.database_url)
    provision(settings)
    tiny_gguf(settings.models_dir / "tiny.gguf")
    np.save(settings.data_dir / CALIB, np.random.default_rng(1).integers(0, GGUF_TINY["vocab_size"], size=4096))
    return settings, database(settings.database_url)


def job_spec(sequences: int) -> JobSpec:
    return JobSpec.model_validate(spec(model={"id": "tiny.gguf"}, random_layouts=0, ablations=False, export=False,
                                       restarts=0, calibration={"source": CALIB, "sequences": sequences}))


def run(settings, db, tenant: str, sequences: int) -> tuple[dict, dict[str, float]]:
    """Runs one job of `tenant` to success: (its loading stage's note, its layouts' J by name)."""
    with db.session() as session:
        job_id = submit_job(session=session, settings=settings, spec=job_spec(sequences),
                            caller=Caller(tenant=tenant, admin=False), enqueue=lambda _job_id: None).id
    assert run_job(job_id, settings=settings, db=db, worker="test:1") == "succeeded"
    with db.session() as session:
        loading = next(e.detail for e in job_events(session, job_id)
                       if e.kind == "stage-done" and e.stage == "loading")
        layouts = {row.name: row.J for row in session.scalars(select(LayoutRow).where(LayoutRow.job_id == job_id))}
    return loading, layouts


def entries(settings, tenant: str) -> dict[str, tuple[int, int]]:
    """The tenant's complete converted entries: name → (inode, mtime) of the manifest."""
    directory = Storage(settings.storage).path(Storage.CONVERTED) / tenant_scope(tenant)
    if not directory.is_dir():
        return {}
    return {p.name: ((p / MANIFEST).stat().st_ino, (p / MANIFEST).stat().st_mtime_ns)
            for p in directory.iterdir() if (p / MANIFEST).is_file()}


def direct_layouts(settings, tmp_path, sequences: int) -> dict[str, float]:
    """The layouts' J of the same stages on the same inputs, the GGUF dequantised on load (no cache)."""
    from models.data.calibration import CalibrationSpec
    from models.io.loading import ModelSource
    from models.run import pipeline, stages
    from models.run.runner import Hooks, run_stages

    body = job_spec(sequences)
    calibration = CalibrationSpec(**{**body.calibration.model_dump(),
                                     "source": str(settings.data_dir / CALIB)})
    out = tmp_path / "direct"
    out.mkdir()
    ctx = stages.RunContext(
        run_dir=out, model_id="tiny.gguf", source=lambda: ModelSource(str(settings.models_dir / "tiny.gguf")),
        dtype=body.model.dtype, device="cpu", devices=body.devices, delta=body.delta, schedule=body.schedule_spec(),
        optimise=pipeline.OptimiseSpec(devices=body.devices, delta=body.delta, schedule=body.schedule_spec(),
                                       score=body.score,
                                       random_layouts=body.random_layouts, ablations=body.ablations, export=False,
                                       batch_size=body.batch_size, restarts=body.restarts, stability=False),
        calibration=calibration, calibration_shown=calibration)
    class Notes(Hooks):
        def __init__(self) -> None:
            self.notes: dict[str, dict] = {}

        def after(self, stage, note, seconds) -> None:
            self.notes[stage.name] = note

    hooks = Notes()
    run_stages(stages.STAGES, ctx, hooks)
    assert hooks.notes["loading"] == {"weights": True}  # no converted copy
    return {path.stem: json.loads(path.read_text())["score"]["J"] for path in (out / "layouts").glob("*.json")}


def test_a_tenant_converts_a_gguf_model_once_and_another_tenant_its_own(embedded, tmp_path):
    settings, db = embedded
    note, first = run(settings, db, "alice", sequences=8)
    assert note["converted"] == "made"
    [entry] = entries(settings, "alice")
    made = entries(settings, "alice")

    # Another calibration: the affinity is computed again, so the weights are loaded, from alice's copy.
    note, second = run(settings, db, "alice", sequences=6)
    assert note["converted"] == "reused"
    assert entries(settings, "alice") == made  # the same manifest, not rewritten: no conversion

    note, other = run(settings, db, "bob", sequences=8)
    assert note["converted"] == "made"
    assert list(entries(settings, "bob")) == [entry]  # the same content key, in bob's own scope
    assert entries(settings, "alice") == made

    assert first == other and set(first) == set(second) == {"contiguous", "optimised"}
    assert direct_layouts(settings, tmp_path, sequences=8) == first
