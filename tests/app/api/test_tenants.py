"""Keys and tenants, on the real Postgres (with Redis as the broker) and on the embedded SQLite: two
tenants (one with two keys) and an admin; every job-scoped endpoint answers another tenant 404, the
same answer as for a job that does not exist; listings and /v1/scores show only the caller's jobs;
the admin sees and cancels all. Also `dtp-layout keys` and the open-bind refusal of `serve`."""

from __future__ import annotations

import hashlib
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.api.auth import bind_refusal, is_loopback
from app.api.main import create_app
from app.cli.main import main as cli_main
from app.core.db import ApiKey, Job, database
from app.core.keys import create_key, key_digest, revoke_key, settings_entry
from app.core.migrate import upgrade
from tests.service_kit import make_settings, own_prefix, provision, seed_finished_job, spec

BACKENDS = [pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis]), "sqlite"]


@pytest.fixture(scope="module", params=BACKENDS)
def world(request, tmp_path_factory):
    """Settings, a client and the keys: alice and alice2 (tenant team-a), bob (team-b), root (admin)."""
    root = tmp_path_factory.mktemp(f"tenants-{request.param}")
    overrides = {}
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        redis_broker = request.getfixturevalue("redis_broker")
        broker = redis_broker[0]
        overrides = {"database_url": server.create_database("dtp_tenants"), "broker_url": broker,
                     "broker_key_prefix": own_prefix(redis_broker, "tenants")}
    settings = make_settings(root, key_cache_s=0, max_active_jobs=50, **overrides)
    upgrade(settings.database_url)
    provision(settings)
    db = database(settings.database_url)
    keys = {"alice": create_key(db, name="alice", tenant="team-a"),
            "alice2": create_key(db, name="alice2", tenant="team-a"),
            "bob": create_key(db, name="bob", tenant="team-b"),
            "root": create_key(db, name="root", admin=True)}
    with TestClient(create_app(settings)) as client:
        yield settings, client, keys


def as_(keys, who):
    return {"X-API-Key": keys[who]}


def job_paths(job_id):
    return [f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/layouts", f"/v1/jobs/{job_id}/layouts/optimised",
            f"/v1/jobs/{job_id}/artifacts", f"/v1/jobs/{job_id}/artifacts/report.json",
            f"/v1/jobs/{job_id}/metrics"]


def test_every_job_endpoint_is_404_to_another_tenant_and_open_to_the_admin(world):
    settings, client, keys = world
    finished, _ = seed_finished_job(settings, model_id="matrix-model", owner="team-a")
    missing = uuid.uuid4().hex
    for path in job_paths(finished):
        for who in ("alice", "alice2", "root"):
            r = client.get(path, headers=as_(keys, who))
            assert r.status_code == 200, (who, path, r.text)
        other = client.get(path, headers=as_(keys, "bob"))
        nothing = client.get(path.replace(finished, missing), headers=as_(keys, "bob"))
        assert other.status_code == nothing.status_code == 404, (path, other.text)
        # The same answer as for a job that does not exist: existence is not disclosed.
        assert other.json()["detail"].replace(finished, "ID") == nothing.json()["detail"].replace(missing, "ID")
        assert other.json()["field"] == nothing.json()["field"] == "job_id"
    body = client.get(f"/v1/jobs/{finished}/artifacts/shards/blob.bin", headers=as_(keys, "root"))
    assert body.status_code == 200 and len(body.content) == 5000
    assert client.get(f"/v1/jobs/{finished}/artifacts/shards/blob.bin", headers=as_(keys, "bob")).status_code == 404


def test_submissions_belong_to_the_tenant_and_listings_show_only_its_jobs(world):
    _settings, client, keys = world
    a = client.post("/v1/jobs", json=spec(), headers=as_(keys, "alice")).json()
    a2 = client.post("/v1/jobs", json=spec(), headers=as_(keys, "alice2")).json()
    b = client.post("/v1/jobs", json=spec(), headers=as_(keys, "bob")).json()
    assert a["owner"] == a2["owner"] == "team-a" and b["owner"] == "team-b"

    def ids(who, **params):
        listing = client.get("/v1/jobs", params={"limit": 200, **params}, headers=as_(keys, who)).json()
        return {j["id"] for j in listing["items"]}, {j["owner"] for j in listing["items"]}

    alice_ids, alice_owners = ids("alice")
    assert {a["id"], a2["id"]} <= alice_ids and b["id"] not in alice_ids and alice_owners == {"team-a"}
    bob_ids, bob_owners = ids("bob")
    assert b["id"] in bob_ids and not {a["id"], a2["id"]} & bob_ids and bob_owners == {"team-b"}
    assert ids("bob", owner="team-a") == (set(), set())  # a filter never widens the scope
    root_ids, _ = ids("root")
    assert {a["id"], a2["id"], b["id"]} <= root_ids
    assert ids("root", owner="team-b")[1] == {"team-b"}


def test_cancel_is_scoped_and_the_admin_cancels_all(world):
    settings, client, keys = world
    a = client.post("/v1/jobs", json=spec(), headers=as_(keys, "alice")).json()
    b = client.post("/v1/jobs", json=spec(), headers=as_(keys, "bob")).json()
    r = client.post(f"/v1/jobs/{a['id']}/cancel", headers=as_(keys, "bob"))
    assert r.status_code == 404 and r.json()["field"] == "job_id"
    with database(settings.database_url).session() as session:
        assert session.get(Job, a["id"]).status == "queued" and not session.get(Job, a["id"]).cancel_requested
    assert client.post(f"/v1/jobs/{b['id']}/cancel", headers=as_(keys, "alice")).status_code == 404
    assert client.post(f"/v1/jobs/{a['id']}/cancel", headers=as_(keys, "alice2")).json()["status"] == "cancelled"
    r = client.post(f"/v1/jobs/{b['id']}/cancel", headers=as_(keys, "root"))
    assert r.status_code == 202 and r.json()["status"] == "cancelled"


def test_scores_answer_from_the_callers_own_jobs(world):
    settings, client, keys = world
    first_a, _ = seed_finished_job(settings, model_id="ci-model", owner="team-a")
    b, _ = seed_finished_job(settings, model_id="ci-model", owner="team-b")
    params = {"model": "ci-model", "devices": 2}
    assert client.get("/v1/scores", params=params, headers=as_(keys, "alice")).json()["job_id"] == first_a
    assert client.get("/v1/scores", params=params, headers=as_(keys, "bob")).json()["job_id"] == b
    # Team A submits again: what team B's CI reads does not change.
    newer_a, _ = seed_finished_job(settings, model_id="ci-model", owner="team-a")
    assert client.get("/v1/scores", params=params, headers=as_(keys, "bob")).json()["job_id"] == b
    assert client.get("/v1/scores", params=params, headers=as_(keys, "alice2")).json()["job_id"] == newer_a
    assert client.get("/v1/scores", params=params, headers=as_(keys, "root")).json()["job_id"] == newer_a
    assert client.get("/v1/scores", params={**params, "owner": "team-b"},
                      headers=as_(keys, "root")).json()["job_id"] == b
    none = client.get("/v1/scores", params={"model": "ci-model", "owner": "team-a"}, headers=as_(keys, "bob"))
    assert none.status_code == 404 and none.json()["field"] == "model"


def test_missing_unknown_and_revoked_keys_are_401(world):
    settings, client, _keys = world
    for headers in ({}, {"X-API-Key": "dtpk_" + "x" * 43}, {"X-API-Key": "k" * 5000}):
        r = client.get("/v1/jobs", headers=headers)
        assert r.status_code == 401 and r.json()["field"] == "X-API-Key", r.text
        assert r.headers["www-authenticate"] == "X-API-Key"
    assert client.get("/healthz").status_code == 200  # probes need no key
    temp = create_key(database(settings.database_url), name=f"temp-{uuid.uuid4().hex[:6]}", tenant="team-a")
    assert client.get("/v1/jobs", headers={"X-API-Key": temp}).status_code == 200
    assert revoke_key(database(settings.database_url), next(iter(_names(settings, temp))))
    r = client.get("/v1/jobs", headers={"X-API-Key": temp})
    assert r.status_code == 401 and "revoked" in r.json()["detail"]


def _names(settings, key):
    with database(settings.database_url).session() as session:
        return set(session.scalars(select(ApiKey.name).where(ApiKey.digest == key_digest(key))))


def test_keys_are_stored_as_digests_only(world):
    settings, _client, keys = world
    with database(settings.database_url).session() as session:
        rows = {r.name: r for r in session.scalars(select(ApiKey))}
    for name, key in keys.items():
        assert rows[name].digest == hashlib.sha256(key.encode()).hexdigest()
        assert key not in {rows[name].name, rows[name].tenant, rows[name].digest}
    assert rows["root"].admin and not rows["alice"].admin and rows["alice2"].tenant == "team-a"


def test_settings_keys_and_the_open_api(tmp_path):
    """No key: open (jobs have no owner). A settings key (digest only) makes it keyed; a table key too,
    and revoking the last key never reopens the API."""
    for name in ("open", "settings", "required"):
        (tmp_path / name).mkdir()
    settings = make_settings(tmp_path / "open", key_cache_s=0)
    upgrade(settings.database_url)
    provision(settings)
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/jobs", json=spec())
        assert r.status_code == 202 and r.json()["owner"] is None
        key = create_key(database(settings.database_url), name="only")
        assert client.get("/v1/jobs").status_code == 401
        assert client.get("/v1/jobs", headers={"X-API-Key": key}).status_code == 200
        revoke_key(database(settings.database_url), "only")
        assert client.get("/v1/jobs").status_code == 401  # still keyed: nobody gets in
    ops = "dtpk_" + "o" * 43
    keyed = make_settings(tmp_path / "settings", api_keys=settings_entry("ops", ops, admin=True))
    upgrade(keyed.database_url)
    with TestClient(create_app(keyed)) as client:
        assert client.get("/v1/jobs").status_code == 401
        assert client.get("/v1/jobs", headers={"X-API-Key": ops}).status_code == 200
    required = make_settings(tmp_path / "required", require_keys=True)
    upgrade(required.database_url)
    with TestClient(create_app(required)) as client:
        assert client.get("/v1/jobs").status_code == 401


def test_keys_command_create_list_revoke(tmp_path, capsys):
    var = str(tmp_path / "var")
    assert cli_main(["keys", "create", "ci-team-a", "--tenant", "team-a", "--var-dir", var]) == 0
    out = capsys.readouterr()
    key = out.out.strip()
    assert key.startswith("dtpk_") and len(key) == 48 and key not in out.err
    assert cli_main(["keys", "create", "ops", "--admin", "--var-dir", var]) == 0
    capsys.readouterr()
    assert cli_main(["keys", "create", "ci-team-a", "--var-dir", var]) == 2  # names are never reused
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["keys", "create", "bad name", "--var-dir", var]) == 2
    capsys.readouterr()
    assert cli_main(["keys", "list", "--var-dir", var]) == 0
    listing = capsys.readouterr().out
    assert "ci-team-a" in listing and "team-a" in listing and "ops" in listing and "active" in listing
    assert key not in listing and key_digest(key) not in listing
    assert cli_main(["keys", "revoke", "ci-team-a", "--var-dir", var]) == 0
    assert cli_main(["keys", "revoke", "ci-team-a", "--var-dir", var]) == 2
    capsys.readouterr()
    assert cli_main(["keys", "list", "--var-dir", var]) == 0
    assert "revoked" in capsys.readouterr().out
    settings = make_settings(tmp_path / "var")
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/jobs", headers={"X-API-Key": key}).status_code == 401
    # --settings stores nothing and prints the entry (the digest, never the key).
    assert cli_main(["keys", "create", "env-key", "--admin", "--settings", "--var-dir", var]) == 0
    out = capsys.readouterr()
    env_key = out.out.strip()
    assert f"env-key:sha256:{key_digest(env_key)}:admin" in out.err and env_key not in out.err
    assert make_settings(tmp_path / "x", api_keys=f"env-key:sha256:{key_digest(env_key)}:admin").key_entries()


def test_serve_refuses_to_listen_off_loopback_without_keys(tmp_path, capsys):
    code = cli_main(["serve", "--host", "0.0.0.0", "--no-worker", "--var-dir", str(tmp_path / "var")])
    err = capsys.readouterr().err
    assert code == 2 and "--insecure-open" in err and "keys create" in err
    assert bind_refusal("0.0.0.0", keyed=True, insecure_open=False) is None
    assert bind_refusal("10.0.0.5", keyed=False, insecure_open=True) is None
    assert bind_refusal("::", keyed=False, insecure_open=False)
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host) and bind_refusal(host, keyed=False, insecure_open=False) is None
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
