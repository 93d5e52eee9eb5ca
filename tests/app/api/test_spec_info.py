"""GET /v1/spec on the embedded SQLite database (no servers): the defaults are what the request models
fill in, the required fields are the ones a submission is refused without, the sources are what this
install and its data root have, and the route is keyed like the rest of /v1."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.migrate import upgrade
from app.core.schemas.jobs import DistillJobSpec, JobSpec
from app.core.services.spec_info import data_catalogue, spec_info
from models.distill.recipe import DistillRecipe
from models.io.assets import available_corpora
from tests.app.conftest import api_keys_setting
from tests.service_kit import CALIB, make_settings, provision

GIVEN = {"model": {"id": "m"}, "devices": 2, "calibration": {"source": "s"}}


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    s = make_settings(tmp_path_factory.mktemp("spec"))
    provision(s)
    upgrade(s.database_url)
    return s


@pytest.fixture(scope="module")
def info(settings):
    with TestClient(create_app(settings)) as c:
        r = c.get("/v1/spec")
    assert r.status_code == 200, r.text
    return r.json()


def test_defaults_are_what_a_submission_that_leaves_the_fields_out_gets(info):
    # The model fills in every field a minimal spec leaves out; take away what was given: the defaults.
    filled = JobSpec.model_validate(GIVEN).model_dump(mode="json")
    del filled["model"]["id"], filled["devices"], filled["calibration"]["source"]
    assert info["defaults"] == filled
    distill = DistillJobSpec.model_validate({}).model_dump(mode="json")
    assert {k: v for k, v in info["distill_defaults"].items() if k != "recipe"} == \
        {k: v for k, v in distill.items() if k != "recipe"}
    # the recipe's own defaults, not the request model's nulls
    assert info["distill_defaults"]["recipe"] == {**DistillRecipe().as_dict(), "betas": list(DistillRecipe().betas)}


def test_required_fields_are_those_a_submission_is_refused_without(settings, info):
    assert info["required"] == ["model.id", "devices", "calibration.source"]
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/jobs", json={"model": {}, "calibration": {}})
    assert r.status_code == 422
    assert sorted(d["field"] for d in r.json()["detail"]) == sorted(info["required"])


def test_sources_are_the_installs_corpora_then_the_data_root(info):
    names = [s["source"] for s in info["sources"]]
    corpora = [f"corpus:{n}" for n in available_corpora()]
    assert names == [*corpora, CALIB]
    assert all(s["kind"] == "corpus" and s["description"] for s in info["sources"][:len(corpora)])
    assert "corpus:shakespeare" in corpora  # the packaged text: every install has it
    # the example runs here: its source is one of them, its other values are the API's first example's
    assert info["example"]["calibration"]["source"] in names
    assert info["distill_example"]["train"]["source"] in names
    assert JobSpec.model_validate({**info["example"], "distill": info["distill_example"]})
    assert info["ablations"]["add"]["paper"][3] == "fo-score" and info["random_seed_base"] == 1000
    assert "optimised-restarts-0" in info["ablations"]["fo"]["restarts"]


def test_the_data_root_lists_only_plain_names_inside_it(tmp_path):
    root = tmp_path / "data"
    (root / "texts").mkdir(parents=True)
    (root / "texts" / "a.txt").write_text("x")
    (root / "team" / "deep").mkdir(parents=True)
    (root / "team" / "ids.npy").write_bytes(b"")
    (root / "team" / "deep" / "too-deep.txt").write_text("x")  # third level: not listed (its directory is)
    (root / "rows.jsonl").write_text("{}")
    (root / "notes.md").write_text("x")  # not something calibration reads
    (root / ".hidden.txt").write_text("x")
    (root / "bad name.txt").write_text("x")  # a name a submission would refuse
    (root / "outside").symlink_to(tmp_path)  # resolves outside the root
    (root / "empty").mkdir()
    # a directory of .txt and each .txt in it are both sources
    assert data_catalogue(root) == ["rows.jsonl", "team/deep", "team/ids.npy", "texts", "texts/a.txt"]
    assert data_catalogue(root, limit=2) == ["rows.jsonl", "team/deep"]
    assert data_catalogue(tmp_path / "missing") == []


def test_an_uninstalled_corpus_is_never_the_example(settings, monkeypatch):
    """Where the example's corpus is missing, the example takes the first source this server has."""
    import app.core.services.spec_info

    monkeypatch.setattr(app.core.services.spec_info, "available_corpora", lambda: [])
    info = spec_info(settings=settings)
    assert [s["source"] for s in info["sources"]] == [CALIB]
    assert info["example"]["calibration"]["source"] == CALIB
    assert info["distill_example"]["train"]["source"] == CALIB


def test_keyed_like_the_rest_of_v1(settings):
    keyed = settings.model_copy(update={"api_keys": api_keys_setting({"ci": "k1"})})
    with TestClient(create_app(keyed)) as c:
        assert c.get("/v1/spec").status_code == 401
        assert c.get("/v1/spec", headers={"X-API-Key": "k1"}).status_code == 200
        r = c.get("/v1/spec?source=x", headers={"X-API-Key": "k1"})
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "source"


def test_the_artifacts_are_the_declared_ones(info):
    # what the dashboard's artifact list reads what each kind is from (models/run/files.py ARTIFACTS)
    from dataclasses import asdict

    from models.run.files import ARTIFACTS

    assert info["artifacts"] == [asdict(a) for a in ARTIFACTS]
