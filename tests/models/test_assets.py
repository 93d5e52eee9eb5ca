"""The corpus is found in one place, with a fallback to real text from a package."""

from __future__ import annotations

import pytest

from models import assets


def test_shared_corpus_preferred(monkeypatch, tmp_path):
    (tmp_path / "kjv.txt").write_text("In the beginning")
    monkeypatch.setenv("DTP_LAYOUT_CORPUS_DIR", str(tmp_path))
    assert assets.corpus_file("kjv") == tmp_path / "kjv.txt"


def test_fallback_to_packaged_plays(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "corpus_dirs", lambda: [tmp_path / "absent"])
    monkeypatch.setenv("DTP_LAYOUT_CACHE_DIR", str(tmp_path / "cache"))
    path = assets.corpus_file("kjv")
    text = path.read_text()
    assert path.parent.parent == tmp_path / "cache"
    assert "Hamlet" in text and "ACT I" in text and len(text) > 1_000_000


def test_unknown_corpus_name():
    with pytest.raises(assets.AssetNotFoundError, match="kjv, shakespeare"):
        assets.corpus_file("bible")
