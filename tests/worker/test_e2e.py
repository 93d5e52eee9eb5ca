"""End to end on the real stack: a tiny random model saved under MODEL_ROOT, the API on Postgres, a
real Celery worker subprocess consuming Redis. Artifacts are downloaded and checked."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from app.api.main import create_app
from models.export.files import load_rank_shards
from models.layouts.layout import from_json_dict
from models.variants.set import ablation_names
from tests.faults import Faults
from tests.service_kit import TINY_MODEL, WorkerProcess, spec, wait_for, worker_settings
from tests.tiny import tokens

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]


@pytest.fixture(scope="module")
def settings(tmp_path_factory, postgres_server, redis_broker):
    return worker_settings(tmp_path_factory.mktemp("e2e"), postgres_server, redis_broker, "e2e")


@pytest.fixture(scope="module")
def worker(settings):
    w = WorkerProcess(settings, settings.var_dir / "worker.log", faults=Faults(stage_delay_s=0.2)).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def client(settings, worker):
    with TestClient(create_app(settings)) as c:
        yield c


def download_all(client, job_id, dest):
    """Every artifact of the job into dest/<name>, checking the sha256 of the body against the listing."""
    items = client.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]
    for art in items:
        r = client.get(art["link"])
        assert r.status_code == 200, art
        assert hashlib.sha256(r.content).hexdigest() == art["sha256"] == r.headers["x-checksum-sha256"]
        assert len(r.content) == art["size"]
        path = dest / art["name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(r.content)
    return {a["name"]: a for a in items}


@pytest.fixture(scope="module")
def finished(client, worker):
    job = client.post("/v1/jobs", json=spec()).json()
    return wait_for(client, job["id"], timeout=120, worker=worker)


def test_job_succeeds_and_artifacts_keep_the_dense_logits(client, settings, finished, tmp_path):
    job = finished
    assert job["status"] == "succeeded", job
    assert job["stages_done"] == ["loading", "calibration", "affinity", "optimising", "exporting"]
    assert job["affinity_cached"] is False and job["attempts"] == 1 and job["error"] is None
    assert set(job["timings"]) == set(job["stages_done"])
    layouts = {item["name"]: item for item in client.get(job["links"]["layouts"]).json()["items"]}
    assert set(layouts) == {"optimised", "contiguous", "random-1000", "random-1001",
                            *ablation_names("fo", restarts=4)}
    assert layouts["optimised"]["J"] >= max(v["J"] for v in layouts.values()) - 1e-9
    assert job["summary"]["layouts"]["optimised"] == pytest.approx(layouts["optimised"]["J"])
    # how to serve the shards (issue 28): L from the exported manifest, the client's download, vllm-serve
    serve = job["summary"]["serve"]
    assert (serve["available"], serve["devices"], serve["architecture"]) == (True, 2, "DtpLlamaForCausalLM")
    assert serve["commands"] == [f"dtp-layout client download {job['id']} shards --out ./{job['id'][:8]}",
                                 f"dtp-layout vllm-serve ./{job['id'][:8]}/shards  # vLLM at --tensor-parallel-size "
                                 "2, the shards' L"]

    arts = download_all(client, job["id"], tmp_path)
    kinds = {a["kind"] for a in arts.values()}
    assert {"affinity", "report", "checkpoint", "shards"} <= kinds
    assert "shards/manifest.json" in arts and "checkpoint/config.json" in arts

    # The permuted checkpoint, as downloaded, computes the dense function.
    dense = AutoModelForCausalLM.from_pretrained(settings.models_dir / TINY_MODEL).eval()
    permuted = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").eval()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(permuted(ids).logits, dense(ids).logits, atol=1e-4, rtol=0)
    rebuilt, shard_layout = load_rank_shards(tmp_path / "shards")
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, dense(ids).logits, atol=1e-4, rtol=0)

    # The layout endpoint, the checkpoint and the shards all carry the optimised layout.
    doc = client.get(layouts["optimised"]["link"]).json()
    optimised = from_json_dict(doc)
    assert json.loads((tmp_path / "checkpoint" / "dtp_layout.json").read_text())["neuron_device"] == (
        optimised.neuron_device.tolist())
    assert shard_layout.kv_group_device.tolist() == optimised.kv_group_device.tolist()

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["format"] == "dtp-layout-report/1" and report["job"]["id"] == job["id"]
    assert report["layouts"]["optimised"]["J"] == pytest.approx(layouts["optimised"]["J"])
    assert report["calibration"]["source"] == "calib/ids.npy"  # the name, not the server's path

    scores = client.get("/v1/scores", params={"model": TINY_MODEL, "devices": 2, "delta": 1, "score": "fo"}).json()
    assert scores["job_id"] == job["id"]
    assert scores["layouts"]["optimised"] == pytest.approx(layouts["optimised"]["J"])
    assert scores["random_expectation"] == pytest.approx((2 * 3 - 1) / 2)


def test_downloaded_shards_run_on_the_dtp_runtime(client, finished, tmp_path):
    """The job's shards, downloaded through the API as a user would, run on two real ranks and give the
    simulator's prefill and decode logits (within 1e-5) and greedy tokens."""
    import numpy as np

    from models.runtime import DTPRuntime
    from tests.models.runtime.reference import max_logit_error, simulator_generation

    assert finished["status"] == "succeeded", finished
    download_all(client, finished["id"], tmp_path)
    shards_dir = tmp_path / "shards"
    ids = tokens(2, 7, seed=5)
    with DTPRuntime.start(shards_dir, backend="gloo", timeout_s=60.0, threads=1) as rt:
        assert rt.info.layout == "optimised" and rt.info.devices == 2 and rt.info.delta == 1
        result = rt.generate(ids.numpy(), max_new_tokens=9, stop_at_eos=False, return_logits=True)
    prefill, steps, want = simulator_generation(shards_dir, ids, 8, 1)
    assert max_logit_error(result, prefill, steps) <= 1e-5
    np.testing.assert_array_equal(result.tokens, want.numpy())


def test_same_inputs_reuse_the_affinity(client, finished, worker):
    job = client.post("/v1/jobs", json=spec(export=False, random_layouts=0, ablations=False)).json()
    done = wait_for(client, job["id"], timeout=60, worker=worker)
    assert done["status"] == "succeeded", done
    assert done["affinity_cached"] is True and done["fingerprint"] == finished["fingerprint"]
    first = {a["name"]: a for a in client.get(finished["links"]["artifacts"]).json()["items"]}
    second = {a["name"]: a for a in client.get(done["links"]["artifacts"]).json()["items"]}
    assert set(second) == {"affinity.safetensors", "report.json"}
    assert second["affinity.safetensors"]["sha256"] == first["affinity.safetensors"]["sha256"]
    scores = {i["name"]: i["J"] for i in client.get(done["links"]["layouts"]).json()["items"]}
    assert scores["optimised"] == pytest.approx(finished["summary"]["layouts"]["optimised"])


def test_cancel_a_running_job(client, worker):
    body = spec(calibration={"sequences": 200, "seq_len": 16}, batch_size=1, export=False, random_layouts=0,
                ablations=False)
    job = client.post("/v1/jobs", json=body).json()
    running = wait_for(client, job["id"], timeout=60, worker=worker,
                       until=lambda j: (j["stage"] == "affinity" and j["progress"] > 0)
                       or j["status"] not in ("queued", "running"))
    assert running["status"] == "running" and running["stage"] == "affinity"
    assert running["eta_s"] is not None and running["eta_s"] > 0
    assert client.post(job["links"]["cancel"]).status_code == 202
    cancelled = wait_for(client, job["id"], timeout=30, worker=worker)
    assert cancelled["status"] == "cancelled" and cancelled["stage"] == "affinity"
    assert "affinity" not in cancelled["stages_done"]
    assert client.post(job["links"]["cancel"]).status_code == 409


def test_unreadable_model_fails_in_its_first_stage(client, worker):
    job = client.post("/v1/jobs", json=spec(model={"id": "nobody-here/no-such-model-xyz"})).json()
    failed = wait_for(client, job["id"], timeout=60, worker=worker)
    assert failed["status"] == "failed" and failed["error_stage"] == "loading" and failed["stage"] == "loading"
    assert "nobody-here/no-such-model-xyz" in failed["error"]
