"""Artifact kinds are declared once (models/run/files.py ARTIFACTS: kind, stage, names, content type): each
stage publishes only what it writes, the worker publishes nothing declared nowhere, a download is served as
its declaration says (as the old rule by extension did), and the stages' recorders take their kinds from it."""

from __future__ import annotations

import contextlib
import mimetypes
from pathlib import PurePosixPath
from types import SimpleNamespace

import pytest

from app.api.routers.artifacts import MEDIA_TYPES, media_type
from app.core.lease import Lease
from models.run import stages
from models.run.files import (
    ARTIFACT_KINDS,
    ARTIFACTS,
    DISTILL_SUMMARY,
    REPORT_FILE,
    ArtifactSpec,
    UndeclaredArtifact,
    artifact_spec,
    kind_of,
    published_by,
)
from models.run.stage_names import STAGES
from worker.publishing import DISTILL_FILES, Publisher


def test_every_declaration_names_a_stage_that_writes_it():
    assert len({a.pattern for a in ARTIFACTS}) == len(ARTIFACTS)
    assert ARTIFACT_KINDS == ("affinity", "checkpoint", "shards", "distill", "report")
    assert {a.stage for a in ARTIFACTS} <= {*STAGES, None}
    assert [a.pattern for a in published_by("distilling")] == [f"distill/{name}" for name in DISTILL_FILES]
    assert kind_of(DISTILL_SUMMARY) == "distill" and kind_of(REPORT_FILE) == "report"
    assert kind_of("checkpoint/model.safetensors") == "checkpoint" and kind_of("shards/manifest.json") == "shards"
    assert artifact_spec("layouts/optimised.json") is None
    with pytest.raises(UndeclaredArtifact, match="declared nowhere"):
        kind_of("stability.json")


def test_a_declaration_the_stage_does_not_write_is_refused(monkeypatch):
    stages._check_artifacts()
    monkeypatch.setattr(stages, "ARTIFACTS", (*ARTIFACTS, ArtifactSpec("blocks", "affinity", "blocks.npy", None, "")))
    with pytest.raises(RuntimeError, match=r"'blocks\.npy' is published by 'affinity'"):
        stages._check_artifacts()


def test_a_download_is_served_as_declared_which_is_what_the_extension_said():
    def by_extension(name):  # the rule before the declaration
        filename = PurePosixPath(name).name
        return "application/json" if filename.endswith(".json") else (
            mimetypes.guess_type(filename)[0] or "application/octet-stream")

    for artifact in ARTIFACTS:
        name = artifact.pattern.replace("*", "model.safetensors")
        assert media_type(name) == by_extension(name) and media_type(name) in MEDIA_TYPES, name
    assert media_type("checkpoint/config.json") == "application/json"


def _publisher(tmp_path, uploaded):
    """Just enough of a run's publisher for `Publisher.upload`: no artifact recorded yet, a store that takes files."""
    session = SimpleNamespace(scalars=lambda _query: SimpleNamespace(all=lambda: []))
    db = SimpleNamespace(session=lambda: contextlib.nullcontext(session))
    storage = SimpleNamespace(publish=lambda path, key, sha256: uploaded.append(key))
    publisher = Publisher(db=db, settings=None, storage=storage, spec=None, lease=Lease("0" * 32, "w:1", 1),
                          owner=None, fingerprint="f", work=tmp_path, check=lambda: None)
    publisher.reserve = lambda paths: None  # the quota's reservation: tests/app/core/test_quota_races.py
    (tmp_path / "f").write_text("x")
    return publisher, tmp_path / "f"


def test_the_worker_publishes_nothing_declared_nowhere(tmp_path):
    uploaded: list[str] = []
    publisher, path = _publisher(tmp_path, uploaded)
    published = publisher.upload([(REPORT_FILE, "report", path)])
    assert [(name, kind) for name, kind, *_ in published] == [(REPORT_FILE, "report")] and len(uploaded) == 1
    for name, kind in (("layouts/optimised.json", "layouts"), (REPORT_FILE, "distill")):
        with pytest.raises(UndeclaredArtifact):
            publisher.upload([(name, kind, path)])
    assert len(uploaded) == 1
