"""docs/settings.md is generated from the settings model and cannot drift: regenerated here and compared, and
every DTP_LAYOUT_* variable the code reads is on it."""

from __future__ import annotations

import re
from pathlib import Path

from app.cli.settings_doc import DOC_PATH, env_var, main, render
from app.core.settings import Settings

REPO = Path(__file__).resolve().parents[3]


def test_the_page_is_what_the_settings_model_generates():
    assert DOC_PATH.read_text() == render(), "docs/settings.md is out of date: run `python -m app.cli.settings_doc`"
    assert main(["--check"]) == 0


def test_every_field_has_a_row_with_its_description_and_default():
    text = render()
    for name, field in Settings.model_fields.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{env_var(name)}` |"))
        assert field.description and field.description.replace("|", "\\|") in row
    assert "| `DTP_LAYOUT_MAX_ACTIVE_TOKENS` | `536870912 (2²⁹)` | integer, ≥ 1 |" in text
    assert "| `DTP_LAYOUT_KEY_CACHE_S` | `2` | number, ≥ 0, ≤ 300 |" in text
    assert "| `DTP_LAYOUT_STORAGE_ROOT` | unset | path (optional) |" in text
    assert "| `DTP_LAYOUT_LOG_FORMAT` | `text` | `text` \\| `json` |" in text


def test_every_variable_the_code_reads_is_documented():
    page = DOC_PATH.read_text()
    sources = [p for d in ("app", "models", "worker", "tests", "bench") for p in (REPO / d).rglob("*.py")]
    read = {m for p in sources for m in re.findall(r"DTP_LAYOUT_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    assert read, "no DTP_LAYOUT_* variable found: the scan is broken"
    assert sorted(v for v in read if f"`{v}`" not in page) == []
