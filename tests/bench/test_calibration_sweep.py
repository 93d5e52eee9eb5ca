"""bench/calibration_sweep.py: the per-block reuse it rests on, its fixed rule, and a smoke run.

The sweep averages blocks' affinities instead of rerunning the pass per size; that is exact only because
the pass's scores are per-token means over equal blocks, which the first test checks against the pass run
on the blocks together (not against the sweep's own code path).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from bench import calibration_sweep as sweep
from models.affinity.scoring import affinity_pass
from tests.tiny import tiny_model


def test_the_mean_of_equal_blocks_affinities_is_the_affinity_of_the_blocks_together():
    model = tiny_model("llama")
    blocks = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(3))  # [B, S]
    together = affinity_pass(model, blocks, batch_size=3)
    apart = sweep.mean_affinity([affinity_pass(model, blocks[i:i + 1], batch_size=1)
                                 for i in range(3)])
    assert apart.tokens == together.tokens == 48
    for name in ("up_fo", "up_add", "down"):
        for a, b in zip(getattr(apart, name), getattr(together, name), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)


def test_the_converged_size_is_the_smallest_within_the_tolerance_of_every_larger_one():
    assert sweep.converged_size({1024: 28.0, 2048: 29.5, 4096: 30.0, 8192: 30.1}, 0.01) == 4096
    # 2048 is within 1 % of 8192 but not of 4096: not converged there
    assert sweep.converged_size({1024: 28.0, 2048: 30.0, 4096: 30.5, 8192: 30.2}, 0.01) == 4096
    assert sweep.converged_size({1024: 28.0, 2048: 29.0}, 0.01) is None


def test_an_arm_is_better_only_where_every_seed_of_it_ends_below_every_seed_of_the_other():
    finals = {"calibrated-1024": {0: 1.20, 1: 1.24, 2: 1.21}, "calibrated-8192": {0: 1.10, 1: 1.30, 2: 1.25},
              "contiguous": {0: 1.50, 1: 1.45, 2: 1.60}, "one-seed": {0: 1.0}}
    assert sorted(sweep.kl_separations(finals)) == [("calibrated-1024", "contiguous"),
                                                    ("calibrated-8192", "contiguous")]


def test_a_quick_sweep_scores_every_size_on_the_held_out_blocks(tmp_path):
    out = sweep.main(["--quick", "--work", str(tmp_path), "--distill-sizes", "1,4"])
    assert [r["tokens"] for r in out["rows"]] == [32, 64, 128]
    assert len(list((tmp_path / "blocks").glob("*.safetensors"))) == 4 + 2  # 4 calibration + 2 held out
    for row in out["rows"]:
        assert row["J_heldout_contiguous"] == out["rows"][0]["J_heldout_contiguous"]  # one yardstick for all
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == out["rows"]
    # the distilled arms: two sizes' optimised layouts and contiguous, one seed each, a finite final KL
    finals = out["distill"]["final_kl"]
    assert set(finals) == {"calibrated-32", "calibrated-128", "contiguous"}
    assert all(set(by_seed) == {0} and by_seed[0] >= 0 for by_seed in finals.values())
    assert out["distill"]["separated"] == [list(p) for p in sweep.kl_separations(finals)]
