"""A distillation job on W = 2 ranks through the real stack (API on Postgres, Celery workers on Redis,
gloo on CPU): it waits while only a 1-GPU worker is up (that worker does not consume the W = 2 queue),
then a worker owning 2 GPUs (DTP_LAYOUT_WORKER_GPUS=2) runs it, and its curve is the W = 1 job's."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.queue import queue_for
from tests.service_kit import TINY_DISTILL, WorkerProcess, spec, wait_for, worker_settings

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]

TOL = 1e-5
DISTILL = {**TINY_DISTILL, "layouts": ["contiguous"]}  # batch_size 2: one row per rank at W = 2


def body(world_size: int) -> dict:
    return spec(random_layouts=0, ablations=False, export={"checkpoint": False, "shards": False},
                distill={**DISTILL, "world_size": world_size})


@pytest.fixture(scope="module")
def settings(tmp_path_factory, postgres_server, redis_broker):
    # the API admits W = 2 (DTP_LAYOUT_MAX_WORLD_SIZE); the worker started from these settings owns 2 GPUs
    return worker_settings(tmp_path_factory.mktemp("distill-w2"), postgres_server, redis_broker, "distillw2",
                           worker_gpus=2, max_world_size=2)


def test_a_w2_job_waits_for_a_2_gpu_worker_and_matches_w1(settings):
    one_gpu = settings.model_copy(update={"worker_gpus": 1})
    small = WorkerProcess(one_gpu, settings.var_dir / "workers.log", name="one-gpu")
    assert queue_for(settings, 2) not in small.cmd[small.cmd.index("-Q") + 1].split(",")
    with TestClient(create_app(settings)) as client:
        small.start()
        try:
            sharded = client.post("/v1/jobs", json=body(2)).json()
            single = client.post("/v1/jobs", json=body(1)).json()
            single = wait_for(client, single["id"], timeout=180, worker=small)  # the 1-GPU worker takes W = 1
            assert single["status"] == "succeeded", single
            waiting = client.get(f"/v1/jobs/{sharded['id']}").json()
            assert waiting["status"] == "queued", waiting  # submitted first, still not taken
        finally:
            small.stop()
        big = WorkerProcess(settings, settings.var_dir / "workers.log", name="two-gpu").start()
        try:
            sharded = wait_for(client, sharded["id"], timeout=240, worker=big)
        finally:
            big.stop()
        assert sharded["status"] == "succeeded", sharded
        assert sharded["spec"]["distill"]["world_size"] == 2 and single["spec"]["distill"]["world_size"] == 1
        # the ranks each job trained on, from its summary.json
        assert sharded["summary"]["distill"]["world_size"] == 2 and single["summary"]["distill"]["world_size"] == 1
        curves = [client.get(job["links"]["metrics"]).json()["curves"] for job in (single, sharded)]
    (one,), (two,) = curves
    assert one["steps"] == two["steps"] == [0, 2, 4]
    for key in ("kl", "ppl", "loss"):
        for a, b in zip(one[key], two[key], strict=True):
            assert (a is None and b is None) or b == pytest.approx(a, rel=TOL, abs=TOL), (key, one[key], two[key])
    assert one["lr"] == two["lr"]
    assert two["kl"][-1] < two["kl"][0]  # it learns
