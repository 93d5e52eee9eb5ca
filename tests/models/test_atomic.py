"""Atomic writes: the target holds the old file or the whole new one, and no temporary file stays."""

from __future__ import annotations

import json

import pytest

from models.io.atomic import atomic_write, atomic_write_json, atomic_write_text


def test_writes_create_parents_and_replace_whole_files(tmp_path):
    path = tmp_path / "a" / "b" / "report.json"
    atomic_write_json(path, {"J": 1.5})
    assert json.loads(path.read_text()) == {"J": 1.5}
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "checkpoint.pt"
    atomic_write_text(path, "old")

    def half_then_crash(tmp):
        tmp.write_text("half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_crash)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_writers_that_take_a_path(tmp_path):
    import numpy as np

    path = atomic_write(tmp_path / "ids.bin", lambda tmp: np.arange(5, dtype=np.int64).tofile(tmp))
    assert np.fromfile(path, dtype=np.int64).tolist() == [0, 1, 2, 3, 4]
