"""The affinity pass's result and its file (`affinity.safetensors`), without torch.

Raw per-token means, not normalised: up_fo / up_add [G, I] per layer (the FO and ADD up-edge scores of
§3) and down [I, G] per layer < N-1. Read and written through safetensors' numpy API, so the `score`
command and the API process can load an affinity without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models.affinity_scores import SCORES
from models.atomic import atomic_write
from models.layouts.layout import ModelShape

AFFINITY_FORMAT = "dtp-layout-affinity/1"


@dataclass
class AffinityResult:
    """Raw per-token means (not normalised): up_fo/up_add [G, I] per layer, down [I, G] per layer < N-1."""

    up_fo: list[np.ndarray]
    up_add: list[np.ndarray]
    down: list[np.ndarray]
    tokens: int
    shape: ModelShape
    metadata: dict[str, str] = field(default_factory=dict)

    def up(self, score: str) -> list[np.ndarray]:
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        return self.up_fo if score == "fo" else self.up_add

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for prefix, mats in (("up_fo", self.up_fo), ("up_add", self.up_add), ("down", self.down)):
            for i, m in enumerate(mats):
                tensors[f"{prefix}.{i}"] = np.ascontiguousarray(m)
        meta = {**self.metadata, "tokens": str(self.tokens), "format": AFFINITY_FORMAT,
                "shape": json.dumps(self.shape.__dict__)}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> AffinityResult:
        path = Path(path)
        try:
            with safe_open(str(path), framework="np") as f:
                meta = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        except Exception as exc:  # safetensors raises its own error type for malformed headers
            raise ValueError(f"{path}: cannot read affinity safetensors: {exc}") from exc
        if meta.get("format") != AFFINITY_FORMAT or "shape" not in meta:
            raise ValueError(f"{path}: not a dtp-layout affinity file (metadata format/shape missing)")
        try:
            shape = ModelShape(**json.loads(meta["shape"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed shape metadata: {exc}") from exc
        n = shape.num_layers

        def stack(prefix: str, count: int) -> list[np.ndarray]:
            try:
                return [np.asarray(tensors[f"{prefix}.{i}"], dtype=np.float64) for i in range(count)]
            except KeyError as exc:
                raise ValueError(f"{path}: missing tensor {exc.args[0]}") from exc

        return cls(stack("up_fo", n), stack("up_add", n), stack("down", n - 1), int(meta.get("tokens", 0)),
                   shape, {k: v for k, v in meta.items() if k not in ("tokens", "format", "shape")})
