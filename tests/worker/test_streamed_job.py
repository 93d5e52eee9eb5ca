"""A job under a memory limit its model does not fit in memory (run in process on SQLite, as a worker runs
it): the loading stage chooses to stream (models.streaming.memory_plan), the affinity pass and the export run layer
by layer and tensor by tensor, and the outputs equal those of the same job without a limit."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from sqlalchemy import select

from app.core.caller import OPEN
from app.core.db import Artifact
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import submit_job
from app.core.storage.root import Storage
from models.streaming.layer_source import StreamedModel
from models.streaming.memory_plan import plan_memory
from tests.service_kit import TINY_MODEL, job_history, spec
from worker.entry import run_job


def _artifacts(settings, db, job_id) -> dict[str, object]:
    with db.session() as session:
        rows = session.scalars(select(Artifact).where(Artifact.job_id == job_id)).all()
        return {row.name: Storage(settings.storage).path(row.storage_key) for row in rows}


def test_a_job_over_its_memory_limit_streams_and_equals_the_unlimited_job(embedded):
    settings, db = embedded
    config = StreamedModel.open(settings.models_dir / TINY_MODEL, dtype=torch.float32).config
    need = plan_memory(config, dtype="float32", command="optimise", limit=None, tokens=8 * 32, batch_tokens=4 * 32,
                       export=True)
    ids = []
    for limit in (str(need.in_memory - 1), None):  # streamed first: the affinity is not taken from a cache
        body = JobSpec.model_validate(spec(random_layouts=0, ablations=False, restarts=0, max_memory=limit))
        with db.session() as session:
            ids.append(submit_job(session=session, settings=settings, spec=body, caller=OPEN,
                                  enqueue=lambda _job_id: None).id)
        assert run_job(ids[-1], settings=settings, db=db, worker="test:1") == "succeeded"
    loading = [next(e for e in job_history(settings, job_id) if e["event"] == "stage-done" and e["stage"] == "loading")
               for job_id in ids]
    assert loading[0]["streamed"].startswith("streamed (limit") and "streamed" not in loading[1]
    streamed, in_memory = (_artifacts(settings, db, job_id) for job_id in ids)
    tensors = sorted(name for name in streamed if name.endswith(".safetensors"))
    assert tensors == sorted(name for name in in_memory if name.endswith(".safetensors"))
    assert "shards/model-rank-1-part-0.safetensors" in tensors and any(n.startswith("checkpoint/") for n in tensors)
    for name in tensors:  # the exported tensors bit for bit, the affinity (if kept as an artifact) to tolerance
        ours, theirs = load_file(streamed[name]), load_file(in_memory[name])
        assert ours.keys() == theirs.keys(), name
        exported = name.startswith(("checkpoint/", "shards/"))
        assert all(torch.equal(ours[k], theirs[k]) if exported else torch.allclose(ours[k], theirs[k], rtol=1e-6)
                   for k in ours), name
