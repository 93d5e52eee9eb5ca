"""A trained dtp:2 set of layouts on a tiny llama, as the layout-score benches read one: the schedule
experiment's quick preset on one text of random tokens, seeds 0 and 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench import schedule_experiment as exp
from tests.tiny import tiny_model


def quick_trained_set(tmp_path: Path, *flags: str) -> tuple[list[str], Path, dict[str, Any]]:
    """(the experiment's flags, its work directory, its dtp:2 result); `flags`: more of the experiment's. The one
    text is tmp_path / "one.npy"."""
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    text = tmp_path / "one.npy"
    np.save(text, np.random.default_rng(0).integers(0, 97, size=16 * 32))
    common = ["--quick", "--model", str(model_dir), "--devices", "2", "--seeds", "0,1",
              "--calib", str(text), "--train", str(text), "--eval", str(text), "--eval2", str(text)]
    work = tmp_path / "work"
    trained = exp.main([*common, "--schedules", "dtp:2", "--other", "dtp:1", "--work", str(work), *flags])["dtp:2"]
    return common, work, trained
