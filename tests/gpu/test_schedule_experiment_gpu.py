"""bench/schedule_experiment.py on the accelerator (`--device`), against the same quick run on the CPU.

The `gpu` preset is the experiment at the paper's scale for a GPU; this proves its device path at the
quick preset's size on a tiny random llama and `.npy` token files (no packaged model or corpus needed on
the GPU machine): every arm trains there, and the arm whose layout does not depend on the affinity
(contiguous: the storage order) starts and ends where the CPU run does, fp32 with TF32 off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import schedule_experiment as exp
from tests.tiny import tiny_model

pytestmark = pytest.mark.gpu


def _run(tmp_path, device: str) -> dict:
    return exp.main(["--quick", "--model", str(tmp_path / "model"), "--devices", "2", "--schedules", "dtp:2",
                     "--calib", str(tmp_path / "calib.npy"), "--train", str(tmp_path / "train.npy"),
                     "--eval", str(tmp_path / "eval.npy"), "--eval2", str(tmp_path / "eval2.npy"),
                     "--device", device, "--work", str(tmp_path / f"work-{device.replace(':', '-')}")])["dtp:2"]


def test_the_schedule_experiment_runs_on_the_accelerator_as_on_the_cpu(accelerator, tmp_path):
    torch.manual_seed(0)
    tiny_model("llama").save_pretrained(tmp_path / "model")
    for seed, name in enumerate(("calib", "train", "eval", "eval2")):
        np.save(tmp_path / f"{name}.npy", np.random.default_rng(seed).integers(0, 97, size=4 * 32))
    on_accelerator = _run(tmp_path, str(accelerator))
    on_cpu = _run(tmp_path, "cpu")
    assert torch.device(on_accelerator["device"]).type == accelerator.type
    assert set(on_accelerator["final_kl"]) == {"optimised", "contiguous", "random-1000"}
    assert all(np.isfinite(kl) and kl > 0 for kls in on_accelerator["final_kl"].values() for kl in kls)
    for seed, curve in on_cpu["curves"]["contiguous"].items():
        there = on_accelerator["curves"]["contiguous"][seed]
        assert there[0][1] == pytest.approx(curve[0][1], rel=1e-4)  # step 0: the same model, the same blocks
        assert there[-1][1] == pytest.approx(curve[-1][1], rel=2e-3)  # two AdamW steps later
    j_here, j_cpu = on_accelerator["predictors"]["J_damage"], on_cpu["predictors"]["J_damage"]
    assert j_here["contiguous"] == pytest.approx(j_cpu["contiguous"], rel=1e-4)  # the affinity pass there
