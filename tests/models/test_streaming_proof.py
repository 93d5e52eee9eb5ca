"""The proof of the streamed passes at a modest size: a synthetic Llama-shaped checkpoint of ~350 MB
(bench/synthetic_checkpoint.py: written tensor by tensor), `dtp-layout optimise` (affinity pass, layouts and
export) under `--max-memory` of ~60 % of the weight bytes (the plan's streamed need) in a subprocess, its
peak RSS below the limit plus the interpreter's base (the same command's imports, measured the same way),
and its outputs equal to the in-memory pass and export run here. bench/streaming.py runs the same at a few
GB, with `export` too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.streaming import base_rss, calibration_ids, cli, measured, same_shards, same_tensors
from bench.synthetic_checkpoint import llama_config, write_checkpoint
from models.affinity.file import AffinityResult
from models.affinity.scoring import affinity_pass
from models.export.resident import export_checkpoint, export_copy, export_rank_shards
from models.io.loading import ModelSource, load_config, load_model
from models.layouts.layout import load
from models.streaming.memory_plan import plan_memory
from models.variants.set import build_layouts


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    src = tmp_path_factory.mktemp("synthetic") / "model"
    config = llama_config(hidden=768, intermediate=2048, layers=12, heads=12, kv_heads=4, vocab=8192)
    return src, write_checkpoint(src, config)


def test_optimise_under_less_than_the_weights_streams_within_the_limit_and_equals_in_memory(
        synthetic: tuple[Path, int], tmp_path: Path) -> None:
    src, weights = synthetic
    assert 300e6 < weights < 400e6
    # half the weights, or the plan's streamed need where that is more (its RUNTIME_OVERHEAD included):
    # the proof is that the run keeps the plan's promise, well under the in-memory need
    plan = plan_memory(load_config(ModelSource(str(src))), dtype="float32", command="optimise", limit=None,
                       tokens=128, batch_tokens=4 * 64, devices=2, export=True)
    limit = max(weights // 2, plan.streamed)
    assert limit < 0.65 * weights and weights < plan.in_memory  # the weights alone would not fit
    ids = calibration_ids(tmp_path / "ids.npy", 8192, 512)
    out = tmp_path / "streamed"
    # the child runs with this process's intra-op thread count: a float32 matmul's reduction order depends on
    # it (measured: 1 thread here and 2 in the child differ by 1.2e-6 relative), and the claim is that the
    # streamed pass is the same computation as the in-memory one, not that threads do not matter
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    run = measured(cli("optimise", str(src), "--devices", "2", "--calib", str(ids), "--calib-sequences", "2",
                       "--calib-seq-len", "64", "--restarts", "0", "--no-convert-cache", "--device", "cpu",
                       "--max-memory", str(limit), "--out", str(out)), tmp_path, env=env)
    assert run["rc"] == 0
    base = base_rss(tmp_path)["command_imports"]
    assert run["peak_rss"] <= limit + base, (run["peak_rss"], limit, base)

    # the in-memory pass, export and layouts on the same blocks
    model = load_model(ModelSource(str(src)), dtype="float32", device="cpu")
    blocks = torch.from_numpy(np.load(out / "blocks.npy"))
    dense = affinity_pass(model, blocks, batch_size=4)
    streamed = AffinityResult.load(out / "affinity.safetensors")
    for a, b in zip(streamed.up_fo + streamed.up_add + streamed.down, dense.up_fo + dense.up_add + dense.down,
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
    layouts = build_layouts(dense, devices=2, delta=1, score_name="fo", random_layouts=0, ablations=False, restarts=0)
    ours = load(out / "layouts" / "optimised.json")
    for i in range(12):
        assert np.array_equal(ours.group_order(i), layouts["optimised"].group_order(i))
        assert np.array_equal(ours.neuron_order(i), layouts["optimised"].neuron_order(i))
    permuted = export_copy(model, ours)
    del model
    export_checkpoint(permuted, ours, tmp_path / "mem" / "checkpoint")
    export_rank_shards(permuted, ours, tmp_path / "mem" / "shards")
    assert same_tensors(out / "checkpoint", tmp_path / "mem" / "checkpoint")
    assert same_shards(out / "shards", tmp_path / "mem" / "shards")
    assert json.loads((out / "shards" / "manifest.json").read_text())["layout"] == ours.to_json_dict()
