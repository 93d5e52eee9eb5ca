"""An export carries no remote-code reference (issue 41): a tenant's `auto_map` (and `custom_pipelines`) in its
config.json or tokenizer_config.json survived into the exported checkpoint/ and shards/, where anyone serving
with `--trust-remote-code` or loading with `trust_remote_code=True` would fetch and run the code it names."""

from __future__ import annotations

import json

from models.export.resident import export_checkpoint, export_rank_shards, permuted_copy
from models.families import model_shape
from models.layouts import layout as lay
from tests.tiny import byte_tokenizer, tiny_model

REMOTE = {"AutoConfig": "evil/repo--configuration.Config", "AutoModelForCausalLM": "evil/repo--modeling.Model"}


def test_exported_configs_carry_no_auto_map(tmp_path):
    model = tiny_model("llama")
    model.config.auto_map = REMOTE
    model.config.custom_pipelines = {"text-generation": {"impl": "evil.Pipeline"}}
    tokenizer = byte_tokenizer()
    tokenizer.init_kwargs["auto_map"] = {"AutoTokenizer": ["evil/repo--tok.Tokenizer", None]}
    layout = lay.contiguous(model_shape(model.config), 2, 1)
    permuted = permuted_copy(model, layout)
    ckpt = export_checkpoint(permuted, layout, tmp_path / "checkpoint", tokenizer=tokenizer)
    shards = export_rank_shards(permuted, layout, tmp_path / "shards", tokenizer=tokenizer)
    written = {f"{folder.name}/{name}": json.loads((folder / name).read_text())
               for folder in (ckpt, shards) for name in ("config.json", "tokenizer_config.json")}
    assert len(written) == 4
    for name, config in written.items():
        assert "auto_map" not in config and "custom_pipelines" not in config, (name, config)
    assert written["checkpoint/config.json"]["hidden_size"] == model.config.hidden_size  # the rest kept
    assert written["shards/config.json"]["dtp"]["devices"] == 2
