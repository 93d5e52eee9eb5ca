"""Shared by the runtime tests: exported tiny shards, and rank groups started once and reused
(process start-up dominates: every test that can load into a running group does)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from models.export.resident import export_rank_shards, permuted_copy
from models.families import model_shape
from models.layouts import layout as lay
from models.runtime import DTPRuntime
from tests.tiny import fresh_for_devices


class ShardFactory:
    """export's rank shards of a tiny model under a random layout, written once per (case, L, δ, seed,
    schedule); schedule None: the manifest's default (the layout's dtp:δ)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple[str, int, int, int, str | None], Path] = {}

    def __call__(self, case: str, devices: int, delta: int, seed: int = 0, schedule: str | None = None) -> Path:
        key = (case, devices, delta, seed, schedule)
        if key not in self.made:
            model = fresh_for_devices(case, devices)
            layout = lay.random(model_shape(model.config), devices, delta, seed=100 * devices + 10 * delta + seed)
            tag = "" if schedule is None else "-" + schedule.replace(":", "_").replace(",", "-").replace("@", "at")
            out = self.root / f"{case}-L{devices}-d{delta}-s{seed}{tag}"
            export_rank_shards(permuted_copy(model, layout), layout, out, schedule=schedule)
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
def runtime3() -> Iterator[DTPRuntime]:
    yield from _runtime(3)


@pytest.fixture(scope="package")
def runtime4() -> Iterator[DTPRuntime]:
    yield from _runtime(4)
