"""Every mismatch between the shards and what the ranks expect is a clear ShardError from every rank,
before any compute, within a bounded time; the ranks stay up and keep the model they had."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.io.digest import sha256_file
from models.runtime import DTPRuntime, ShardError
from models.runtime.shards import read_shard_set
from tests.tiny import tokens

BOUND_S = 60.0  # generous on a loaded 2-core machine; a load of these shards takes well under a second


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(shards: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    edit(manifest)
    (shards / "manifest.json").write_text(json.dumps(manifest))


def _rewrite_rank(shards: Path, rank: int, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Change a rank's tensors and record the new file's size and sha256 (so only the content check can fail)."""
    path = shards / f"model-rank-{rank}-part-0.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    _edit_manifest(shards, lambda m: m["files"][rank].update(size=path.stat().st_size, sha256=sha256_file(path)))


def _flip_byte(shards: Path) -> None:
    path = shards / "model-rank-1-part-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(shards: Path) -> None:
    path = shards / "model-rank-0-part-0.safetensors"
    path.write_bytes(path.read_bytes()[:-64])


def _config(shards: Path, **changes: Any) -> None:
    config = json.loads((shards / "config.json").read_text())
    config.update(changes)
    (shards / "config.json").write_text(json.dumps(config))


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _wrong_shape(tensors: dict[str, torch.Tensor]) -> None:
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:2]])  # two neurons too many


MISMATCHES: dict[str, tuple[Callable[[Path], None], str]] = {
    "sha256": (_flip_byte, r"model-rank-1-part-0\.safetensors: sha256 does not match the manifest"),
    "size": (_truncate, r"model-rank-0-part-0\.safetensors: size \d+ bytes does not match the manifest's"),
    "missing-file": (lambda s: (s / "model-rank-1-part-0.safetensors").unlink(),
                     r"model-rank-1-part-0\.safetensors: missing \(rank 1's shard"),
    "format": (lambda s: _edit_manifest(s, lambda m: m.update(format="dtp-layout-shards/9")),
               r"field 'format' must be 'dtp-layout-shards/1', got 'dtp-layout-shards/9'"),
    "no-manifest": (lambda s: (s / "manifest.json").unlink(), r"manifest\.json: missing"),
    "files-field": (lambda s: _edit_manifest(s, lambda m: m.pop("files")), r"missing field 'files'"),
    "path-in-name": (lambda s: _edit_manifest(s, lambda m: m["files"][0].update(name="../evil.safetensors")),
                     r"files\[0\]\.name must be a plain \.safetensors file name, got '\.\./evil\.safetensors'"),
    "rank-twice": (lambda s: _edit_manifest(s, lambda m: m["files"][1].update(rank=0)), r"rank 0 is listed twice"),
    "layers": (lambda s: _config(s, num_hidden_layers=4),
               r"the layout does not fit the model of config\.json: .*model\.num_layers=3, the model has 4"),
    "hidden": (lambda s: _config(s, hidden_size=64), r"layout model\.hidden_size=48, config\.json gives 64"),
    "family": (lambda s: _config(s, hidden_act="gelu"), r"config\.json: llama model not supported: hidden_act='gelu'"),
    "split": (lambda s: _edit_manifest(s, lambda m: m["split"].update({Q_PROJ: "cols"})),
              r"split\['model\.layers\.0\.self_attn\.q_proj\.weight'\] is 'cols', but the family's sharding plan "
              r"says 'rows'"),
    "tensor-shape": (lambda s: _rewrite_rank(s, 1, _wrong_shape),
                     r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has shape \[50, 48\], rank 1 of L=2 should hold "
                     r"\[48, 48\] \(rows of \[96, 48\]\)"),
    "tensor-missing": (lambda s: _rewrite_rank(s, 0, lambda t: t.pop("model.norm.weight")),
                       r"tensors do not match the model of config\.json: missing \['model\.norm\.weight'\]"),
    "dtype": (lambda s: _rewrite_rank(s, 1, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()})),
              r"tensors must share one float dtype"),
}


@pytest.fixture(scope="module")
def good(runtime2: DTPRuntime, shards: Any) -> tuple[Path, np.ndarray]:
    """The llama shards at L=2, loaded, and the greedy tokens they give."""
    path = shards("llama", 2, 1)
    runtime2.load(path)
    return path, runtime2.generate(tokens(1, 5).numpy(), max_new_tokens=4, stop_at_eos=False).tokens


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_mismatch_is_refused_by_every_rank_before_compute(runtime2: DTPRuntime, good: Any, tmp_path: Path,
                                                           name: str) -> None:
    path, want = good
    broken = _copy(path, tmp_path / "shards")
    spoil, message = MISMATCHES[name]
    spoil(broken)
    t0 = time.monotonic()
    with pytest.raises(ShardError, match=message) as info:
        runtime2.load(broken)
    assert time.monotonic() - t0 < BOUND_S
    assert str(info.value).startswith(("rank ", "ranks 0, 1: ")), str(info.value)
    # The ranks are still up and still hold the previous model (nothing was half-loaded).
    assert runtime2.alive
    again = runtime2.generate(tokens(1, 5).numpy(), max_new_tokens=4, stop_at_eos=False)
    np.testing.assert_array_equal(again.tokens, want)
    assert runtime2.info is not None and Path(runtime2.info.shards_dir) == path.resolve()


def test_world_size_must_equal_l(runtime2: DTPRuntime, shards: Any) -> None:
    t0 = time.monotonic()
    with pytest.raises(ShardError, match=r"ranks 0, 1: .*manifest\.json: world size 2 does not equal the layout's L=4 "
                                         r"\(field 'devices'\): run the shards with exactly 4 ranks"):
        runtime2.load(shards("qwen2", 4, 1))
    assert time.monotonic() - t0 < BOUND_S
    assert runtime2.alive


def test_a_rank_that_fails_alone_is_named(runtime2: DTPRuntime, good: Any, tmp_path: Path) -> None:
    """Only rank 1's file is bad: both ranks refuse, and the message says it was rank 1."""
    broken = _copy(good[0], tmp_path / "shards")
    _flip_byte(broken)
    with pytest.raises(ShardError) as info:
        runtime2.load(broken)
    assert str(info.value).startswith("rank 1: ") and "rank 0" not in str(info.value)


def test_existing_shards_without_the_new_manifest_fields_still_load(runtime2: DTPRuntime, good: Any,
                                                                     tmp_path: Path) -> None:
    """Shards written before `plan` and `dtype` were added to the manifest are still read."""
    old = _copy(good[0], tmp_path / "shards")
    _edit_manifest(old, lambda m: (m.pop("plan"), m.pop("dtype")))
    assert read_shard_set(old).devices == 2
    runtime2.load(old)
    np.testing.assert_array_equal(
        runtime2.generate(tokens(1, 5).numpy(), max_new_tokens=4, stop_at_eos=False).tokens, good[1])
    runtime2.load(good[0])
