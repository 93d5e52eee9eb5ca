"""The dashboard's server side without a browser: the pages and static files, their headers, the
module graph of the scripts, no network at run time, the files in the wheel, the model catalogue,
and the stage timeline the job view carries (on the embedded SQLite database; no servers)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import JobEvent
from app.core.migrate import upgrade
from app.core.services.timeline import stage_timeline
from app.ui.router import CSP, model_catalogue, static_assets
from tests.app.conftest import api_keys_setting
from tests.service_kit import TINY_MODEL, make_settings, provision

ROOT = Path(__file__).resolve().parents[3]
STATIC = ROOT / "app" / "ui" / "static"


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    s = make_settings(tmp_path_factory.mktemp("ui"))
    provision(s)
    upgrade(s.database_url)
    return s


@pytest.fixture(scope="module")
def client(settings):
    with TestClient(create_app(settings)) as c:
        yield c


def test_every_route_is_the_page_with_its_base_and_a_strict_csp(client):
    for path in ("/ui/", "/ui/submit", "/ui/jobs/0123abcd", "/ui/scores?model=x", "/ui/no/such/page"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), path
        assert '<base href="/ui/">' in r.text and "__BASE__" not in r.text
        assert r.headers["content-security-policy"] == CSP and "'unsafe-inline'" not in CSP
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["cache-control"] == "no-store"
    home = client.get("/", follow_redirects=False)
    assert home.status_code == 307 and home.headers["location"] == "/ui/"
    # the address `dtp-layout serve` prints: the page lives under /ui/ (its routes and relative links)
    for path, location in (("/ui", "/ui/"), ("/ui?x=1", "/ui/?x=1")):
        bare = client.get(path, follow_redirects=False)
        assert bare.status_code == 307 and bare.headers["location"] == location, path
    assert client.head("/ui", follow_redirects=False).status_code == 307
    assert client.head("/ui/").status_code == 200


def test_base_follows_the_mount_point(settings):
    with TestClient(create_app(settings), root_path="/layout") as c:
        assert '<base href="/layout/ui/">' in c.get("/ui/jobs/x").text
        assert c.get("/ui", follow_redirects=False).headers["location"] == "/layout/ui/"


def test_static_files_with_types_etags_and_404s(client):
    r = client.get("/ui/static/js/main.js")
    assert r.status_code == 200 and r.headers["content-type"] == "text/javascript; charset=utf-8"
    etag = r.headers["etag"]
    assert client.get("/ui/static/js/main.js", headers={"If-None-Match": etag}).status_code == 304
    assert client.get("/ui/static/css/app.css").headers["content-type"].startswith("text/css")
    assert client.get("/ui/static/favicon.svg").headers["content-type"] == "image/svg+xml"
    for bad in ("/ui/static/nope.js", "/ui/static/%2e%2e/router.py", "/ui/static/js%2f..%2f..%2frouter.py",
                "/ui/static/"):
        r = client.get(bad)
        assert r.status_code == 404 and r.headers["content-type"] == "application/json", bad
    for dotted in ("/ui/static/../router.py", "/ui/static/js/../../router.py"):  # the client normalises these
        r = client.get(dotted)
        assert "APIRouter" not in r.text and r.headers["content-type"].startswith(("text/html", "application/json"))


def test_the_script_modules_resolve_and_nothing_comes_from_the_network():
    """Every relative import of every module is a packaged file; no URL other than the SVG namespace."""
    assets = static_assets()
    assert {p.relative_to(STATIC).as_posix() for p in STATIC.rglob("*") if p.is_file()} == set(assets)
    index = assets["index.html"].body.decode()
    for ref in re.findall(r'(?:src|href)="(static/[^"]+)"', index):
        assert ref.removeprefix("static/") in assets, ref
    for name, asset in assets.items():
        text = asset.body.decode()
        for url in re.findall(r"https?://[^\s\"')]+", text):
            assert url == "http://www.w3.org/2000/svg", (name, url)
        if name.endswith(".js"):
            for ref in re.findall(r'from\s+"(\.[^"]+)"', text):
                target = (Path(name).parent / ref).as_posix()
                target = re.sub(r"[^/]+/\.\./", "", target.replace("/./", "/")).removeprefix("./")
                assert target in assets, (name, ref)
            assert not re.search(r"\.(innerHTML|outerHTML)\s*=|insertAdjacentHTML|\beval\(|new Function", text), name


def test_the_wheel_ships_the_dashboard(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("dtp_layout-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"app/ui/static/{p.relative_to(STATIC).as_posix()}" for p in STATIC.rglob("*") if p.is_file()}
    assert expected <= names, expected - names
    assert "app/ui/router.py" in names and "app/client/http.py" in names


def test_model_catalogue_lists_what_a_job_may_name(settings, client, tmp_path):
    items = client.get("/ui/api/models").json()["items"]
    assert {"id": TINY_MODEL, "gguf_files": []} in items
    root = tmp_path / "models"
    (root / "team" / "m").mkdir(parents=True)
    (root / "team" / "m" / "config.json").write_text("{}")
    (root / "g").mkdir()
    (root / "g" / "w.Q4.gguf").write_bytes(b"GGUF")
    (root / "solo.gguf").write_bytes(b"GGUF")
    (root / "empty").mkdir()
    (root / ".hidden").mkdir()
    (root / "outside").symlink_to(tmp_path)
    assert model_catalogue(root) == [{"id": "g", "gguf_files": ["w.Q4.gguf"]}, {"id": "solo.gguf", "gguf_files": []},
                                     {"id": "team/m", "gguf_files": []}]


def test_model_catalogue_needs_the_key_when_keys_are_on(settings):
    keyed = settings.model_copy(update={"api_keys": api_keys_setting({"ci": "k1"})})
    with TestClient(create_app(keyed)) as c:
        assert c.get("/ui/api/models").status_code == 401
        assert c.get("/ui/api/models", headers={"X-API-Key": "k1"}).status_code == 200
        assert c.get("/ui/").status_code == 200  # the page itself is public; it asks for the key


# ---- the stage timeline ----------------------------------------------------------------------------

T0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=UTC)


def ev(at: float, kind: str, **columns) -> JobEvent:
    """A job event `at` seconds after T0, as the worker records it (naive UTC)."""
    return JobEvent(job_id="j" * 32, at=(T0 + timedelta(seconds=at)).replace(tzinfo=None), kind=kind, **columns)


def test_timeline_of_a_job_that_ran_through():
    history = [ev(0, "submitted"), ev(2, "claimed", attempt=1), ev(2, "stage-start", stage="loading", attempt=1),
               ev(5, "stage-done", stage="loading", seconds=2.9), ev(5, "stage-start", stage="affinity", attempt=1),
               ev(9, "stage-done", stage="affinity", seconds=4.0), ev(9, "succeeded", attempt=1)]
    entries = stage_timeline(history, status="succeeded", created_at=T0.replace(tzinfo=None))
    assert [(e["stage"], e["state"], e["seconds"]) for e in entries] == [
        ("queued", "done", 2.0), ("loading", "done", 2.9), ("affinity", "done", 4.0)]
    assert entries[1]["started_at"] == T0 + timedelta(seconds=2)
    assert entries[1]["finished_at"] == T0 + timedelta(seconds=5)


def test_timeline_of_an_interrupted_resumed_and_failed_job():
    history = [ev(0, "submitted"), ev(1, "claimed", attempt=1), ev(1, "stage-start", stage="loading", attempt=1),
               ev(3, "stage-done", stage="loading", seconds=2), ev(3, "stage-start", stage="affinity", attempt=1),
               ev(70, "requeued", reason="lease expired"), ev(71, "claimed", attempt=2),
               ev(71, "stage-start", stage="loading", attempt=2), ev(73, "stage-done", stage="loading", seconds=2),
               ev(73, "stage-start", stage="affinity", attempt=2), ev(80, "failed", stage="affinity", attempt=2)]
    entries = stage_timeline(history, status="failed", created_at=T0.replace(tzinfo=None))
    assert [(e["stage"], e["attempt"], e["state"]) for e in entries] == [
        ("queued", 0, "done"), ("loading", 1, "done"), ("affinity", 1, "interrupted"), ("loading", 2, "done"),
        ("affinity", 2, "failed")]
    assert entries[2]["seconds"] == 67.0 and entries[-1]["seconds"] == 7.0


def test_timeline_while_running_and_when_cancelled_in_the_queue():
    history = [ev(0, "submitted"), ev(1, "claimed", attempt=1), ev(1, "stage-start", stage="calibration", attempt=1)]
    now = T0 + timedelta(seconds=11)
    [queued, running] = stage_timeline(history, status="running", created_at=T0.replace(tzinfo=None), now=now)
    assert queued["state"] == "done" and queued["seconds"] == 1.0
    assert running["state"] == "running" and running["finished_at"] is None and running["seconds"] == 10.0
    entries = stage_timeline([ev(0, "submitted"), ev(4, "cancel-requested")], status="cancelled",
                             created_at=T0.replace(tzinfo=None))
    assert [(e["stage"], e["state"], e["seconds"]) for e in entries] == [("queued", "done", 4.0)]
    [waiting] = stage_timeline([ev(0, "submitted")], status="queued", created_at=T0.replace(tzinfo=None),
                               now=T0 + timedelta(seconds=3))
    assert waiting["state"] == "running" and waiting["seconds"] == 3.0
