"""Shared by the runtime tests: exported tiny shards, and rank groups started once and reused
(process start-up dominates: every test that can load into a running group does)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from models.export import export_rank_shards, permuted_copy
from models.families import model_shape
from models.layouts import layout as lay
from models.runtime import DTPRuntime
from tests.tiny import fresh


class ShardFactory:
    """export's rank shards of a tiny model under a random layout, written once per (case, L, δ, seed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple[str, int, int, int], Path] = {}

    def __call__(self, case: str, devices: int, delta: int, seed: int = 0) -> Path:
        key = (case, devices, delta, seed)
        if key not in self.made:
            model = fresh(case)
            layout = lay.random(model_shape(model.config), devices, delta, seed=100 * devices + 10 * delta + seed)
            out = self.root / f"{case}-L{devices}-d{delta}-s{seed}"
            export_rank_shards(permuted_copy(model, layout), layout, out)
            self.made[key] = out
        return self.made[key]


@pytest.fixture(scope="package")
def shards(tmp_path_factory: pytest.TempPathFactory) -> ShardFactory:
    return ShardFactory(tmp_path_factory.mktemp("runtime-shards"))


def _runtime(world_size: int) -> Iterator[DTPRuntime]:
    rt = DTPRuntime.start(world_size=world_size, backend="gloo", timeout_s=30.0, threads=1)
    try:
        yield rt
    finally:
        rt.stop()


@pytest.fixture(scope="package")
def runtime2() -> Iterator[DTPRuntime]:
    """Two ranks (gloo), kept for the whole package: tests load their shards into it."""
    yield from _runtime(2)


@pytest.fixture(scope="package")
def runtime4() -> Iterator[DTPRuntime]:
    yield from _runtime(4)
