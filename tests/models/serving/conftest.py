"""Fixtures the vLLM serving tests share: the two-rank runtime whose greedy tokens the engines must equal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from models.runtime import DTPRuntime


@pytest.fixture(scope="module")
def runtime2() -> Iterator[DTPRuntime]:
    rt = DTPRuntime.start(world_size=2, backend="gloo", timeout_s=60.0, threads=1)
    try:
        yield rt
    finally:
        rt.stop()
