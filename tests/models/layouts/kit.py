"""Small affinity files and slow transcriptions shared by the layout-set and stability tests."""

from __future__ import annotations

import itertools

import numpy as np

from models.affinity.file import AffinityResult
from models.base.shapes import ModelShape
from models.optimise import Affinity

N, G, I, L = 6, 2, 4, 2


def fake_result(seed: int = 0, layers: int = N) -> AffinityResult:
    """An affinity file's content with independent FO and ADD up edges (heavy-tailed, like real ones)."""
    rng = np.random.default_rng(seed)
    shape = ModelShape("llama", layers, G, 2 * G, I, hidden_size=8, head_dim=4)
    return AffinityResult(up_fo=[rng.lognormal(0, 1.5, (G, I)) for _ in range(layers)],
                          up_add=[rng.lognormal(0, 1.5, (G, I)) for _ in range(layers)],
                          down=[rng.lognormal(0, 1.5, (I, G)) for _ in range(layers - 1)], tokens=10, shape=shape)


def units(result: AffinityResult, score: str) -> Affinity:
    return Affinity(result.up_fo if score == "fo" else result.up_add, result.down)


def brute_agreement(a: np.ndarray, b: np.ndarray, devices: int) -> float:
    return max(float((np.array(perm)[a] == b).mean()) for perm in itertools.permutations(range(devices)))
