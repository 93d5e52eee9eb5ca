"""The worker's hub model cache held to HUB_CACHE_MAX_BYTES (issue 41): models idle for an hour are deleted, least
recently used first, to make room for a fetch; one that still does not fit fails the job naming the setting. The
cache is huggingface_hub's own layout, read by its own scan_cache_dir (no hub is reached)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from app.core.hub import CACHE_IDLE_S, ModelRefused, make_cache_room, plan_cache_room
from tests.service_kit import make_settings

MiB = 1 << 20
HOUR = CACHE_IDLE_S


def test_the_plan_deletes_idle_models_least_recently_used_first_and_never_the_one_fetched():
    now = 10 * HOUR
    cached = [("a/old", 30 * MiB, now - 5 * HOUR), ("a/older", 20 * MiB, now - 9 * HOUR),
              ("a/busy", 40 * MiB, now - 60), ("a/this", 50 * MiB, now - 9.5 * HOUR)]
    # 90 MiB of others cached under a 100 MiB cap: a 5 MiB fetch fits as it is
    assert plan_cache_room(cached, keep="a/this", need=5 * MiB, cap=100 * MiB, now=now) == []
    # 25 MiB: the least recently used idle model goes (a/older), then the fetch fits (70 + 25 <= 100)
    assert plan_cache_room(cached, keep="a/this", need=25 * MiB, cap=100 * MiB, now=now) == ["a/older"]
    # 55 MiB: both idle ones go (40 + 55 <= 100); the one fetched is never a candidate
    assert plan_cache_room(cached, keep="a/this", need=55 * MiB, cap=100 * MiB, now=now) == ["a/older", "a/old"]
    # 65 MiB: a/busy was used a minute ago (another worker may be loading it): nothing makes room
    assert plan_cache_room(cached, keep="a/this", need=65 * MiB, cap=100 * MiB, now=now) is None


def _cached_model(cache: Path, repo: str, size: int, accessed: float) -> None:
    """One model in huggingface_hub's cache layout: a blob, a ref and a snapshot linking to it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    commit = f"{abs(hash(repo)):040x}"[:40]
    blob = root / "blobs" / f"{abs(hash(repo + 'blob')):064x}"[:64]
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"\0" * size)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(blob, snapshot))
    os.utime(blob, (accessed, accessed))


def test_a_fetch_deletes_idle_models_from_the_real_cache_or_is_refused_naming_the_setting(tmp_path: Path):
    cache = tmp_path / "hub"
    now = time.time()
    _cached_model(cache, "acme/idle", 3 * MiB, now - 3 * HOUR)
    _cached_model(cache, "acme/recent", 2 * MiB, now - 60)
    settings = make_settings(tmp_path, hub_cache_max_bytes=6 * MiB)
    assert make_cache_room("acme/new", 1 * MiB, settings, cache_dir=cache) == []  # 5 + 1 <= 6
    assert make_cache_room("acme/new", 2 * MiB, settings, cache_dir=cache) == ["acme/idle"]
    assert not (cache / "models--acme--idle" / "snapshots").exists() or not any(
        (cache / "models--acme--idle" / "snapshots").rglob("*.safetensors"))
    assert (cache / "models--acme--recent").is_dir()
    with pytest.raises(ModelRefused, match="DTP_LAYOUT_HUB_CACHE_MAX_BYTES") as refused:
        make_cache_room("acme/new", 5 * MiB, settings, cache_dir=cache)  # the recent one is not deleted
    assert refused.value.args and (cache / "models--acme--recent").is_dir()
    assert make_cache_room("acme/new", 1 * MiB, settings, cache_dir=tmp_path / "no-cache-yet") == []
    with pytest.raises(ModelRefused, match="do not fit"):  # larger than the whole cache, none made yet
        make_cache_room("acme/new", 7 * MiB, settings, cache_dir=tmp_path / "no-cache-yet")
