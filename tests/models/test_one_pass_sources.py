"""Issue 27: one pass each, fed by a resident or a streamed layer source (models.streaming.source), gives the
same results to the bit: the evaluation (its dense stream through the Hugging Face layers either way) and
the export's files, manifest included (both written by models.export.writer). The equality tests of
tests/models/test_streaming.py hold to their tolerances; these hold exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.evaluation.evaluate import evaluate
from models.export.writer import export_layout
from models.families import model_shape
from models.layouts.resolve import resolve_layout
from models.streaming.layer_source import StreamedModel
from models.streaming.source import ResidentModel, layer_source
from tests.tiny import THREE_WAY, tiny_model, tokens


def _saved(tmp_path: Path, case: str) -> tuple[torch.nn.Module, Path]:
    model = tiny_model(case, num_hidden_layers=3, **THREE_WAY)
    model.save_pretrained(tmp_path / "src")
    return model, tmp_path / "src"


def test_the_evaluation_is_the_same_to_the_bit_resident_or_streamed(tmp_path: Path) -> None:
    model, src = _saved(tmp_path, "qwen3")
    layout = resolve_layout("random:3", shape=model_shape(model.config), devices=3, delta=1, layouts_dir=None)
    for schedule in (None, "pt:2"):
        resident = evaluate(model, layout, tokens(3, 16), batch_size=2, schedule=schedule)
        streamed = evaluate(StreamedModel.open(src, dtype=torch.float32), layout, tokens(3, 16), batch_size=2,
                            schedule=schedule)
        assert streamed.as_dict() == resident.as_dict()


def test_the_export_writes_the_same_files_resident_or_streamed(tmp_path: Path) -> None:
    model, src = _saved(tmp_path, "llama-tied-headdim")
    layout = resolve_layout("random:5", shape=model_shape(model.config), devices=3, delta=1, layouts_dir=None)
    for name, source in (("mem", layer_source(model)), ("str", StreamedModel.open(src, dtype=torch.float32))):
        out = tmp_path / name
        export_layout(source, layout, checkpoint_dir=out / "checkpoint", shards_dir=out / "shards",
                      dtype=torch.bfloat16, max_shard_bytes=40_000)
    files = sorted(p.relative_to(tmp_path / "mem") for p in (tmp_path / "mem").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "str") for p in (tmp_path / "str").rglob("*") if p.is_file())
    assert Path("checkpoint/model.safetensors.index.json") in files
    for rel in files:
        assert (tmp_path / "mem" / rel).read_bytes() == (tmp_path / "str" / rel).read_bytes(), rel
    manifest = json.loads((tmp_path / "str" / "shards" / "manifest.json").read_text())
    assert manifest["dtype"] == "bfloat16" and manifest["compute_dtype"] == "float32"


def test_a_loaded_model_is_wrapped_and_a_source_is_itself(tmp_path: Path) -> None:
    model, src = _saved(tmp_path, "llama")
    assert isinstance(layer_source(model), ResidentModel) and layer_source(model).model is model
    streamed = StreamedModel.open(src, dtype=torch.float32)
    assert layer_source(streamed) is streamed


def test_a_streamed_source_refuses_the_further_edges_before_any_pass_runs(tmp_path: Path) -> None:
    from models.affinity.edges import schedule_affinity_pass
    from models.schedules.grammar import resolve_schedule
    from models.streaming.memory_plan import MemoryLimitError

    _, src = _saved(tmp_path, "llama")
    seen: list[float] = []
    with pytest.raises(MemoryLimitError, match=r"streamed layer by layer to fit max_memory, and schedule pt:2 "
                                               r"needs edges beyond the paper's chain.*a schedule of the chain"):
        schedule_affinity_pass(StreamedModel.open(src, dtype=torch.float32), tokens(2, 8),
                               schedule=resolve_schedule("pt:2", 3, 3), progress=lambda _s, f: seen.append(f))
    assert seen == []
