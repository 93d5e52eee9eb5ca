"""docs/service.md's job-spec tables are generated from the job spec (models/run/jobspec.py) and cannot drift:
regenerated here and compared, and every declared field has its row with its doc."""

from __future__ import annotations

from app.cli.jobspec_doc import DOC_PATH, REGIONS, begin_marker, end_marker, main, render
from models.run.jobspec import FIELDS, GROUPS


def test_the_tables_are_what_the_job_spec_generates():
    page = DOC_PATH.read_text()
    assert page == render(page), "docs/service.md is out of date: run `python -m app.cli.jobspec_doc`"
    assert main(["--check"]) == 0


def test_every_field_and_block_has_a_row_with_its_doc():
    page = DOC_PATH.read_text()
    tables = "".join(page.split(begin_marker(r), 1)[1].split(end_marker(r), 1)[0] for r in REGIONS)
    rows = {line.split(" | ", 1)[0].removeprefix("| `").removesuffix("`"): line for line in tables.splitlines()
            if line.startswith("| `")}
    for field in FIELDS:
        assert field.rule.doc.replace("|", "\\|") in rows[field.path], field.path
    for group in GROUPS:
        assert group.doc.replace("|", "\\|") in rows[group.path], group.path
    assert "| `devices` | required | integer, ≥ 1 and ≤ 1024 |" in tables
    assert "| `model.dtype` | `float32` | `float32` \\| `bfloat16` \\| `float16` |" in tables


def test_a_stale_row_is_caught(tmp_path, monkeypatch):
    page = DOC_PATH.read_text()
    stale = page.replace("| `delta` | `1` |", "| `delta` | `2` |", 1)
    assert stale != page and render(stale) == page
    target = tmp_path / "service.md"
    target.write_text(stale)
    monkeypatch.setattr("app.cli.jobspec_doc.DOC_PATH", target)
    assert main(["--check"]) == 1
