"""The HTTP API on the real Postgres (and Redis as the broker the submissions go to); no worker runs
here, so submitted jobs stay queued and finished jobs are written to the database directly."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import Artifact, Job, Metric, database
from app.core.storage.root import Storage
from models.schedules.grammar import ACCEPTED, MAX_SCHEDULE_CHARS
from tests.service_kit import (
    CALIB,
    TINY_MODEL,
    delete_jobs,
    make_settings,
    own_prefix,
    provision,
    seed_finished_job,
    spec,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


@pytest.fixture(scope="module")
def settings(tmp_path_factory, postgres_server, redis_broker):
    from app.core.migrate import upgrade

    url = postgres_server.create_database("dtp_api")
    upgrade(url)
    broker = redis_broker[0]
    # No worker runs here: submitted jobs stay queued, so the per-tenant active-job limits are lifted.
    s = make_settings(tmp_path_factory.mktemp("api"), database_url=url, broker_url=broker,
                      # a prefix of its own: the API marks it (app/api/readiness.py)
                      broker_key_prefix=own_prefix(redis_broker, "api"),
                      max_active_jobs=100_000, max_active_tokens=1 << 50,
                      rate_limit_per_min=0)  # one TestClient address for the module's many requests (tested elsewhere)
    provision(s)
    return s


@pytest.fixture(scope="module")
def client(settings):
    with TestClient(create_app(settings)) as c:
        yield c


def submit(client, **overrides):
    return client.post("/v1/jobs", json=spec(**overrides))


def test_submit_answers_202_with_id_status_and_links(client):
    r = submit(client)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and job["stage"] is None and job["progress"] == 0
    assert r.headers["location"] == job["links"]["self"] == f"/v1/jobs/{job['id']}"
    assert set(job["links"]) == {"self", "layouts", "artifacts", "metrics", "cancel"}
    assert job["spec"]["calibration"]["source"] == CALIB and job["spec"]["export"] == {"checkpoint": True,
                                                                                         "shards": True,
                                                                                         "dtype": "auto"}
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert got["id"] == job["id"] and got["status"] == "queued"
    # The affinity fingerprint depends on model, revision, dtype and calibration only.
    same = submit(client, devices=4, random_layouts=0).json()
    other = submit(client, calibration={"seed": 1}).json()
    assert same["fingerprint"] == job["fingerprint"] != other["fingerprint"]
    # ... and on the edges the schedule adds: a dtp:2 pass is not a dtp:1 pass (dtp:1 keeps its old key);
    # spd:auto:K's layers depend on the devices simulated
    dtp1 = submit(client, schedule="dtp:1").json()
    dtp2 = submit(client, delta=2).json()
    spd_auto = {d: submit(client, devices=d, schedule="spd:auto:2").json() for d in (2, 4)}
    assert dtp1["fingerprint"] == job["fingerprint"]
    assert len({job["fingerprint"], dtp2["fingerprint"], spd_auto[2]["fingerprint"], spd_auto[4]["fingerprint"]}) == 4
    assert spd_auto[2]["spec"]["schedule"] == "spd:auto:2"


def test_invalid_spec_names_each_bad_field(client):
    body = spec(devices=0, score="xx", random_layouts=-1, calibration={"sequences": 0}, unknown=1)
    body["model"] = {"dtype": "int8"}
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert {"devices", "score", "random_layouts", "calibration.sequences", "unknown", "model.id",
            "model.dtype"} <= set(errors)
    assert "'fo' or 'add'" in errors["score"]
    assert "greater than or equal to 1" in errors["devices"]
    assert "float32" in errors["model.dtype"]
    assert "devices:" in r.json()["message"]


def test_one_422_names_the_missing_fields_and_the_unknown_model_together(client):
    """Issue 30 item 9: `submit --model nosuch-model --devices 3` was told only "calibration: Field
    required"; the unknown model showed once --calib was added. One answer names both."""
    r = client.post("/v1/jobs", json={"model": {"id": "nosuch-model"}, "devices": 3})
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert set(errors) == {"calibration", "model.id"}, errors
    assert "Field required" in errors["calibration"]
    assert "no model named 'nosuch-model' under the server's model root" in errors["model.id"]
    assert "calibration: Field required" in r.json()["message"] and "model.id: no model named" in r.json()["message"]
    # Every source the body names, each under its field, with the validation's own errors.
    body = spec(devices=0, model={"id": "nosuch-model"}, calibration={"source": "nosuch.npy"},
                distill={"layouts": ["optimised"], "steps": 0, "train": {"source": "corpus:bible"}})
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert {"devices", "distill.steps", "model.id", "calibration.source", "distill.train.source"} <= set(errors), errors
    assert "no file or directory 'nosuch.npy'" in errors["calibration.source"]
    assert "unknown corpus 'corpus:bible'" in errors["distill.train.source"]
    # A field the validation already refused is not checked again (one entry per field).
    r = client.post("/v1/jobs", json={"model": {"id": "x" * 5000}, "devices": 3})
    fields = [e["field"] for e in r.json()["detail"]]
    assert r.status_code == 422 and sorted(fields) == ["calibration", "model.id"], r.text


@pytest.mark.parametrize(("overrides", "field", "text"), [
    ({"devices": "2"}, "devices", "valid integer"),
    ({"distill": {"steps": 0}}, "distill.steps", "greater than or equal to 1"),
    ({"export": "yes"}, "export", "valid dictionary"),
    ({"calibration": {"source": "corpus:bible"}}, "calibration.source", "corpus:kjv"),
    ({"calibration": {"source": "hf:bad name"}}, "calibration.source", "hf:OWNER/NAME"),
    ({"calibration": {"source": "hf:text"}}, "calibration.source", "owner/name"),
    ({"model": {"gguf_file": "../x.gguf"}}, "model.gguf_file", "pattern"),
    ({"model": {"revision": "main"}}, "model.revision", "hub models only"),
    ({"schedule": "dtp:x"}, "schedule", "accepted: tp, dtp:δ, dtp:δ@K, ladder, spd:B"),
    ({"schedule": "ring"}, "schedule", "unknown schedule 'ring'"),
    ({"schedule": "dtp:2", "delta": 1}, "schedule", "schedule dtp:2 and delta=1 disagree"),
    ({"schedule": "spd:auto:4"}, "schedule", "K=4 layers to drop, but the model has num_layers=3"),
    ({"schedule": "x" * 5000}, "schedule", "at most 4096"),
])
def test_invalid_values(client, overrides, field, text):
    r = submit(client, **overrides)
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert field in errors and text in errors[field], errors


def test_a_schedule_is_stored_canonical_and_delta_stays_its_shorthand(client):
    """`schedule: dtp:2` and `delta: 2` are one job; another schedule is stored canonical, in the job's spec."""
    body = spec(schedule="dtp:2")
    body.pop("delta", None)
    answer = client.post("/v1/jobs", json=body)
    assert answer.status_code == 202, answer.text
    by_schedule = answer.json()
    assert by_schedule["spec"]["delta"] == 2 and by_schedule["spec"]["schedule"] is None
    assert submit(client, delta=2).json()["spec"] == by_schedule["spec"]
    answer = submit(client, schedule="spd:2,0")
    assert answer.status_code == 202, answer.text
    track = answer.json()
    assert track["spec"]["schedule"] == "spd:0,2" and track["spec"]["delta"] == 1
    beyond = submit(client, schedule="spd:1,3")  # the tiny model has layers 0 .. 2: refused at submit
    assert beyond.status_code == 422, beyond.text
    assert "layers [3] do not exist" in {e["field"]: e["msg"] for e in beyond.json()["detail"]}["schedule"]


def test_distill_spec_is_accepted_and_stored(client):
    body = {"layouts": ["optimised", "random-1001", "heads-only"], "seeds": [0, 3], "steps": 4,
            "train": {"source": CALIB, "seq_len": 16}, "eval": {"source": "corpus:shakespeare", "sequences": 2},
            "recipe": {"batch_size": 2, "micro_batch_size": 1, "eval_every": 2, "betas": [0.8, 0.9],
                       "autocast": "none"}}
    r = submit(client, distill=body)
    assert r.status_code == 202, r.text
    stored = r.json()["spec"]["distill"]
    assert stored["layouts"] == body["layouts"] and stored["seeds"] == [0, 3] and stored["steps"] == 4
    assert stored["recipe"]["betas"] == [0.8, 0.9] and stored["recipe"]["lr"] is None  # null: the default
    assert stored["train"]["source"] == CALIB  # the name, never the server's path
    defaults = submit(client, distill={})
    assert defaults.status_code == 202, defaults.text
    assert defaults.json()["spec"]["distill"]["layouts"] == ["optimised", "contiguous"]


def test_distill_layouts_use_the_layout_name_grammar(client):
    r = submit(client, distill={"layouts": ["optimised", "random:1001"]})  # random:SEED is random-SEED
    assert r.status_code == 202, r.text


@pytest.mark.parametrize(("distill", "field", "text"), [
    ({"layouts": ["optimised", "random-1002"]}, "distill.layouts.1", "random-1000, random-1001"),
    ({"layouts": ["anti-optimised"]}, "distill.layouts.0", "ablations=true"),
    ({"layouts": ["optimised", "optimised"]}, "distill.layouts", "duplicate"),
    ({"layouts": ["random-1000", "random:1000"]}, "distill.layouts.1", "is 'random-1000' again"),
    ({"layouts": ["random:x"]}, "distill.layouts.0", "random:SEED"),
    ({"layouts": ["/etc/layout.json"]}, "distill.layouts.0", "not one this job produces"),
    ({"layouts": []}, "distill.layouts", "at least 1"),
    ({"seeds": [1, 1]}, "distill.seeds", "distinct"),
    ({"recipe": {"lr": -1}}, "distill.recipe.lr", "greater than 0"),
    ({"recipe": {"warmup": 10}}, "distill.recipe.warmup", "Extra inputs"),
    ({"recipe": {"autocast": "fp8"}}, "distill.recipe.autocast", "'auto', 'bf16' or 'none'"),
    ({"recipe": {"betas": [0.9, 1.0]}}, "distill.recipe.betas", "[0, 1)"),
    ({"recipe": {"batch_size": 6, "micro_batch_size": 4}}, "distill.recipe", "multiple of micro_batch_size"),
    ({"recipe": {"min_lr": 1e-3}}, "distill.recipe", "min_lr ≤ lr"),
    ({"recipe": {"steps": 3}, "steps": 4}, "distill", "disagree"),
    ({"train": {"source": "../etc/passwd"}}, "distill.train.source", "without '..'"),
    ({"train": {"source": "/etc/passwd"}}, "distill.train.source", "relative name"),
    ({"eval": {"source": "corpus:bible"}}, "distill.eval.source", "unknown corpus"),
    ({"train": {"source": CALIB, "sequences": 4}}, "distill.train.sequences", "fewer than one batch"),
    ({"device": "cuda"}, "distill.device", "Extra inputs"),
])
def test_invalid_distill_names_the_field(client, distill, field, text):
    r = submit(client, ablations=False, distill=distill)
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert field in errors and text in errors[field], errors


@pytest.mark.parametrize("name", ["../tiny", "/etc", "~root/x", "tiny/../../etc", "a\\b", ".hidden", "tiny/",
                                  "escape", "no-such-model"])
def test_model_names_never_leave_the_model_root(client, settings, tmp_path_factory, name):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "config.json").write_text("{}")
    link = settings.models_dir / "escape"
    if not link.is_symlink():
        link.symlink_to(outside, target_is_directory=True)
    r = submit(client, model={"id": name})
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert "model.id" in errors


@pytest.mark.parametrize("source", ["../x.npy", "/etc/passwd", "calib/../../x", "leak.npy", "missing.npy"])
def test_data_sources_never_leave_the_data_root(client, settings, tmp_path_factory, source):
    outside = tmp_path_factory.mktemp("outside-data") / "x.npy"
    outside.write_bytes(b"")
    link = settings.data_dir / "leak.npy"
    if not link.is_symlink():
        link.symlink_to(outside)
    r = submit(client, calibration={"source": source})
    assert r.status_code == 422, r.text
    assert "calibration.source" in {e["field"] for e in r.json()["detail"]}


def test_indivisible_devices_and_delta_are_rejected_at_submit(client):
    r = submit(client, devices=3, delta=9)
    assert r.status_code == 422
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert "does not divide num_kv_groups=4" in errors["devices"]
    assert "valid L for this model: 1, 2, 4" in errors["devices"]
    assert "num_layers=3" in errors["delta"]


def test_uncached_hub_model_is_accepted_and_checked_later(client):
    r = submit(client, model={"id": "nobody-here/no-such-model-xyz"}, devices=3)
    assert r.status_code == 202, r.text


def test_listing_filters_and_pagination(client, settings):
    ids = {d: [submit(client, devices=d, delta=delta).json()["id"] for delta in (0, 1)] for d in (1, 4)}
    r = client.get("/v1/jobs", params={"devices": 4, "delta": 0})
    assert r.status_code == 200
    items = r.json()["items"]
    assert ids[4][0] in [j["id"] for j in items] and ids[4][1] not in [j["id"] for j in items]
    assert all(j["spec"]["devices"] == 4 and j["spec"]["delta"] == 0 for j in items)
    page = client.get("/v1/jobs", params={"model": TINY_MODEL, "limit": 2}).json()
    assert len(page["items"]) == 2 and page["total"] >= 4 and page["next"] and "offset=2" in page["next"]
    second = client.get(page["next"]).json()
    assert not {j["id"] for j in page["items"]} & {j["id"] for j in second["items"]}
    # Newest first.
    created = [j["created_at"] for j in page["items"] + second["items"]]
    assert created == sorted(created, reverse=True)
    assert client.get("/v1/jobs", params={"status": "queued", "devices": 1}).json()["total"] >= 2
    assert client.get("/v1/jobs", params={"model": "other-model"}).json()["total"] == 0
    bad = client.get("/v1/jobs", params={"status": "done", "limit": 0})
    assert bad.status_code == 422
    assert {"status", "limit"} <= {e["field"] for e in bad.json()["detail"]}


def test_unknown_things_are_404(client):
    job_id = submit(client).json()["id"]
    for path in ("/v1/jobs/nope", "/v1/jobs/nope/layouts", "/v1/jobs/nope/artifacts",
                 "/v1/jobs/nope/artifacts/report.json", f"/v1/jobs/{job_id}/layouts/optimised",
                 f"/v1/jobs/{job_id}/artifacts/report.json"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert r.json()["detail"]
    assert client.post("/v1/jobs/nope/cancel").status_code == 404


def test_cancel_queued_job_then_409(client):
    job_id = submit(client).json()["id"]
    r = client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    again = client.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]


@pytest.fixture(scope="module")
def finished_job(settings):
    """A succeeded job written straight to the database, with two layouts and two artifacts."""
    return seed_finished_job(settings, model_id="finished-model")


def test_layouts_and_dtp_layout_json(client, finished_job):
    from models.layouts.layout import from_json_dict

    job_id, _ = finished_job
    items = client.get(f"/v1/jobs/{job_id}/layouts").json()["items"]
    assert [i["name"] for i in items] == ["optimised", "contiguous"]
    assert items[0]["J"] == 3.5 and items[0]["up_fraction"] == [0.5, 0.5, 0.5] and items[0]["upper_bound"] == 4.0
    doc = client.get(items[0]["link"]).json()
    layout = from_json_dict(doc)
    assert layout.name == "optimised" and layout.devices == 2 and layout.shape.num_kv_groups == 4


def test_artifact_download_range_etag_digest(client, finished_job):
    job_id, payload = finished_job
    listing = {a["name"]: a for a in client.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]}
    art = listing["shards/blob.bin"]
    assert art["size"] == len(payload) and art["sha256"] == hashlib.sha256(payload).hexdigest()
    r = client.get(art["link"])
    assert r.status_code == 200 and r.content == payload
    assert r.headers["etag"] == f'"{art["sha256"]}"' and r.headers["accept-ranges"] == "bytes"
    assert r.headers["digest"] == "sha-256=" + base64.b64encode(hashlib.sha256(payload).digest()).decode()
    assert r.headers["content-length"] == str(len(payload))
    part = client.get(art["link"], headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == payload[100:200]
    assert part.headers["content-range"] == f"bytes 100-199/{len(payload)}"
    tail = client.get(art["link"], headers={"Range": "bytes=-10"})
    assert tail.status_code == 206 and tail.content == payload[-10:]
    open_ended = client.get(art["link"], headers={"Range": "bytes=4990-"})
    assert open_ended.content == payload[4990:]
    assert client.get(art["link"], headers={"Range": "bytes=9000-"}).status_code == 416
    stale = client.get(art["link"], headers={"Range": "bytes=0-9", "If-Range": '"other"'})
    assert stale.status_code == 200 and stale.content == payload
    assert client.get(art["link"], headers={"If-None-Match": r.headers["etag"]}).status_code == 304
    head = client.head(art["link"])
    assert head.status_code == 200 and head.content == b"" and head.headers["content-length"] == str(len(payload))
    # Names are looked up in the database, never joined onto a path.
    for name in ("..%2F..%2F..%2Fetc%2Fpasswd", "shards%2F..%2Freport.json", "%2e%2e%2f%2e%2e%2fapi.db", "blob.bin"):
        assert client.get(f"/v1/jobs/{job_id}/artifacts/{name}").status_code == 404


def test_metrics_curves_by_layout_and_seed_with_headline(client, settings, finished_job):
    job_id, _ = finished_job
    db = database(settings.database_url)
    storage = Storage(settings.storage)
    with db.transaction() as session:
        job = session.get(Job, job_id)
        job.spec = {**job.spec, "distill": {"layouts": ["optimised", "contiguous"], "seeds": [0, 1]}}
        for layout, seed in (("contiguous", 0), ("optimised", 0), ("optimised", 1)):
            for step in (0, 2):
                values = {"kl": 1.0 / (step + 1) + seed, "ppl": 50.0 - step, "lr": 1e-3}
                if step:
                    values["loss"] = 0.5
                session.add_all(Metric(job_id=job_id, layout=layout, seed=seed, step=step, name=name, value=value)
                                for name, value in values.items())
        summary = {"format": "dtp-layout-distill/1", "dense_ppl": 12.5, "seconds": 3.0,
                   "headline": {"reference": "contiguous", "candidate": "optimised", "reference_final_step": 2,
                                "candidate_step_to_reference_final_kl": 1.5, "multipliers": []}}
        key = Storage.artifact_key(job_id, "distill/summary.json")
        storage.path(key).parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(summary).encode()
        storage.path(key).write_bytes(data)
        # The true size and digest: the summary is checked like a download before it is shown.
        session.add(Artifact(job_id=job_id, name="distill/summary.json", kind="distill", size=len(data),
                             sha256=hashlib.sha256(data).hexdigest(), storage_key=key))
    r = client.get(f"/v1/jobs/{job_id}/metrics")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["job_id"] == job_id and body["status"] == "succeeded"
    assert [(c["layout"], c["seed"]) for c in body["curves"]] == [("optimised", 0), ("optimised", 1),
                                                                   ("contiguous", 0)]  # the spec's order
    first = body["curves"][0]
    assert first["steps"] == [0, 2] and first["kl"] == pytest.approx([1.0, 1 / 3]) and first["ppl"] == [50.0, 48.0]
    assert first["loss"] == [None, 0.5] and first["lr"] == [1e-3, 1e-3]
    assert body["summary"]["dense_ppl"] == 12.5
    assert body["summary"]["headline"]["candidate_step_to_reference_final_kl"] == 1.5
    only = client.get(f"/v1/jobs/{job_id}/metrics", params={"layout": "optimised", "seed": 1, "name": "kl"}).json()
    assert [(c["layout"], c["seed"]) for c in only["curves"]] == [("optimised", 1)]
    assert only["curves"][0]["kl"] == pytest.approx([2.0, 4 / 3]) and only["curves"][0]["ppl"] is None
    assert client.get(f"/v1/jobs/{job_id}/metrics", params={"name": "acc"}).status_code == 422
    assert client.get(f"/v1/jobs/{job_id}/metrics", params={"layout": "random-5"}).json()["curves"] == []


def test_metrics_of_a_job_without_curves_yet(client):
    job = submit(client, distill={"steps": 4}).json()
    r = client.get(job["links"]["metrics"])
    assert r.status_code == 200
    assert r.json() == {"job_id": job["id"], "status": "queued", "stage": None, "curves": [], "summary": None}
    assert client.get("/v1/jobs/nope/metrics").status_code == 404


def test_scores_latest_finished(client, finished_job):
    job_id, _ = finished_job
    r = client.get("/v1/scores", params={"model": "finished-model", "devices": 2, "delta": 1, "score": "fo"})
    assert r.status_code == 200
    body = r.json()
    assert body["job_id"] == job_id and body["layouts"] == {"optimised": 3.5, "contiguous": 2.4}
    assert body["tokens"] == 256 and body["upper_bound"] == 4.0
    assert client.get("/v1/scores", params={"model": "finished-model", "devices": 4}).status_code == 404
    assert client.get("/v1/scores", params={"score": "nope"}).status_code == 422


def test_health_ready_metrics_docs(client, settings):
    assert client.get("/healthz").json()["status"] == "ok"
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok"}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert 'dtp_layout_jobs{status="queued"}' in metrics.text
    assert "dtp_layout_http_requests_total" in metrics.text
    assert client.get("/docs").status_code == 200
    openapi = client.get("/openapi.json").json()
    body = openapi["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]
    assert "examples" in body and any(e["value"]["model"] for e in body["examples"].values())
    assert any(e["value"].get("distill") for e in body["examples"].values())
    assert "/v1/jobs/{job_id}/metrics" in openapi["paths"]
    # Every /v1 operation documents its failures with their JSON bodies.
    for path, methods in openapi["paths"].items():
        for method, op in methods.items():
            if not path.startswith("/v1"):
                continue
            codes = set(op["responses"])
            assert {"401", "413", "422", "429", "503"} <= codes, (method, path, codes)
            assert ("{job_id}" not in path and path != "/v1/scores") or "404" in codes, (method, path)
            for code in (c for c in codes if c[0] in "45"):  # success and redirects (307: the store's) aside
                schema = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
                assert schema.endswith("/ValidationErrorOut" if code == "422" else "/ErrorOut"), (path, code)
    assert "Retry-After" in openapi["paths"]["/v1/jobs"]["post"]["responses"]["429"]["headers"]
    assert openapi["paths"]["/v1/jobs"]["post"]["responses"]["202"]["links"]["get_job"]["operationId"] == "get_job"
    broken = make_settings(settings.var_dir, database_url=settings.database_url, broker_url="redis://127.0.0.1:1/0",
                           max_active_jobs=settings.max_active_jobs, max_active_tokens=settings.max_active_tokens)
    with TestClient(create_app(broken)) as other:
        r = other.get("/readyz")
        assert r.status_code == 503 and r.json()["checks"]["database"] == "ok"
        assert r.json()["checks"]["broker"].startswith("error")
        # No exception text or address to an unauthenticated caller: the reason is in the server's log.
        assert "127.0.0.1" not in r.text and "Connection" not in r.text
        # Submitting while the broker is down: 503, and nothing is recorded (tests/app/test_faults_redis.py).
        down = other.post("/v1/jobs", json=spec())
        assert down.status_code == 503 and down.headers["retry-after"]
        assert down.json()["error"] == "broker_unavailable" and "127.0.0.1" not in down.text


# ---- the schedule as a filter (issue 43): a CI gate that names a schedule gets the latest job of that
# schedule, not whichever job of the model finished last; GET /v1/jobs filters the same way; a bad schedule
# is a 422 naming the grammar.

SCHEDULES_MODEL = "two-schedules-model"


@pytest.fixture
def two_schedules(settings):
    """A dtp:1 job of SCHEDULES_MODEL, then a pt:2 job of it (finished later), then another dtp:1 job (latest)."""
    made = [seed_finished_job(settings, model_id=SCHEDULES_MODEL, schedule=s)[0] for s in ("dtp:1", "pt:2", "dtp:1")]
    yield made
    delete_jobs(settings, made)


def scores_of(client, **params):
    return client.get("/v1/scores", params={"model": SCHEDULES_MODEL, **params})


def test_a_gate_naming_a_schedule_gets_the_latest_job_of_that_schedule(client, two_schedules):
    _old_dtp, pt, new_dtp = two_schedules
    for asked, job_id in (("dtp:1", new_dtp), ("pt:2", pt), ("dtp:01", new_dtp), ("pt:002", pt)):
        r = scores_of(client, schedule=asked)
        assert r.status_code == 200, r.text
        assert r.json()["job_id"] == job_id, asked
    by_pt = scores_of(client, schedule="pt:2").json()
    assert by_pt["schedule"] == "pt:2" and by_pt["delta"] == 1  # δ: the layouts' (the spec's), as before
    assert scores_of(client, schedule="dtp:1").json()["schedule"] == "dtp:1"
    # δ alone is the shorthand for dtp:δ: a pt:2 job is no dtp:1 job, whenever it finished
    assert scores_of(client, delta=1).json()["job_id"] == new_dtp
    assert scores_of(client, delta=1, schedule="dtp:1").json()["job_id"] == new_dtp
    missing = scores_of(client, schedule="tp")
    assert missing.status_code == 404 and "schedule=tp" in missing.json()["detail"]


def test_the_latest_of_each_schedule_moves_on_its_own(client, settings, two_schedules):
    newer_pt, _ = seed_finished_job(settings, model_id=SCHEDULES_MODEL, schedule="pt:2")
    try:
        assert scores_of(client, schedule="pt:2").json()["job_id"] == newer_pt
        assert scores_of(client, schedule="dtp:1").json()["job_id"] == two_schedules[2]
    finally:
        delete_jobs(settings, [newer_pt])


def test_the_job_list_filters_by_schedule_and_shows_it(client, two_schedules):
    old_dtp, pt, new_dtp = two_schedules

    def listed(**params):
        r = client.get("/v1/jobs", params={"model": SCHEDULES_MODEL, **params})
        assert r.status_code == 200, r.text
        return {j["id"]: j["schedule"] for j in r.json()["items"]}

    assert listed(schedule="pt:2") == {pt: "pt:2"}
    assert listed(schedule="dtp:1") == listed(delta=1) == {old_dtp: "dtp:1", new_dtp: "dtp:1"}
    assert listed() == {old_dtp: "dtp:1", pt: "pt:2", new_dtp: "dtp:1"}
    assert client.get(f"/v1/jobs/{pt}").json()["schedule"] == "pt:2"


@pytest.mark.parametrize("path", ["/v1/scores", "/v1/jobs"])
@pytest.mark.parametrize("bad", ["bogus:1", "pt:0", "dtp:x", "spd:", "pt:2" + "0" * 5000])
def test_a_bad_schedule_is_a_422_naming_the_grammar(client, path, bad):
    r = client.get(path, params={"schedule": bad})
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["msg"] for e in r.json()["detail"]}
    assert set(errors) == {"schedule"}
    if len(bad) < 100:  # the grammar's own message: what is wrong and every form it takes, from the registry
        assert f"accepted: {ACCEPTED}" in errors["schedule"]
    else:  # refused unread: longer than any schedule the grammar reads
        assert f"at most {MAX_SCHEDULE_CHARS} characters" in errors["schedule"]


@pytest.mark.parametrize("path", ["/v1/scores", "/v1/jobs"])
def test_delta_and_a_schedule_that_disagree_are_a_422(client, path):
    for params, says in (({"schedule": "dtp:2", "delta": 1}, "disagree"),
                         ({"schedule": "pt:2", "delta": 1}, "has no δ")):
        r = client.get(path, params=params)
        assert r.status_code == 422, r.text
        (error,) = r.json()["detail"]
        assert error["field"] == "delta" and says in error["msg"]
