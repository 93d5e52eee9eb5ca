"""bench/objective_positions.py on a tiny model: the recorded arms rescored on the skipped-position affinity
(their layouts untouched), and the skipped-position-optimised arm built and trained alone with the
experiment's recipe."""

from __future__ import annotations

import json

from bench import objective_positions as op
from models.layouts import layout as layout_mod
from tests.bench.sets_kit import quick_trained_set


def test_rescoring_keeps_the_layouts_and_the_trained_arm_runs_alone(tmp_path):
    common, work, trained = quick_trained_set(tmp_path)
    layouts = work / "layouts" / "dtp-2"
    before = {p.name: p.read_bytes() for p in layouts.glob("*.json")}
    out = op.main(["--train", "--set", " ".join([str(work), "dtp:2", str(work / "result-dtp-2.json"), *common]),
                   "--out", str(tmp_path / "out.json")])
    row = out["sets"][0]
    assert {p.name: p.read_bytes() for p in layouts.glob("*.json") if p.name in before} == before
    assert set(row["predicted"]["J_damage"]) == set(trained["final_kl"])
    # the rescored J differs from today's (position 0 left out of the means) but the layouts do not
    assert row["predicted"]["J_damage_skip"] != row["predicted"]["J_damage"]
    assert row["predicted"]["J_damage"] == trained["predictors"]["J_damage"]
    for name, (ordered, separated, wrong) in row["ordered"].items():
        assert ordered + len(wrong) == separated, name
    arm = layout_mod.load(layouts / "optimised-skip1.json")
    assert arm.name == "optimised-skip1" and arm.schedule == trained["resolved"] == "dtp:2"
    assert len(row["trained"]["final_kl"]) == 2 and len(row["trained"]["final_kl_second_domain"]) == 2
    runs = sorted(p.parent.parent.name for p in (work / "distill" / "dtp-2" / "runs").glob("*/seed-*/metrics.json"))
    assert runs.count("optimised-skip1") == 2 and runs.count("optimised") == 2  # the old arms not retrained
    assert json.loads((tmp_path / "out.json").read_text())["skip_positions"] == 1
