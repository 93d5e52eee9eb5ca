"""bench/edge_intervention.py: relabelling one layer's FFN devices moves only the edges into that FFN, and
the broken / repaired arms move the neuron → neuron edge the way they are named; and
bench/schedule_experiment.py's --step0-only on held-out blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import edge_intervention as edge
from bench import schedule_experiment as exp
from models.affinity.file import AffinityResult
from models.layouts import layout as layout_mod
from models.schedules.grammar import resolve_schedule
from tests.tiny import tiny_model


def test_the_relabelled_ffn_moves_only_its_own_edges_and_the_arms_train_from_the_work_directory(tmp_path):
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    text = tmp_path / "one.npy"
    np.save(text, np.random.default_rng(0).integers(0, 97, size=16 * 32))
    common = ["--quick", "--model", str(model_dir), "--devices", "2", "--schedules", "dtp:2", "--seeds", "0",
              "--calib", str(text), "--train", str(text), "--eval", str(text), "--eval2", str(text)]
    exp.main([*common, "--other", "dtp:1", "--step0-only", "--work", str(tmp_path / "source")])
    report = edge.main(["--source", str(tmp_path / "source"), "--work", str(tmp_path / "edge")])

    result = AffinityResult.load(tmp_path / "edge" / "affinity" / "dtp-2" / "affinity.safetensors")
    last = result.shape.num_layers - 1
    ffn = 2 * last + 1
    assert report["layer"] == last and report["edge"] == [ffn - 2, ffn]
    arms = report["arms"]
    edge_name = f"{ffn - 2}->{ffn}"
    assert arms[edge.BROKEN]["into_ffn"][edge_name] <= arms["optimised"]["into_ffn"][edge_name]
    assert arms[edge.REPAIRED]["into_ffn"][edge_name] >= arms["optimised-other"]["into_ffn"][edge_name]
    for name in (edge.BROKEN, edge.REPAIRED):
        assert all(b == ffn for _, b in arms[name]["edges_changed"])  # the last FFN sends no edge
    # written independently of the script: the arm is its parent with the last layer's FFN ids permuted
    broken = layout_mod.load(tmp_path / "edge" / "layouts" / "dtp-2" / f"{edge.BROKEN}.json")
    parent = layout_mod.load(tmp_path / "source" / "layouts" / "dtp-2" / "optimised.json")
    perm = arms[edge.BROKEN]["relabelling"]
    assert np.array_equal(broken.kv_group_device, parent.kv_group_device)
    assert np.array_equal(broken.neuron_device[:last], parent.neuron_device[:last])
    assert [perm[d] for d in parent.neuron_device[last]] == broken.neuron_device[last].tolist()
    assert broken.schedule == str(resolve_schedule("dtp:2", result.shape.num_layers, 2))
    assert json.loads((tmp_path / "edge" / "edge_intervention.json").read_text())["rule"] == edge.EDGE_RULE
    # the work directory is one schedule_experiment trains: the four arms, nothing rebuilt
    trained = exp.main([*common, "--other", "", "--work", str(tmp_path / "edge")])["dtp:2"]
    assert set(trained["final_kl"]) == {"optimised", "optimised-other", edge.BROKEN, edge.REPAIRED}
    # calibration, training and evaluation read one text here: --step0-only must score the arms on the
    # held-out blocks training's step 0 evaluates, not on the first blocks (the calibration's; it did)
    step0 = exp.main([*common, "--other", "", "--step0-only", "--work", str(tmp_path / "edge")])["dtp:2"]
    for arm, kl in step0["step0_kl"].items():
        assert kl[0] == pytest.approx(trained["curves"][arm][0][0][1], rel=1e-4)
