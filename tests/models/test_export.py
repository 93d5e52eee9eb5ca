"""Sharded export: the permuted HF checkpoint keeps the dense logits, rank shards rebuild the same DTP."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from models.export.files import ExportError, atomic_dir, load_rank_shards
from models.export.resident import export_checkpoint, export_rank_shards, permuted_copy
from models.families import model_shape
from models.io.digest import sha256_file
from models.layouts import layout as lay
from models.sim.dtp import DTPModel
from tests.tiny import tiny_model, tokens


@pytest.fixture(params=["llama-tied-headdim", "qwen2", "qwen3"])
def exported(request, tmp_path):
    model = tiny_model(request.param)
    layout = lay.random(model_shape(model.config), 2, 1, seed=11)
    permuted = permuted_copy(model, layout)
    ckpt = export_checkpoint(permuted, layout, tmp_path / "checkpoint", max_shard_size="20KB")
    shards = export_rank_shards(permuted, layout, tmp_path / "shards")
    return model, layout, permuted, ckpt, shards


def test_checkpoint_loads_with_hf_and_keeps_dense_logits(exported):
    model, _, _, ckpt, _ = exported
    # A small max_shard_size forces the sharded form with its index.
    assert (ckpt / "model.safetensors.index.json").is_file()
    assert not list(ckpt.glob("*.bin"))
    reloaded = AutoModelForCausalLM.from_pretrained(ckpt, use_safetensors=True).eval()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-4, rtol=0)


def test_unsharded_checkpoint_below_limit(tmp_path):
    model = tiny_model("llama")
    layout = lay.contiguous(model_shape(model.config), 2, 1)
    ckpt = export_checkpoint(permuted_copy(model, layout), layout, tmp_path / "c")
    assert (ckpt / "model.safetensors").is_file()
    assert not (ckpt / "model.safetensors.index.json").exists()
    assert json.loads((ckpt / "dtp_layout.json").read_text())["format"] == "dtp-layout/1"


def test_rank_shards_rebuild_the_same_dtp_model(exported):
    _, layout, _, ckpt, shards = exported
    from_ckpt = AutoModelForCausalLM.from_pretrained(ckpt, use_safetensors=True).eval()
    from_shards, shard_layout = load_rank_shards(shards)
    assert shard_layout.kv_group_device.tolist() == layout.kv_group_device.tolist()
    assert shard_layout.neuron_device.tolist() == layout.neuron_device.tolist()
    ids = tokens()
    with torch.no_grad():
        a = DTPModel(from_ckpt, devices=2, delta=1)(ids)
        b = DTPModel(from_shards, devices=2, delta=1)(ids)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_rank_shard_contents_and_manifest(exported):
    model, layout, permuted, _, shards = exported
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["format"] == "dtp-layout-shards/1"
    assert manifest["devices"] == 2 and manifest["delta"] == 1
    assert manifest["layout"]["neuron_device"] == layout.neuron_device.tolist()
    for entry in manifest["files"]:
        path = shards / entry["name"]
        assert entry["name"] == f"model-rank-{entry['rank']}-part-0.safetensors"
        assert path.stat().st_size == entry["size"]
        assert sha256_file(path) == entry["sha256"]
    rank1 = load_file(str(shards / "model-rank-1-part-0.safetensors"))
    state = permuted.state_dict()
    hd = model_shape(model.config).head_dim
    q = state["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(rank1["model.layers.0.self_attn.q_proj.weight"], q[q.shape[0] // 2:])
    down = state["model.layers.2.mlp.down_proj.weight"]
    torch.testing.assert_close(rank1["model.layers.2.mlp.down_proj.weight"], down[:, down.shape[1] // 2:])
    o = state["model.layers.1.self_attn.o_proj.weight"]
    torch.testing.assert_close(rank1["model.layers.1.self_attn.o_proj.weight"], o[:, o.shape[1] // 2:])
    assert rank1["model.layers.0.self_attn.k_proj.weight"].shape[0] == model.config.num_key_value_heads // 2 * hd
    torch.testing.assert_close(rank1["model.norm.weight"], state["model.norm.weight"])
    torch.testing.assert_close(rank1["model.embed_tokens.weight"], state["model.embed_tokens.weight"])


def test_corrupted_shard_is_detected(exported):
    shards = exported[4]
    path = shards / "model-rank-0-part-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="sha256"):
        load_rank_shards(shards)


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("crash")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite(tmp_path):
    model = tiny_model("llama")
    layout = lay.contiguous(model_shape(model.config), 2, 1)
    permuted = permuted_copy(model, layout)
    export_rank_shards(permuted, layout, tmp_path / "s")
    with pytest.raises(ExportError, match="already exists"):
        export_rank_shards(permuted, layout, tmp_path / "s")
    export_rank_shards(permuted, layout, tmp_path / "s", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
