"""`dtp-layout optimise --schedule dtp:2` on a saved tiny mixture-of-experts model (issue 46): the schedule's edges
beyond the paper's chain scored, and per-expert balanced layouts optimised on its J_σ."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.cli.main import main
from models.affinity.file import AffinityResult
from models.layouts.layout import load, validate
from models.optimise import score as schedule_score
from models.optimise.edges import edge_kind
from models.schedules.grammar import resolve_schedule
from tests.tiny import tiny_model


def test_optimise_an_moe_model_for_dtp2(tmp_path) -> None:
    model = tmp_path / "model"
    tiny_model("qwen3_moe").save_pretrained(model)
    calib = tmp_path / "ids.npy"
    np.save(calib, np.random.default_rng(0).integers(0, 97, size=2 * 32))
    out = tmp_path / "run"
    assert main(["optimise", str(model), "--devices", "2", "--schedule", "dtp:2", "--calib", str(calib),
                 "--calib-sequences", "2", "--calib-seq-len", "32", "--no-export", "--random", "1",
                 "--out", str(out), "--device", "cpu", "--restarts", "1"]) == 0
    assert json.loads((out / "report.json").read_text())["schedule"] == "dtp:2"
    result = AffinityResult.load(out / "affinity.safetensors")
    assert result.schedule == "dtp:2" and result.shape.num_experts == 8
    assert {edge_kind(p) for p in result.edges} == {"kv-kv", "neuron-neuron"}  # what dtp:2 adds at 3 layers
    sigma = result.schedule_affinity("fo", resolve_schedule("dtp:2", 3, 2))
    layouts = {name: load(out / "layouts" / f"{name}.json") for name in ("optimised", "contiguous", "random-1000")}
    for lay in layouts.values():
        validate(lay)  # every expert's neurons balanced over the devices on its own
        assert lay.schedule == "dtp:2"
        assert lay.score["J"] == pytest.approx(schedule_score(sigma, lay.kv_group_device, lay.neuron_device).J)
    best = layouts["optimised"].score["J"]
    assert best >= layouts["contiguous"].score["J"] and best >= layouts["random-1000"].score["J"]
