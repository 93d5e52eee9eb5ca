"""What a tenant's job reads, tried as a hostile tenant would: `hf:` names that are `datasets` builders
or paths of the worker's working directory (which, under the embedded default, holds every tenant's
storage), corpora the server does not have, and caches that would tell one tenant what another ran.

On the real components: `dtp-layout serve` (SQLite, its own worker) run from a directory holding its
var/, as `make run` does; the API on Postgres with a Celery worker subprocess on Redis in a working
directory of its own (a remote worker: what its directory holds, the API cannot see); and the API
in-process for the submit-time checks."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.api.main import create_app
from app.core.db import database
from app.core.keys import create_key
from app.core.migrate import upgrade
from app.core.services.sources import SourceError, resolve_data
from app.core.settings import Settings
from app.core.storage.root import tenant_scope
from models.data.calibration import CalibrationSpec, DataError, load_blocks
from models.io.assets import CORPORA, corpus_available, smollm2_gguf
from tests.app.conftest import api_keys_setting
from tests.service_kit import (
    CALIB,
    TINY_MODEL,
    ServeProcess,
    WorkerProcess,
    make_settings,
    provision,
    spec,
    wait_for,
    worker_settings,
)
from worker.jobs import public_error

SECRET = "TEAM-A-PRIVATE-NOTE-7f3a"
# The quickest job that still runs the affinity pass: no export, no extra layouts.
QUICK = {"export": False, "random_layouts": 0, "ablations": False}
# Names a hostile tenant tries: `datasets` builders, which read the data files of the working
# directory, and paths of it (the embedded default's var/ and its storage and database).
BUILDERS = ("hf:text", "hf:json", "hf:csv", "hf:parquet")
VAR_PATHS = ("hf:var", "hf:var/storage", "hf:var/dtp-layout.db")


class Bytes:
    """A tokenizer: one id per byte, EOS 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


def tenant_files(site: Path) -> None:
    """What another tenant has in the working directory: a note, and a job's report under var/storage."""
    notes = site / "acme" / "notes"
    notes.mkdir(parents=True)
    (notes / "notes.txt").write_text(f"{SECRET}\n" * 50)
    report = site / "var" / "storage" / "jobs" / ("a" * 32) / "artifacts" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text('{"format": "dtp-layout-report/1", "text": "' + SECRET + '"}\n')


# ---- the rule, where it is applied: the API's resolve_data and the worker's reader -------------------

def test_hf_names_are_hub_ids_and_never_paths_of_the_working_directory(tmp_path, monkeypatch):
    tenant_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    for source in (*BUILDERS, "hf:var", "hf:wikitext"):  # bare names: builders, local dirs, legacy ids
        with pytest.raises(SourceError, match="owner/name") as err:
            resolve_data(tmp_path / "data", source)
        assert err.value.field == "calibration.source"
    for source in ("hf:acme/notes", "hf:var/storage"):
        with pytest.raises(SourceError, match="working directory") as err:
            resolve_data(tmp_path / "data", source, field="distill.train.source")
        assert err.value.field == "distill.train.source" and SECRET not in str(err.value)
    assert resolve_data(tmp_path / "data", "hf:Salesforce/wikitext:wikitext-2-raw-v1:test").startswith("hf:")
    # The worker's reader refuses them itself, whatever was checked before (a spec stored by an older API,
    # an API whose working directory differs), before `datasets` is even imported.
    for source in (*BUILDERS, "hf:var", "hf:var/storage", "hf:acme/notes"):
        with pytest.raises(DataError) as err:
            load_blocks(CalibrationSpec(source, sequences=1, seq_len=8, text_field="text"), Bytes())
        assert SECRET not in str(err.value) and "notes.txt" not in str(err.value), err.value


def test_the_stored_error_masks_other_jobs_and_other_tenants_cache_entries():
    own, other = "1" * 32, "2" * 32
    message = (f"cannot read STORAGE_ROOT/jobs/{own}/work/blocks.npy nor var/storage/jobs/{other}/artifacts/x "
               f"nor affinity/{tenant_scope('team-b')}/{'f' * 64}/affinity.safetensors "
               f"(ours: affinity/{tenant_scope('team-a')}/{'e' * 64}/affinity.safetensors) "
               f"nor converted/{tenant_scope('team-b')}/{'c' * 32}/config.json "
               f"(ours: converted/{tenant_scope('team-a')}/{'d' * 32}/config.json)")
    shown = public_error(message, job_id=own, tenant="team-a")
    assert f"jobs/{own}/work/blocks.npy" in shown and other not in shown and "jobs/…/artifacts/x" in shown
    assert tenant_scope("team-b") not in shown and tenant_scope("team-a") in shown
    assert f"converted/…/{'c' * 32}" in shown and f"converted/{tenant_scope('team-a')}/{'d' * 32}" in shown
    assert len(public_error("x" * 10_000, job_id=own, tenant=None)) < 2100


# ---- corpora at submit ----------------------------------------------------------------------------------

def corpus_bodies(name: str) -> dict[str, dict]:
    """A job naming corpus:NAME in each data field, by the field."""
    source = f"corpus:{name}"
    return {"calibration.source": spec(calibration={"source": source}, **QUICK),
            "distill.train.source": spec(distill={"train": {"source": source, "seq_len": 16}}, **QUICK),
            "distill.eval.source": spec(distill={"train": {"source": CALIB, "seq_len": 16},
                                                 "eval": {"source": source, "sequences": 4}}, **QUICK)}


def problems(response) -> dict[str, str]:
    return {e["field"]: e["msg"] for e in response.json()["detail"]}


@pytest.fixture
def idle_api(tmp_path):
    """The API in-process on SQLite, with nobody consuming its queue: submissions are only checked."""
    def make(**overrides) -> TestClient:
        settings = make_settings(tmp_path / "var", max_active_jobs=50, **overrides)
        settings.var_dir.mkdir(parents=True, exist_ok=True)
        upgrade(settings.database_url)
        provision(settings)
        return TestClient(create_app(settings))
    return make


def test_a_corpus_the_workers_do_not_have_is_422_naming_it(idle_api, tmp_path, monkeypatch):
    monkeypatch.setenv("DTP_LAYOUT_CORPUS_DIR", str(tmp_path / "no-corpora"))  # only packaged/shared texts
    # DTP_LAYOUT_CORPORA=auto (the default): what this process can read, as the embedded default's
    # worker on the same machine can.
    with idle_api() as client:
        for name in CORPORA:
            for field, body in corpus_bodies(name).items():
                r = client.post("/v1/jobs", json=body)
                if corpus_available(name):
                    assert r.status_code == 202, (name, field, r.text)
                else:
                    assert r.status_code == 422 and f"corpus:{name} is not installed" in problems(r)[field], r.text
    # Set for workers elsewhere: the names the operator says they have, whatever this process has.
    with idle_api(corpora="shakespeare") as client:
        for field, body in corpus_bodies("kjv").items():
            r = client.post("/v1/jobs", json=body)
            assert r.status_code == 422, r.text
            assert "corpus:kjv is not installed" in problems(r)[field] and "corpus:shakespeare" in problems(r)[field]
    with idle_api(corpora="kjv, shakespeare") as client:
        assert all(client.post("/v1/jobs", json=body).status_code == 202 for body in corpus_bodies("kjv").values())
    with pytest.raises(ValidationError, match="DTP_LAYOUT_CORPORA"):
        Settings(var_dir=tmp_path, corpora="bible")


# ---- a cache read at submit: a GGUF's metadata ---------------------------------------------------------

def test_the_gguf_metadata_cache_is_per_tenant(idle_api, tmp_path, capsys):
    """Reading a GGUF's metadata takes seconds, so the API caches it; per tenant, or a submit answered at
    once would tell a tenant that another named this model. (A file already there when the server
    started is read then, for everyone: test_models_there_at_start_are_read_before_the_first_submit.)"""
    from app.core.services import sources

    api = idle_api(api_keys=api_keys_setting({"alice": "alice-key-0123456789abcdef",
                                              "bob": "bob-key-0123456789abcdef"}))
    model_root = tmp_path / "var" / "models"
    body = {"model": {"id": "smol.gguf"}, "devices": 3,
            "calibration": {"source": "corpus:shakespeare", "sequences": 8, "seq_len": 256}}
    seconds = {}
    with api as client:
        model_root.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(smollm2_gguf(), model_root / "smol.gguf")  # after the start: not read by its warm-up
        for who in ("alice", "alice", "bob"):
            t0 = time.perf_counter()
            r = client.post("/v1/jobs", json=body, headers={"X-API-Key": f"{who}-key-0123456789abcdef"})
            seconds.setdefault(who, []).append(round(time.perf_counter() - t0, 3))
            assert r.status_code == 202, r.text
            scopes = {key[0] for key in sources._config_cache if key[1].endswith("smol.gguf")}
            assert scopes == ({"alice"} if who == "alice" else {"alice", "bob"}), scopes
    with capsys.disabled():
        print(f"\nsubmit seconds with a GGUF model: {seconds}")


@pytest.mark.serial  # a latency bound (< 2 s)
def test_models_there_at_start_are_read_before_the_first_submit(idle_api, tmp_path, monkeypatch):
    """Issue 30 item 10: the first submit naming the packaged GGUF took 9.2 s (its metadata read then).
    What submit reads of the models under the model root and in the hub cache is read at start, into
    the cache every tenant shares; the first submit of each format reads nothing (a changed file is
    read again: the cache is keyed by path, size and mtime)."""
    import json

    from app.core.services import sources

    hub = tmp_path / "hf" / "hub" / "models--team--model"
    (hub / "refs").mkdir(parents=True)
    (hub / "refs" / "main").write_text("0" * 40)
    (hub / "snapshots" / ("0" * 40)).mkdir(parents=True)
    model_root = tmp_path / "var" / "models"
    model_root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(smollm2_gguf(), model_root / "smol.gguf")
    api = idle_api()  # the tiny checkpoint folder provisioned under the model root
    config = json.loads((model_root / TINY_MODEL / "config.json").read_text())
    (hub / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    sources.forget_configs()
    reads = []
    for name in ("_read_gguf_config", "_read_json_config"):
        real = getattr(sources, name)
        monkeypatch.setattr(sources, name, lambda path, real=real: reads.append(path.name) or real(path))
    calibration = {"source": "corpus:shakespeare", "sequences": 8, "seq_len": 256}
    bodies = {"gguf": {"model": {"id": "smol.gguf"}, "devices": 3, "calibration": calibration},
              "checkpoint": {"model": {"id": TINY_MODEL}, "devices": 2, "calibration": calibration},
              "hub": {"model": {"id": "team/model"}, "devices": 2, "calibration": calibration}}
    with api as client:
        at_start = sorted(reads)
        assert at_start == ["config.json", "config.json", "smol.gguf"], at_start
        for fmt, body in bodies.items():
            t0 = time.perf_counter()
            r = client.post("/v1/jobs", json=body)
            assert r.status_code == 202, (fmt, r.text)
            assert r.json()["id"] and time.perf_counter() - t0 < 2.0, fmt
        assert sorted(reads) == at_start  # nothing read again
        changed = {**config, "torch_dtype": "float32", "note": "changed"}
        (model_root / TINY_MODEL / "config.json").write_text(json.dumps(changed))
        assert client.post("/v1/jobs", json=bodies["checkpoint"]).status_code == 202
        assert sorted(reads) == sorted([*at_start, "config.json"])  # changed: read again


# ---- remote workers: the API on Postgres, a Celery worker on Redis in a directory of its own -----------

@pytest.fixture(scope="module")
def remote(tmp_path_factory, postgres_server, redis_broker):
    root = tmp_path_factory.mktemp("reads")
    settings = worker_settings(root, postgres_server, redis_broker, "reads", max_active_jobs=50)
    site = root / "worker-cwd"
    tenant_files(site)
    db = database(settings.database_url)
    keys = {"alice": create_key(db, name="alice", tenant="team-a"), "bob": create_key(db, name="bob", tenant="team-b")}
    worker = WorkerProcess(settings, root / "worker.log", cwd=site).start()
    try:
        with TestClient(create_app(settings)) as client:
            yield settings, client, keys, worker
    finally:
        worker.stop()


def submit(client, keys, who, body) -> dict:
    r = client.post("/v1/jobs", json=body, headers={"X-API-Key": keys[who]})
    assert r.status_code == 202, r.text
    return r.json()


def finish(client, keys, who, job, worker=None) -> dict:
    client.headers["X-API-Key"] = keys[who]
    return wait_for(client, job["id"], timeout=180, worker=worker)


def affinity_across_tenants(client, keys, worker=None) -> list[tuple[str, bool]]:
    """alice twice, then bob twice, the same model and calibration: (who, affinity_cached) per job."""
    seen = []
    for who in ("alice", "alice", "bob", "bob"):
        done = finish(client, keys, who, submit(client, keys, who, spec(**QUICK)), worker)
        assert done["status"] == "succeeded", done
        seen.append((who, done["affinity_cached"]))
    return seen


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_remote_worker_refuses_an_hf_name_that_is_a_path_of_its_directory(remote):
    _settings, client, keys, worker = remote
    assert not Path("acme/notes").exists()  # the API's working directory: it sees nothing to refuse
    for body in (spec(calibration={"source": "hf:acme/notes"}, **QUICK),
                 spec(distill={"train": {"source": "hf:acme/notes"}}, **QUICK)):
        done = finish(client, keys, "bob", submit(client, keys, "bob", body), worker)
        assert done["status"] == "failed", done
        assert "working directory" in done["error"], done["error"]
        assert SECRET not in done["error"] and "notes.txt" not in done["error"]
        assert done["stages_done"] == [], done  # refused before the first stage, distillation sources too


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_remote_the_affinity_cache_is_per_tenant(remote):
    settings, client, keys, worker = remote
    assert affinity_across_tenants(client, keys, worker) == [
        ("alice", False), ("alice", True), ("bob", False), ("bob", True)]
    scopes = {p.name for p in (settings.storage / "affinity").iterdir()}
    assert {tenant_scope("team-a"), tenant_scope("team-b")} <= scopes


# ---- the embedded default: `dtp-layout serve` from the directory holding var/ -----------------------------

@pytest.mark.worker
def test_embedded_default_reads_only_what_the_tenant_may(tmp_path, monkeypatch):
    site = tmp_path / "site"  # `make run`'s directory: var/ (database, broker, storage) is in it
    var = site / "var"
    provision(make_settings(var))
    tenant_files(site)
    corpora = tmp_path / "no-corpora"
    monkeypatch.setenv("DTP_LAYOUT_CORPUS_DIR", str(corpora))  # what corpus_available answers here
    keys = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef"}
    serve = ServeProcess(var, cwd=site, DTP_LAYOUT_API_KEYS=api_keys_setting(keys),
                         DTP_LAYOUT_CORPUS_DIR=str(corpora), DTP_LAYOUT_MAX_ACTIVE_JOBS="50")
    try:
        serve.start()
        with httpx.Client(base_url=serve.url, timeout=60) as client:
            # hf: names spelt like var/ and its contents, or like the builders: 422 at submit, naming
            # the field, echoing nothing of another tenant's files.
            for source in (*VAR_PATHS, *BUILDERS, "hf:acme/notes"):
                for field, body in (("calibration.source", spec(calibration={"source": source}, **QUICK)),
                                    ("distill.train.source", spec(distill={"train": {"source": source}}, **QUICK))):
                    r = client.post("/v1/jobs", json=body, headers={"X-API-Key": keys["bob"]})
                    assert r.status_code == 422, (source, r.text)
                    assert field in problems(r) and SECRET not in r.text and "a" * 32 not in r.text, r.text
            # A corpus this install lacks: 422 naming it; one it has: accepted (then cancelled).
            for name in CORPORA:
                r = client.post("/v1/jobs", json=corpus_bodies(name)["calibration.source"],
                                headers={"X-API-Key": keys["bob"]})
                if corpus_available(name):
                    assert r.status_code == 202, r.text
                    client.post(f"/v1/jobs/{r.json()['id']}/cancel", headers={"X-API-Key": keys["bob"]})
                else:
                    assert r.status_code == 422 and f"corpus:{name}" in problems(r)["calibration.source"], r.text
            assert affinity_across_tenants(client, keys) == [
                ("alice", False), ("alice", True), ("bob", False), ("bob", True)]
    finally:
        serve.stop()
    scopes = {p.name for p in (var / "storage" / "affinity").iterdir()}
    assert scopes == {tenant_scope("alice"), tenant_scope("bob")}, scopes
