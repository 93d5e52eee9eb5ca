"""Loading a rank's weights into the vLLM DTP model from `shards/` (one file per rank, `manifest.json`).

Rank r reads `model-rank-r-part-0.safetensors` alone (its size and sha256 checked against the manifest):
its q/k/v slices are joined into vLLM's fused qkv_proj and its gate/up slices into gate_up_proj (each
already this rank's rows), o_proj/down_proj are its columns as they are, and the replicated tensors
(embeddings, norms, the LM head) go through the parameters' own loaders, which take this rank's vocabulary
slice. An MoE family's experts (issue 46: each expert's gate, up and down slices, `models.export.experts`) go
into vLLM's FusedMoE parameters: expert e's gate rows then its up rows into w13_weight[e], its down columns
into w2_weight[e]; the router is replicated. The permuted `checkpoint/` needs none of this: vLLM's own TP
slicing of it gives rank r shard r.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from models.export.files import MANIFEST, SHARDS_FORMAT
from models.export.serving_manifest import ServingError
from models.families import family_for_config
from models.io.digest import sha256_file

# HF module -> (vLLM fused module, position in it)
_FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
          "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
          "mlp.up_proj": ("mlp.gate_up_proj", 1)}


def shards_manifest(directory: str | Path) -> dict[str, Any] | None:
    """The manifest of a shards/ directory, or None when `directory` is not one (a checkpoint)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    manifest: dict[str, Any] = json.loads(path.read_text())
    if manifest.get("format") != SHARDS_FORMAT:
        raise ServingError(f"{path}: format must be {SHARDS_FORMAT!r}, got {manifest.get('format')!r}")
    return manifest


def check_devices(manifest: dict[str, Any], directory: str | Path, tp_size: int) -> None:
    if manifest.get("devices") != tp_size:
        raise ServingError(f"{Path(directory) / MANIFEST}: the shards are for L={manifest.get('devices')} ranks but "
                           f"vLLM's tensor-parallel size is {tp_size}: serve them with --tensor-parallel-size "
                           f"{manifest.get('devices')} (`dtp-layout vllm-serve` sets it from the manifest)")


def _rank_file(manifest: dict[str, Any], directory: Path, rank: int) -> Path:
    entry = next((f for f in manifest.get("files", []) if f.get("rank") == rank), None)
    if entry is None:
        raise ServingError(f"{directory / MANIFEST}: no file for rank {rank}")
    path = directory / Path(str(entry["name"])).name
    if not path.is_file() or path.stat().st_size != entry["size"]:
        raise ServingError(f"{path}: missing, or its size does not match the manifest's {entry['size']} bytes")
    if sha256_file(path) != entry["sha256"]:
        raise ServingError(f"{path}: sha256 does not match the manifest (corrupted or replaced)")
    return path


def _copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ServingError(f"{name}: the shard holds {list(value.shape)}, this rank's parameter is "
                           f"{list(param.shape)}")
    param.data.copy_(value.to(param.dtype))


_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<rel>.+)$")


class ExpertLoader:
    """An MoE model's expert slices into vLLM's fused expert parameters (w13_weight [E, 2·I_e/L, D]: an expert's
    gate rows then its up rows; w2_weight [E, D, I_e/L])."""

    def __init__(self, model: Any) -> None:
        moe = getattr(family_for_config(model.config), "moe", None)
        self.names = moe.checkpoint if moe is not None else None
        self.model = model
        self.param_names = {id(p): n for n, p in model.named_parameters()}

    def load(self, name: str, tensor: torch.Tensor) -> str | None:
        """Copy `tensor` where it goes and return the parameter's name, or None when `name` is no expert's."""
        match = _LAYER.match(name)
        role = self.names.role_of(match["rel"]) if self.names is not None and match is not None else None
        if role is None or match is None:
            return None
        kind, expert = role
        layer = self.model.model.layers[int(match["layer"])]
        experts = getattr(layer, self.model.ffn_name).experts.routed_experts
        param = experts.w2_weight if kind == "down" else experts.w13_weight
        size = experts.w13_weight.shape[1] // 2  # I_e / L
        target = param.data[expert] if kind == "down" else param.data[expert, :size] if kind == "gate" else \
            param.data[expert, size:]
        _copy(target, tensor, name)
        return self.param_names[id(param)]


def load_rank_shard(model: nn.Module, directory: str | Path, manifest: dict[str, Any], rank: int) -> set[str]:
    """Fill `model` (a DtpForCausalLM) with rank `rank`'s shard; the names of the parameters loaded."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    directory = Path(directory)
    tensors = load_file(str(_rank_file(manifest, directory, rank)))
    split = manifest.get("split", {})
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    fused: dict[str, dict[int, torch.Tensor]] = {}
    experts = ExpertLoader(model)
    for name, tensor in tensors.items():
        rule = split.get(name)
        if rule is None:
            raise ServingError(f"{directory / MANIFEST}: tensor {name!r} has no split rule")
        if (expert_param := experts.load(name, tensor)) is not None:
            loaded.add(expert_param)
            continue
        target = next(((name.replace(f".{m}.", f".{f}."), i) for m, (f, i) in _FUSED.items() if f".{m}." in name),
                      None)
        if target is not None:
            fused.setdefault(target[0], {})[target[1]] = tensor
            continue
        if name not in params:
            if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                continue
            raise ServingError(f"{name}: the shard holds a tensor the DTP model has no parameter for")
        param = params[name]
        if rule == "replicated":  # embeddings and the LM head: the loader takes this rank's vocabulary slice
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        else:  # o_proj / down_proj: this rank's input columns, as they are
            _copy(param, tensor, name)
        loaded.add(name)
    for name, parts in fused.items():
        if name not in params or sorted(parts) != list(range(3 if ".qkv_proj." in name else 2)):
            raise ServingError(f"{name}: cannot join the shard's slices {sorted(parts)}")
        _copy(params[name], torch.cat([parts[i] for i in sorted(parts)], dim=0), name)  # [rows, in] / [rows]
        loaded.add(name)
    return loaded
