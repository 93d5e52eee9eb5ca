"""bench/repairable_damage.py: the residual it scores is the ridge fit of each device's missing input on that
device's own normed input, fitted on the other fold's blocks — checked against numpy's solve on the tokens
stacked by hand — and the first pass leaves the joint damage as bench/joint_damage.py computes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.joint_damage import joint_damage
from bench.repairable_damage import RIDGE, LinearRepair, unabsorbed_damage
from models.base.shapes import ModelShape
from models.layouts import layout as layout_mod
from models.schedules.grammar import resolve_schedule
from tests.tiny import tiny_model, tokens


class _Recording(LinearRepair):
    """Keeps what each pass saw and returned, keyed by (module, device, block)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.second: dict[tuple[int, int, int], np.ndarray] = {}

    def collect(self, n, d, b, p, seen):
        self.first[(n, d, b)] = (p.numpy().copy(), seen.numpy().copy())
        return super().collect(n, d, b, p, seen)

    def residual(self, n, d, b, p, seen):
        out = super().residual(n, d, b, p, seen)
        self.second[(n, d, b)] = out.numpy().copy()
        return out


def test_the_residual_is_the_held_out_ridge_fit_of_the_missing_input_on_the_devices_own_input():
    torch.manual_seed(0)
    model = tiny_model("llama", num_hidden_layers=2)
    schedule = resolve_schedule("dtp:2", 2, 2)
    layout = layout_mod.random(ModelShape("llama", 2, 4, 8, 96, 48, 6), 2, seed=5)
    blocks = tokens(batch=4, seq=40)  # 2 folds of 80 tokens against D = 48 regressors
    repair = _Recording()
    got = unabsorbed_damage(model, blocks, schedule, layout.kv_group_device, layout.neuron_device, repair=repair)

    plain = joint_damage(model, blocks, schedule, layout.kv_group_device, layout.neuron_device)
    assert got["joint"]["ffn"] == pytest.approx(plain["ffn"], rel=1e-12)  # the first pass changes nothing
    assert got["joint"]["attention"] == pytest.approx(plain["attention"], rel=1e-12)

    checked = 0
    for (n, d, b), (p, _) in repair.first.items():
        held_out = [k for k in repair.first if k[:2] == (n, d) and k[2] % 2 != b % 2]
        N = np.concatenate([repair.first[k][1] for k in held_out])  # [tokens of the other fold, D]
        P = np.concatenate([repair.first[k][0] for k in held_out])
        gram = N.T @ N
        lam = RIDGE * np.trace(gram) / gram.shape[0] + 1e-300
        q = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), N.T @ P)
        want = p - repair.first[(n, d, b)][1] @ q
        np.testing.assert_allclose(repair.second[(n, d, b)], want, rtol=1e-7, atol=1e-9 * (1 + np.abs(p).max()))
        checked += int(np.abs(p).max() > 0)
    assert checked >= 8  # modules after the first see a deviation on every device
    # the residual's energy is Σ‖p̃‖² over Σ‖p‖², and its damage is joint_damage's of p̃ (no longer p's)
    energy = sum(float(np.square(r).sum()) for r in repair.second.values())
    assert got["kept"] == pytest.approx(energy / sum(float(np.square(p).sum()) for p, _ in repair.first.values()))
    assert got["unabsorbed"]["ffn"] > 0 and got["unabsorbed"]["ffn"] != pytest.approx(got["joint"]["ffn"], rel=1e-3)
