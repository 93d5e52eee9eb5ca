"""What the export records for a server (issue 28), checked without vLLM: the manifest's `serving` record
(the full per-module table, the last-δ scale, family, L, the layout's provenance), shards/config.json naming
the DTP architecture with the same table, and the checks a server makes of it at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from models.export.resident import export_rank_shards, permuted_copy
from models.export.serving_manifest import DTP_ARCHITECTURES, ServingError, check_entry, hf_overrides
from models.families import model_shape
from models.layouts import layout as lay
from models.schedules.grammar import resolve_schedule
from tests.tiny import fresh


def _export(tmp_path: Path, case: str, schedule: str, last_scale: str = "sqrt") -> Path:
    model = fresh(case)
    layout = lay.random(model_shape(model.config), 2, 1, seed=3)
    return export_rank_shards(permuted_copy(model, layout), layout, tmp_path / "shards", schedule=schedule,
                              last_scale=last_scale)  # type: ignore[arg-type]


@pytest.mark.parametrize(("case", "schedule"), [("llama", "dtp:2"), ("qwen3", "pt:2"), ("qwen2", "spd:0,2"),
                                                ("mistral", "ladder")])
def test_the_manifest_and_config_carry_the_table(tmp_path: Path, case: str, schedule: str) -> None:
    shards = _export(tmp_path, case, schedule)
    manifest = json.loads((shards / "manifest.json").read_text())
    serving = manifest["serving"]
    table = resolve_schedule(schedule, 3, 2)
    assert serving["table"] == json.loads(json.dumps(table.as_dict()))
    assert (serving["family"], serving["num_layers"], serving["devices"], serving["last_scale"]) == (
        case, 3, 2, "sqrt")
    assert serving["provenance"]["layout"] == manifest["layout"]["name"] and len(
        serving["provenance"]["layout_sha256"]) == 64
    config = json.loads((shards / "config.json").read_text())
    assert config["architectures"] == [DTP_ARCHITECTURES[case]]
    assert config["dtp"] == hf_overrides(serving)["dtp"]
    loaded = AutoConfig.from_pretrained(shards)  # transformers still reads it by model_type
    assert loaded.model_type == case
    assert check_entry(loaded.dtp, num_layers=3, tp_size=2) == table


def test_the_last_scale_is_recorded(tmp_path: Path) -> None:
    shards = _export(tmp_path, "llama", "dtp:1", last_scale="one")
    entry = json.loads((shards / "config.json").read_text())["dtp"]
    assert entry["last_scale"] == "one" and entry["own_scale"][-1] == 1.0
    assert check_entry(entry, num_layers=3, tp_size=2).last_scale == "one"


def test_a_server_refuses_another_tp_size_and_a_tampered_table(tmp_path: Path) -> None:
    entry = json.loads((_export(tmp_path, "llama", "dtp:1") / "config.json").read_text())["dtp"]
    with pytest.raises(ServingError, match=r"L=2 devices .* tensor-parallel size is 4.*--tensor-parallel-size 2"):
        check_entry(entry, num_layers=3, tp_size=4)
    with pytest.raises(ServingError, match="num_layers=3, the model has 5"):
        check_entry(entry, num_layers=5, tp_size=2)
    with pytest.raises(ServingError, match="not the one schedule 'dtp:1' resolves to"):
        check_entry({**entry, "other_arrival": [None] * 6}, num_layers=3, tp_size=2)
    with pytest.raises(ServingError, match="no 'dtp' entry"):
        check_entry(None)


def test_the_runtime_still_reads_the_shards(tmp_path: Path) -> None:
    from models.runtime.shards import read_shard_set

    shards = read_shard_set(_export(tmp_path, "qwen3", "dtp:1"))
    assert shards.family.name == "qwen3" and shards.schedule == "dtp:1"
