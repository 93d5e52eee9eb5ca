"""The export of the MoE families (issue 46): the permuted checkpoint is what `save_pretrained` writes (the
family's per-expert names), keeps the model's function (permutation invariance, fp32), and the rank shards
reassemble it, rank r holding of every expert exactly the neurons the layout puts on device r.

The references are independent of the export: transformers' own `save_pretrained` files and `from_pretrained`
loading, and the layout's neuron → device array read literally (unit e·I_e + j is expert e's neuron j).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from models.export.files import MANIFEST, load_rank_shards, shard_file_name
from models.export.resident import export_rank_shards, permuted_copy
from models.export.writer import export_layout
from models.families import model_shape
from models.layouts.layout import contiguous
from models.streaming.source import ResidentModel
from tests.models.moe_kit import MOE_CASES, balanced_moe_layout, expert_shape, moe_model
from tests.tiny import tokens

CASES = sorted(MOE_CASES)
L = 2


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


@pytest.fixture(scope="module", params=CASES)
def exported(request: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One case's model, a random per-expert balanced layout, and its export (checkpoint and shards, permuting
    the original's tensors as they are written)."""
    case = request.param
    model = moe_model(case)
    layout = balanced_moe_layout(model, L, seed=3)
    out = tmp_path_factory.mktemp(f"moe-{case}")
    export_layout(ResidentModel(model), layout, checkpoint_dir=out / "checkpoint", shards_dir=out / "shards",
                  dtype=torch.float32)
    return {"case": case, "model": model, "layout": layout, "out": out}


def _expert_names(case: str, layer: int, expert: int) -> dict[str, str]:
    """The per-expert names save_pretrained writes (transformers' own, read from its files in the test below)."""
    if case == "mixtral":
        base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return {"gate": f"{base}.w1.weight", "up": f"{base}.w3.weight", "down": f"{base}.w2.weight"}
    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return {"gate": f"{base}.gate_proj.weight", "up": f"{base}.up_proj.weight", "down": f"{base}.down_proj.weight"}


@pytest.mark.parametrize("case", CASES)
def test_contiguous_export_is_what_save_pretrained_writes(case: str, tmp_path: Path) -> None:
    """Under the contiguous layout (no neuron moves) the checkpoint holds save_pretrained's names and tensors."""
    model = moe_model(case)
    model.save_pretrained(tmp_path / "hf")
    layout = contiguous(model_shape(model.config), L, 1)
    export_layout(ResidentModel(model), layout, checkpoint_dir=tmp_path / "ckpt", shards_dir=None,
                  dtype=torch.float32)
    want, got = _checkpoint(tmp_path / "hf"), _checkpoint(tmp_path / "ckpt")
    assert sorted(got) == sorted(want)
    assert _expert_names(case, 1, expert_shape(model.config)[0] - 1)["down"] in got
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def test_permuted_checkpoint_keeps_the_logits(exported: dict[str, Any]) -> None:
    """from_pretrained of the permuted checkpoint computes the original's logits (fp32); its experts did move."""
    model, out = exported["model"], exported["out"]
    loaded = AutoModelForCausalLM.from_pretrained(out / "checkpoint", dtype=torch.float32).eval()
    ids = tokens(2, 9, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    original = model.state_dict()["model.layers.0.mlp.experts.down_proj"]
    assert not torch.equal(loaded.state_dict()["model.layers.0.mlp.experts.down_proj"], original)


def test_rank_shards_reassemble_the_checkpoint(exported: dict[str, Any]) -> None:
    """Rank slices concatenated by the manifest's split are the checkpoint's tensors, bit for bit; the model
    rebuilt from the shards holds the checkpoint's parameters."""
    out = exported["out"]
    checkpoint = _checkpoint(out / "checkpoint")
    ranks = [load_file(str(out / "shards" / shard_file_name(r))) for r in range(L)]
    import json

    split = json.loads((out / "shards" / MANIFEST).read_text())["split"]
    assert sorted(split) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        rule = split[name]
        parts = [rank[name] for rank in ranks]
        whole = parts[0] if rule == "replicated" else torch.cat(parts, dim=0 if rule == "rows" else 1)
        assert torch.equal(whole, tensor), name
    rebuilt, _ = load_rank_shards(out / "shards")
    from_ckpt = AutoModelForCausalLM.from_pretrained(out / "checkpoint", dtype=torch.float32)
    for name, tensor in from_ckpt.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name


def test_each_rank_holds_its_devices_neurons_of_every_expert(exported: dict[str, Any]) -> None:
    """Rank r's gate and up rows and down columns of expert e are, in order, the original expert's neurons j
    with neuron_device[i][e·I_e + j] = r: the convention read literally, against the unpermuted model."""
    case, model, layout, out = exported["case"], exported["model"], exported["layout"], exported["out"]
    state = model.state_dict()
    ranks = [load_file(str(out / "shards" / shard_file_name(r))) for r in range(L)]
    experts, size = expert_shape(model.config)
    for i in range(model.config.num_hidden_layers):
        gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [E, 2·I_e, D]
        down = state[f"model.layers.{i}.mlp.experts.down_proj"]  # [E, D, I_e]
        for e in range(experts):
            devices = layout.neuron_device[i][e * size:(e + 1) * size]
            names = _expert_names(case, i, e)
            for r in range(L):
                mine = [j for j in range(size) if devices[j] == r]
                assert len(mine) == size // L
                assert torch.equal(ranks[r][names["gate"]], gate_up[e, mine])
                assert torch.equal(ranks[r][names["up"]], gate_up[e, [size + j for j in mine]])
                assert torch.equal(ranks[r][names["down"]], down[e][:, mine])
    router = "block_sparse_moe.gate.weight" if case == "mixtral" else "mlp.gate.weight"
    for r in range(L):  # the router is replicated
        assert torch.equal(ranks[r][f"model.layers.0.{router}"], state["model.layers.0.mlp.gate.weight"])


def test_resident_export_of_the_permuted_model_is_the_same(exported: dict[str, Any], tmp_path: Path) -> None:
    """`export_rank_shards(permuted_copy(...))` (the simulator's permutation of the loaded model, written as it
    is) writes the same shards as permuting each tensor as it is written."""
    model, layout, out = exported["model"], exported["layout"], exported["out"]
    export_rank_shards(permuted_copy(model, layout), layout, tmp_path / "shards")
    for r in range(L):
        want, got = load_file(str(out / "shards" / shard_file_name(r))), load_file(str(tmp_path / "shards" /
                                                                                      shard_file_name(r)))
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name
    assert np.array_equal(load_rank_shards(tmp_path / "shards")[1].neuron_device, layout.neuron_device)


def test_streamed_export_is_the_resident_one(exported: dict[str, Any], tmp_path: Path) -> None:
    """From the model's save_pretrained directory, read layer by layer (the per-expert tensors stacked as loading
    does), the export writes the resident export's checkpoint and shards bit for bit."""
    from models.streaming.layer_source import StreamedModel

    model, layout, out = exported["model"], exported["layout"], exported["out"]
    model.save_pretrained(tmp_path / "hf")
    export_layout(StreamedModel(tmp_path / "hf", model.config, dtype=torch.float32), layout,
                  checkpoint_dir=tmp_path / "checkpoint", shards_dir=tmp_path / "shards", dtype=torch.float32)
    for sub, pattern in [("checkpoint", "*.safetensors"), *[("shards", shard_file_name(r)) for r in range(L)]]:
        ours = {k: v for p in sorted((tmp_path / sub).glob(pattern)) for k, v in load_file(str(p)).items()}
        theirs = {k: v for p in sorted((out / sub).glob(pattern)) for k, v in load_file(str(p)).items()}
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), sub
