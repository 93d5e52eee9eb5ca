"""An MoE model through the whole service (issue 46): a tiny Qwen3-MoE saved under MODEL_ROOT, the API on
Postgres, a real Celery worker on Redis. The job, at dtp:2, runs the affinity pass (the chain's and the edges
beyond it), the optimiser, the export and a short distillation; its layouts are balanced per expert, its
permuted checkpoint and rank shards compute the dense model's function, its shards run on the project's
runtime with the simulator's tokens, and its summary says how vLLM serves them. The server's parameter limit
counts every expert."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from app.api.main import create_app
from models.export.files import load_rank_shards
from models.families.defaults import parameter_count
from models.layouts.layout import from_json_dict
from tests.models.moe_kit import expert_shape
from tests.service_kit import TINY_DISTILL, WorkerProcess, spec, wait_for, worker_settings
from tests.tiny import tiny_model, tokens
from tests.worker.test_e2e import download_all

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]

MOE_MODEL = "tiny-qwen3-moe"
SCHEDULE = "dtp:2"
DISTILL = {**TINY_DISTILL, "layouts": ["optimised", "contiguous"], "steps": 2}  # evaluated at steps 0 and 2


@pytest.fixture(scope="module")
def settings(tmp_path_factory, postgres_server, redis_broker):
    s = worker_settings(tmp_path_factory.mktemp("e2e-moe"), postgres_server, redis_broker, "e2e_moe")
    tiny_model("qwen3_moe").save_pretrained(s.models_dir / MOE_MODEL)
    return s


@pytest.fixture(scope="module")
def finished(settings):
    # dtp:2, a schedule beyond the paper's chain: the MoE edge pass (head and expert-neuron edges two modules
    # apart) feeds the optimiser, and the shards record dtp:2
    body = spec(model={"id": MOE_MODEL}, delta=2, schedule=SCHEDULE, random_layouts=1, ablations=False,
                distill=DISTILL)
    worker = WorkerProcess(settings, settings.var_dir / "worker.log").start()
    try:
        with TestClient(create_app(settings)) as client:
            job = client.post("/v1/jobs", json=body)
            assert job.status_code == 202, job.text
            yield client, wait_for(client, job.json()["id"], timeout=300, worker=worker)
    finally:
        worker.stop()


def test_an_moe_job_runs_end_to_end(settings, finished, tmp_path):
    client, job = finished
    assert job["status"] == "succeeded", job
    assert {"affinity", "optimising", "exporting", "distilling"} <= set(job["stages_done"]), job["stages_done"]
    dense = AutoModelForCausalLM.from_pretrained(settings.models_dir / MOE_MODEL).eval()
    experts, size = expert_shape(dense.config)

    # Every layout puts I_e / L neurons of each expert on each device, and the optimised one scores highest.
    layouts = {item["name"]: item for item in client.get(job["links"]["layouts"]).json()["items"]}
    assert {"optimised", "contiguous", "random-1000"} <= set(layouts)
    assert layouts["optimised"]["J"] >= max(v["J"] for v in layouts.values()) - 1e-9
    for name, item in layouts.items():
        layout = from_json_dict(client.get(item["link"]).json())
        per_expert = layout.neuron_device.reshape(layout.shape.num_layers, experts, size)  # [N, E, I_e]
        for device in range(2):
            assert ((per_expert == device).sum(axis=2) == size // 2).all(), name

    # The permuted checkpoint and the rank shards, downloaded, compute the dense model's function.
    download_all(client, job["id"], tmp_path)
    ids = tokens(2, 9, seed=3)
    permuted = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").eval()
    rebuilt, shard_layout = load_rank_shards(tmp_path / "shards")
    with torch.no_grad():
        want = dense(ids).logits
        torch.testing.assert_close(permuted(ids).logits, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(rebuilt(ids).logits, want, atol=1e-4, rtol=0)
    assert shard_layout.name == "optimised"
    assert (shard_layout.delta, shard_layout.schedule) == (2, SCHEDULE)  # optimised for dtp:2's J_σ

    # How vLLM serves them, and the distillation's curves (both layouts, evaluated at steps 0 and 2).
    serve = job["summary"]["serve"]
    assert (serve["available"], serve["devices"], serve["architecture"]) == (True, 2, "DtpQwen3MoeForCausalLM")
    curves = {c["layout"]: c for c in client.get(job["links"]["metrics"]).json()["curves"]}
    assert set(curves) == {"optimised", "contiguous"}
    for curve in curves.values():
        assert curve["steps"] == [0, 2] and all(math.isfinite(k) and k > 0 for k in curve["kl"]), curve


def test_the_moe_shards_run_on_the_runtime_with_the_simulators_tokens(finished, tmp_path):
    from models.runtime import DTPRuntime
    from tests.models.runtime.reference import max_logit_error, simulator_generation

    client, job = finished
    assert job["status"] == "succeeded", job
    download_all(client, job["id"], tmp_path)
    ids = tokens(2, 7, seed=5)
    with DTPRuntime.start(tmp_path / "shards", backend="gloo", timeout_s=60.0, threads=1) as rt:
        result = rt.generate(ids.numpy(), max_new_tokens=6, stop_at_eos=False, return_logits=True)
    prefill, steps, want = simulator_generation(tmp_path / "shards", ids, 5, schedule=SCHEDULE)
    assert max_logit_error(result, prefill, steps) <= 1e-5
    np.testing.assert_array_equal(result.tokens, want.numpy())


def test_the_parameter_limit_counts_every_expert(settings):
    """The server's estimate is the built model's parameter count, all E experts and the router included: a
    limit one below it refuses the job (413/422 naming the limit), the count itself admits it."""
    config = AutoModelForCausalLM.from_pretrained(settings.models_dir / MOE_MODEL).config
    built = sum(p.numel() for p in tiny_model("qwen3_moe").parameters())
    assert parameter_count(config.to_dict()) == built
    for limit, admitted in ((built - 1, False), (built, True)):
        capped = settings.model_copy(update={"max_model_params": limit})
        with TestClient(create_app(capped)) as client:
            r = client.post("/v1/jobs", json=spec(model={"id": MOE_MODEL}, export=False, ablations=False,
                                                  random_layouts=0))
            if admitted:
                assert r.status_code == 202, r.text
                client.post(f"/v1/jobs/{r.json()['id']}/cancel")
            else:
                assert r.status_code in (413, 422) and f"{limit:,}" in r.text, r.text
