"""`optimise`, `layout` and `score` with --schedule (issue 20): J_σ of the schedule's edges end to end."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from app.cli.main import main
from models.affinity.file import AffinityResult
from models.layouts.layout import contiguous, load
from models.optimise import block_improvement as schedule_block_improvement
from models.optimise import score as schedule_score
from models.optimise.edges import edge_kind
from models.schedules.grammar import resolve_schedule
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen2").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(checkpoint, tmp_path_factory):
    calib = tmp_path_factory.mktemp("data") / "ids.npy"
    np.save(calib, np.random.default_rng(0).integers(0, 97, size=2 * 32))
    out = tmp_path_factory.mktemp("runs") / "dtp2"
    assert main(["optimise", str(checkpoint), "--devices", "2", "--schedule", "dtp:2", "--calib", str(calib),
                 "--calib-sequences", "2", "--calib-seq-len", "32", "--no-export", "--random", "1",
                 "--out", str(out), "--device", "cpu", "--restarts", "1"]) == 0
    return out


def test_optimise_for_a_schedule_records_it_and_reaches_a_fixed_point(run):
    report = json.loads((run / "report.json").read_text())
    assert report["schedule"] == "dtp:2"
    result = AffinityResult.load(run / "affinity.safetensors")
    assert result.schedule == "dtp:2"
    assert {edge_kind(p) for p in result.edges} == {"kv-kv", "neuron-neuron"}  # what dtp:2 adds at 3 layers
    sigma = result.schedule_affinity("fo", resolve_schedule("dtp:2", 3, 2))
    best, base = load(run / "layouts" / "optimised.json"), load(run / "layouts" / "contiguous.json")
    assert best.schedule == "dtp:2" and base.schedule == "dtp:2"
    assert best.score["schedule"] == "dtp:2" and len(best.score["edges"]) == len(sigma.edges)
    assert best.score["J"] == pytest.approx(schedule_score(sigma, best.kv_group_device, best.neuron_device).J)
    assert best.score["J"] >= base.score["J"]
    assert schedule_block_improvement(sigma, best.kv_group_device, best.neuron_device) <= 1e-12


def test_layout_and_score_take_the_schedule(run, tmp_path, capsys):
    aff = str(run / "affinity.safetensors")
    out = tmp_path / "o.json"
    assert main(["layout", "--affinity", aff, "--devices", "2", "--schedule", "dtp:2", "--out", str(out)]) == 0
    lay = load(out)
    assert lay.schedule == "dtp:2" and lay.score["schedule"] == "dtp:2"
    chain = tmp_path / "chain.json"
    assert main(["layout", "--affinity", aff, "--devices", "2", "--out", str(chain)]) == 0  # δ=1: the chain
    assert load(chain).schedule is None and load(chain).made_for == "dtp:1"
    capsys.readouterr()
    assert main(["score", "--affinity", aff, "--schedule", "dtp:2", "--json", str(out), str(chain)]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["schedule"] == "dtp:2" and [r["made_for"] for r in doc["layouts"]] == ["dtp:2", "dtp:1"]
    assert "chain.json" in captured.err and "made for schedule dtp:1" in captured.err
    assert "not shown to rank" in doc["warnings"][0] and "dtp-layout distill" in doc["warnings"][0]
    assert len(doc["warnings"]) == 1
    assert doc["layouts"][0]["J"] >= doc["layouts"][1]["J"] - 1e-12  # each optimised for its own objective
    assert main(["score", "--affinity", aff, str(out)]) == 0  # the chain objective: dtp:2's layout is warned
    assert "made for schedule dtp:2" in capsys.readouterr().err


def test_schedule_refusals(run, checkpoint, tmp_path, capsys):
    aff = str(run / "affinity.safetensors")
    # pt:3 joins every pair of modules; this affinity has only dtp:2's edges
    assert main(["layout", "--affinity", aff, "--devices", "2", "--schedule", "pt:3",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "rerun the affinity pass with schedule pt:3" in capsys.readouterr().err
    for layout_free in ("ladder", "tp"):
        assert main(["layout", "--affinity", aff, "--devices", "2", "--schedule", layout_free,
                     "--out", str(tmp_path / "x.json")]) == 2
        assert "no layout to optimise" in capsys.readouterr().err
        assert main(["optimise", str(checkpoint), "--devices", "2", "--schedule", layout_free, "--calib",
                     "corpus:kjv", "--out", str(tmp_path / "r"), "--device", "cpu"]) == 2
        assert "no layout to optimise" in capsys.readouterr().err and not (tmp_path / "r").exists()
    assert main(["optimise", str(checkpoint), "--devices", "2", "--schedule", "spd:7", "--calib", "corpus:kjv",
                 "--out", str(tmp_path / "r"), "--device", "cpu"]) == 2
    assert "do not exist" in capsys.readouterr().err
    assert main(["score", "--affinity", aff, "--schedule", "dtp:x", str(tmp_path / "x.json")]) == 2
    contiguous_lay = contiguous(AffinityResult.load(aff).shape, 2)
    contiguous_lay.save(tmp_path / "c.json")
    assert main(["score", "--affinity", aff, "--schedule", "dtp:x", str(tmp_path / "c.json")]) == 2
    assert "accepted" in capsys.readouterr().err


def test_optimise_spd_auto_chooses_the_least_sensitive_layers(checkpoint, tmp_path):
    calib = tmp_path / "ids.npy"
    np.save(calib, np.random.default_rng(1).integers(0, 97, size=2 * 16))
    out = tmp_path / "spd"
    assert main(["optimise", str(checkpoint), "--devices", "2", "--schedule", "spd:auto:1", "--calib", str(calib),
                 "--calib-sequences", "2", "--calib-seq-len", "16", "--no-export", "--out", str(out),
                 "--device", "cpu", "--restarts", "0"]) == 0
    report = json.loads((out / "report.json").read_text())
    sensitivities = report["spd_sensitivities"]
    assert len(sensitivities) == 3 and min(sensitivities) > 0
    chosen = min(range(3), key=lambda i: (sensitivities[i], i))
    assert report["schedule"] == f"spd:{chosen}"
    # spd:auto is the cumulative rule: its one round here is each layer dropped alone
    assert [report["spd_rounds"][0][str(i)] for i in range(3)] == pytest.approx(sensitivities)
    assert load(out / "layouts" / "optimised.json").schedule == f"spd:{chosen}"
    # spd:B has one edge per dropped layer: that layer's up edge
    assert [(e["from"], e["to"]) for e in report["layouts"]["optimised"]["edges"]] == [(2 * chosen, 2 * chosen + 1)]


def test_sparse_edges_report_their_kept_mass_and_score_ranks_by_J_sigma(checkpoint, tmp_path, capsys):
    """Issue 29: under a memory limit the neuron→neuron edges are kept sparse, and report.json and `score`
    say how much of their mass they kept; `score --schedule` ranks the layouts by the damage-weighted J_σ."""
    calib = tmp_path / "ids.npy"
    np.save(calib, np.random.default_rng(1).integers(0, 97, size=2 * 32))
    out = tmp_path / "run"
    assert main(["optimise", str(checkpoint), "--devices", "2", "--schedule", "dtp:2", "--calib", str(calib),
                 "--calib-sequences", "2", "--calib-seq-len", "32", "--no-export", "--random", "2",
                 "--edge-memory-limit", "30000", "--out", str(out), "--device", "cpu", "--restarts", "0"]) == 0
    report = json.loads((out / "report.json").read_text())
    result = AffinityResult.load(out / "affinity.safetensors")
    kept = {p: m["fo"].kept_mass for p, m in result.edges.items() if edge_kind(p) == "neuron-neuron"}
    assert report["kept_mass"]["min"] == pytest.approx(min(kept.values())) and min(kept.values()) < 1
    assert any("kept sparse" in note for note in report["notes"])
    capsys.readouterr()
    layouts = sorted((out / "layouts").glob("*.json"))
    assert main(["score", "--affinity", str(out / "affinity.safetensors"), "--schedule", "dtp:2", "--json",
                 *map(str, layouts)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kept_mass"] == report["kept_mass"]
    by_rank = sorted(doc["layouts"], key=lambda r: r["rank"])
    assert [r["rank"] for r in by_rank] == list(range(1, len(layouts) + 1))
    assert all(a["J"] >= b["J"] for a, b in itertools.pairwise(by_rank))
    assert by_rank[0]["name"] == "optimised" and all(r["weighting"] == "damage" for r in by_rank)
    assert main(["score", "--affinity", str(out / "affinity.safetensors"), "--schedule", "dtp:2",
                 *map(str, layouts)]) == 0
    table = capsys.readouterr().out
    assert "of their mass" in table and table.index("optimised") < table.index("contiguous")
