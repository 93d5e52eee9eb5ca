"""The CUDA path computes what the CPU path computes: the DTP simulator, the affinity pass and a
distillation step, on tiny random models. The CPU path itself is checked against transcriptions of
the paper's equations elsewhere (tests/models); these tests carry that over to the GPU.

Tolerances, and why:
- fp32 simulator logits: 1e-5 (TF32 off; only the summation order differs between devices);
- bf16 autocast: KL(dense ‖ DTP) within 3 % + 1e-3 nats of the fp32 value (bf16 keeps 8 bits of
  mantissa, ~0.4 % per rounding; CPU bf16 autocast lands within 0.02–0.11 % of fp32 on these models);
- affinity: relative 1e-4 per entry in fp32 (float64 accumulators on both devices; the per-token
  products are fp32), 1e-9 with a float64 model;
- distillation steps, CUDA bf16 autocast against CPU fp32: loss, KL and CE within 3 %, gradient norm
  within 5 %, for each of three steps (CPU bf16 autocast: within 0.25 % and 0.16 %).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import distill as D
from models.affinity.scoring import affinity_pass
from models.families import model_shape
from models.layouts.layout import random
from models.sim.dtp import DTPModel
from models.sim.permute import permute_
from tests.tiny import FAMILY_CASES, tiny_model, tokens

pytestmark = pytest.mark.gpu

CASES = sorted(FAMILY_CASES)
BF16_KL_REL, BF16_KL_ABS = 0.03, 1e-3
STEP_REL, GRAD_REL = 0.03, 0.05


def permuted_tiny(case: str, devices: int, delta: int, *, dtype: torch.dtype = torch.float32, seed: int = 0):
    model = tiny_model(case).to(dtype)
    layout = random(model_shape(model.config), devices, delta, seed)
    return permute_(model, layout), layout


def per_token_kl(dense_logits: torch.Tensor, dtp_logits: torch.Tensor) -> float:
    """mean over tokens of Σ_v p (log p − log q), p = softmax(dense), q = softmax(DTP), in fp32."""
    logp = F.log_softmax(dense_logits.float(), dim=-1)
    logq = F.log_softmax(dtp_logits.float(), dim=-1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("devices,delta", [(2, 1), (4, 2)])
def test_simulator_fp32_matches_cpu(accelerator, case, devices, delta):
    model, _ = permuted_tiny(case, devices, delta)
    ids = tokens(2, 16)
    with torch.no_grad():
        on_cpu = DTPModel(model, devices=devices, delta=delta)(ids)
        moved = copy.deepcopy(model).to(accelerator)
        on_acc = DTPModel(moved, devices=devices, delta=delta)(ids.to(accelerator))
    assert on_acc.device.type == accelerator.type
    torch.testing.assert_close(on_acc.cpu(), on_cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_simulator_bf16_autocast_kl_within_tolerance_of_fp32(accelerator, case):
    model, _ = permuted_tiny(case, 2, 1)
    ids = tokens(4, 32)
    with torch.no_grad():
        kl_fp32 = per_token_kl(model(ids).logits, DTPModel(model, devices=2, delta=1)(ids))
        moved = copy.deepcopy(model).to(accelerator)
        ids_acc = ids.to(accelerator)
        with torch.autocast(device_type=accelerator.type, dtype=torch.bfloat16):
            dense = moved(ids_acc).logits
            dtp = DTPModel(moved, devices=2, delta=1)(ids_acc)
    assert dtp.dtype == torch.bfloat16  # autocast really ran the simulator's matmuls in bf16
    kl_bf16 = per_token_kl(dense, dtp)
    assert kl_fp32 > 1e-2  # the DTP model is far enough from dense for the comparison to mean something
    assert abs(kl_bf16 - kl_fp32) <= BF16_KL_REL * kl_fp32 + BF16_KL_ABS, (kl_bf16, kl_fp32)


def assert_affinity_close(got, want, rtol: float) -> None:
    assert got.tokens == want.tokens and got.shape == want.shape
    for name in ("up_fo", "up_add", "down"):
        for layer, (g, w) in enumerate(zip(getattr(got, name), getattr(want, name), strict=True)):
            assert g.dtype == np.float64
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(np.abs(w).max()),
                                       err_msg=f"{name}[{layer}]")


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.float64, 1e-9)])
def test_affinity_pass_matches_cpu(accelerator, case, dtype, rtol):
    model = tiny_model(case).to(dtype)
    blocks = tokens(6, 24, seed=5)
    want = affinity_pass(model, blocks, batch_size=4, token_chunk=16)
    got = affinity_pass(copy.deepcopy(model).to(accelerator), blocks, batch_size=4, token_chunk=16)
    assert_affinity_close(got, want, rtol)


def step_recipe(autocast: str) -> D.DistillRecipe:
    return D.DistillRecipe(steps=3, batch_size=4, micro_batch_size=2, lr=1e-3, min_lr=1e-4, warmup_steps=1,
                           logit_chunk=24, autocast=autocast)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", ["llama", "llama-tied-headdim"])
def test_distillation_steps_bf16_on_accelerator_match_cpu_fp32(accelerator, case):
    teacher = tiny_model(case)
    layout = random(model_shape(teacher.config), 2, 1, 3)
    batches = [tokens(4, 24, seed=10 + s) for s in range(3)]

    def run(device: torch.device, autocast: str) -> list[D.StepStats]:
        recipe = step_recipe(autocast)
        dense = copy.deepcopy(teacher).to(device)
        student = D.make_student(dense, layout, recipe)
        optimizer = D.make_optimizer(student, recipe)
        return [D.train_step(student, dense, b.to(device), optimizer, step=s, recipe=recipe)
                for s, b in enumerate(batches)]

    want = run(torch.device("cpu"), "none")  # the CPU path: plain fp32
    got = run(accelerator, "bf16")  # on CUDA this is what autocast="auto" picks
    for g, w in zip(got, want, strict=True):
        assert g.lr == w.lr
        for name in ("loss", "kl", "ce"):
            assert getattr(g, name) == pytest.approx(getattr(w, name), rel=STEP_REL), (name, g, w)
        assert g.grad_norm == pytest.approx(w.grad_norm, rel=GRAD_REL), (g, w)
