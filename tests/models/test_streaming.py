"""Streamed passes (models.streamed_*) against the in-memory ones on tiny random models of every family,
L ∈ {2, 3}: the same affinity, layouts and evaluation, bit-identical exported tensors; the memory plan's
refusals; and the command line choosing to stream under --max-memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.affinity.scoring import affinity_pass
from models.evaluation.evaluate import evaluate
from models.export.files import load_rank_shards
from models.export.resident import export_checkpoint, export_copy, export_rank_shards
from models.export.writer import export_layout
from models.families import model_shape
from models.io.sizes import SizeError, parse_size
from models.layouts.resolve import resolve_layout
from models.streaming.layer_source import CheckpointReader, StreamedModel
from models.streaming.memory_plan import MemoryLimitError, plan_memory
from models.streaming.safetensors_reader import SafetensorsWriter
from tests.tiny import FAMILY_CASES, THREE_WAY, tiny_model, tokens

CASES = [(case, devices) for case in FAMILY_CASES for devices in (2, 3)]


def _saved(tmp_path: Path, case: str, devices: int, **save: Any) -> tuple[Any, Path]:
    model = tiny_model(case, num_hidden_layers=3, **(THREE_WAY if devices == 3 else {}))
    src = tmp_path / "src"
    model.save_pretrained(src, **save)
    return model, src


def _layout(model: Any, devices: int) -> Any:
    return resolve_layout("random:7", shape=model_shape(model.config), devices=devices, delta=1, layouts_dir=None)


def _all_tensors(directory: Path, pattern: str = "*.safetensors") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob(pattern)):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize(("case", "devices"), CASES)
def test_streamed_affinity_equals_in_memory(tmp_path: Path, case: str, devices: int) -> None:
    model, src = _saved(tmp_path, case, devices, max_shard_size="20KB")  # several files and an index
    blocks = tokens(5, 16)
    dense = affinity_pass(model, blocks, batch_size=2)
    spill = tmp_path / "spill" if devices == 3 else None  # hidden states on disk for half the cases
    if spill is not None:
        spill.mkdir()
    streamed = affinity_pass(StreamedModel.open(src, dtype=torch.float32), blocks, batch_size=2, spill_dir=spill)
    for name in ("up_fo", "up_add", "down"):
        ours, theirs = getattr(streamed, name), getattr(dense, name)
        assert len(ours) == len(theirs) == (3 if name != "down" else 2)
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    assert spill is None or not any(spill.iterdir())  # the scratch files are gone


@pytest.mark.parametrize(("case", "devices"), CASES)
def test_streamed_export_is_bit_identical(tmp_path: Path, case: str, devices: int) -> None:
    model, src = _saved(tmp_path, case, devices)
    layout = _layout(model, devices)
    dtype = torch.bfloat16 if devices == 2 else torch.float32
    permuted = export_copy(model, layout, dtype)
    export_checkpoint(permuted, layout, tmp_path / "mem" / "checkpoint")
    export_rank_shards(permuted, layout, tmp_path / "mem" / "shards", compute_dtype=torch.float32)
    export_layout(StreamedModel(src, model.config, dtype=torch.float32), layout,
                  checkpoint_dir=tmp_path / "str" / "checkpoint", shards_dir=tmp_path / "str" / "shards", dtype=dtype,
                  max_shard_bytes=30_000)
    ours, theirs = _all_tensors(tmp_path / "str" / "checkpoint"), _all_tensors(tmp_path / "mem" / "checkpoint")
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype == dtype and torch.equal(ours[k], theirs[k]) for k in ours)
    index = json.loads((tmp_path / "str" / "checkpoint" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours)
    for rank in range(devices):
        pattern = f"model-rank-{rank}-part-0.safetensors"
        ours, theirs = _all_tensors(tmp_path / "str" / "shards", pattern), _all_tensors(tmp_path / "mem" / "shards",
                                                                                         pattern)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    manifests = [json.loads((tmp_path / d / "shards" / "manifest.json").read_text()) for d in ("str", "mem")]
    assert {k: v for k, v in manifests[0].items() if k != "files"} == {
        k: v for k, v in manifests[1].items() if k != "files"}
    for name in ("config.json", "generation_config.json"):
        ours_text = (tmp_path / "str" / "checkpoint" / name).read_text()
        assert ours_text == (tmp_path / "mem" / "checkpoint" / name).read_text()
    reloaded, _ = load_rank_shards(tmp_path / "str" / "shards")  # sha256 of every file checked
    assert torch.equal(reloaded.model.layers[1].mlp.up_proj.weight, permuted.model.layers[1].mlp.up_proj.weight)


@pytest.mark.parametrize(("case", "devices"), CASES)
def test_streamed_eval_equals_in_memory(tmp_path: Path, case: str, devices: int) -> None:
    model, src = _saved(tmp_path, case, devices)
    layout = _layout(model, devices)
    blocks = tokens(3, 16)
    dense = evaluate(model, layout, blocks, batch_size=2)
    ours = evaluate(StreamedModel.open(src, dtype=torch.float32), layout, blocks, batch_size=2)
    for name in ("dense_ppl", "dtp_ppl", "kl"):
        assert getattr(ours, name) == pytest.approx(getattr(dense, name), rel=1e-5, abs=1e-7), name
    assert (ours.schedule, ours.tokens, ours.layout) == (dense.schedule, dense.tokens, dense.layout)


def test_released_layers_go_back_to_meta(tmp_path: Path) -> None:
    _, src = _saved(tmp_path, "llama-tied-headdim", 2)
    streamed = StreamedModel.open(src, dtype=torch.float32)
    assert all(p.is_meta for p in streamed.model.parameters())
    with streamed.layers(0, 1) as (first, _second):
        assert not first.self_attn.q_proj.weight.is_meta
        assert streamed.layer(2).self_attn.q_proj.weight.is_meta
    assert all(p.is_meta for p in streamed.model.parameters())
    streamed.load_head()
    assert streamed.model.lm_head.weight is streamed.model.model.embed_tokens.weight  # tied


def test_safetensors_writer_checks_the_declared_order(tmp_path: Path) -> None:
    writer = SafetensorsWriter(tmp_path / "a.safetensors", [("x", torch.float32, (2, 3)), ("y", torch.bfloat16, (4,))])
    with pytest.raises(ValueError, match="expected x"):
        writer.write("y", torch.zeros(4, dtype=torch.bfloat16))
    writer.write("x", torch.arange(6.0).view(2, 3))
    writer.write("y", torch.ones(4, dtype=torch.bfloat16))
    writer.close()
    back = load_file(tmp_path / "a.safetensors")
    assert torch.equal(back["x"], torch.arange(6.0).view(2, 3)) and back["y"].dtype == torch.bfloat16
    assert set(CheckpointReader(tmp_path).names()) == {"x", "y"}


@pytest.mark.parametrize(("text", "value"), [("2GiB", 2 * 2**30), ("500MB", 500_000_000), ("1.5 gb", 1_500_000_000),
                                             ("4194304", 4 * 2**20), ("3MiB", 3 * 2**20)])
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "2XB", "-1GB", "", "12"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(SizeError, match="size must"):
        parse_size(text)


def test_memory_plan_streams_when_the_model_does_not_fit_and_refuses_below_the_streamed_need() -> None:
    config = tiny_model("llama").config
    free = plan_memory(config, dtype="float32", command="optimise", limit=None, tokens=64, batch_tokens=32)
    assert not free.stream
    # one byte under the in-memory need: streamed
    under = plan_memory(config, dtype="float32", command="optimise", limit=free.in_memory - 1, tokens=64,
                        batch_tokens=32)
    assert under.stream and under.streamed < under.in_memory
    with pytest.raises(MemoryLimitError, match=r"needs at least .* the memory limit \(max_memory\) is 1.0 MiB"):
        plan_memory(config, dtype="float32", command="optimise", limit=2**20, tokens=64, batch_tokens=32)


def test_cli_streams_under_max_memory_and_says_why_it_cannot(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    from app.cli.main import main

    model, src = _saved(tmp_path, "qwen2", 2)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 97, 512).astype(np.int64))
    common = ["--devices", "2", "--calib", str(ids), "--calib-sequences", "4", "--calib-seq-len", "16",
              "--restarts", "0", "--device", "cpu", "--no-convert-cache"]
    assert main(["optimise", str(src), *common, "--out", str(tmp_path / "mem")]) == 0
    # under the in-memory need (two copies of the weights for the export) and above the streamed one
    plan = plan_memory(model.config, dtype="float32", command="optimise", limit=None, tokens=64, batch_tokens=64,
                       export=True)
    limit = str(plan.in_memory - 1)
    assert main(["optimise", str(src), *common, "--out", str(tmp_path / "str"), "--max-memory", limit]) == 0
    assert "memory: streamed" in capsys.readouterr().err
    for name in ("optimised", "contiguous"):
        assert (tmp_path / "str" / "layouts" / f"{name}.json").read_text() == (
            tmp_path / "mem" / "layouts" / f"{name}.json").read_text()
    ours, theirs = _all_tensors(tmp_path / "str" / "checkpoint"), _all_tensors(tmp_path / "mem" / "checkpoint")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert main(["optimise", str(src), *common, "--out", str(tmp_path / "no"), "--max-memory", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "needs at least" in err and "the memory limit (max_memory) is 1.0 MiB" in err
    assert not (tmp_path / "no" / "affinity.safetensors").exists()
    assert main(["export", str(src), "--devices", "2", "--layout", str(tmp_path / "mem" / "layouts" / "optimised.json"),
                 "--device", "cpu", "--no-convert-cache", "--out", str(tmp_path / "exp"), "--stream"]) == 0
    ours = _all_tensors(tmp_path / "exp" / "shards", "model-rank-1-part-0.safetensors")
    theirs = _all_tensors(tmp_path / "mem" / "shards", "model-rank-1-part-0.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert main(["eval", str(src), "--devices", "2", "--data", str(ids), "--blocks", "2", "--seq-len", "16",
                 "--device", "cpu", "--no-convert-cache", "--json", "--max-memory", "1MiB"]) == 2
    assert "eval of this model needs at least" in capsys.readouterr().err
