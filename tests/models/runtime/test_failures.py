"""A rank that dies or hangs mid-generation: the others fail their collective with an error naming it,
within a bounded time; the launcher raises RankFailure and no rank process is left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from typing import Any

import pytest

from models.runtime import DTPRuntime, RankFailure, RuntimeStopped
from tests.tiny import tokens

# serial: ranks killed, stopped and hung, each failure noticed within a bounded wall time
pytestmark = pytest.mark.serial


def _generate_in_background(rt: DTPRuntime) -> tuple[threading.Thread, dict[str, BaseException]]:
    """A long generation (an emulated 2 ms link makes every token slow) running in a thread."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            rt.generate(tokens(1, 6).numpy(), max_new_tokens=1_000_000, stop_at_eos=False, link_latency_us=2000)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(2.0)  # well into decoding
    assert thread.is_alive(), outcome
    return thread, outcome


def _all_gone(rt: DTPRuntime) -> bool:
    return not any(p.is_alive() for p in rt._processes)


def test_a_killed_rank_is_named_by_the_others(shards: Any) -> None:
    rt = DTPRuntime.start(shards("qwen2", 2, 1), backend="gloo", timeout_s=30.0, threads=1)
    try:
        thread, outcome = _generate_in_background(rt)
        os.kill(rt.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        thread.join(30.0)
        elapsed = time.monotonic() - t0
        assert not thread.is_alive(), "generate() did not return after a rank was killed"
        error = outcome["error"]
        assert isinstance(error, RankFailure), repr(error)
        message = str(error)
        assert "rank 1 killed by SIGKILL" in message
        # Rank 0 itself noticed, failed its collective and named rank 1 (it did not hang, nor was it just killed).
        assert "rank 0: the exchange due before module" in message or "rank 0: the final reduction" in message \
            or "rank 0: the token broadcast" in message, message
        assert "rank 1 stopped responding" in message, message
        assert elapsed < 20.0, elapsed
        assert _all_gone(rt) and not rt.alive
        with pytest.raises(RuntimeStopped):
            rt.generate(tokens(1, 3).numpy())
    finally:
        rt.stop(force=True)


def test_a_hung_rank_times_out_and_is_named(shards: Any) -> None:
    """SIGSTOP: no connection closes, so only the collective timeout can notice; it does, and names the rank."""
    timeout_s = 4.0
    rt = DTPRuntime.start(shards("llama", 2, 1), backend="gloo", timeout_s=timeout_s, threads=1)
    try:
        thread, outcome = _generate_in_background(rt)
        os.kill(rt.pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        thread.join(timeout_s + 30.0)
        elapsed = time.monotonic() - t0
        assert not thread.is_alive(), "generate() did not return after a rank hung"
        message = str(outcome["error"])
        assert isinstance(outcome["error"], RankFailure), message
        assert message.count("rank 1 stopped responding") >= 1 and "rank 0: " in message, message
        assert timeout_s - 1.0 <= elapsed < timeout_s + 20.0, elapsed
        deadline = time.monotonic() + 15.0
        while not _all_gone(rt) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _all_gone(rt)
    finally:
        rt.stop(force=True)


def test_a_rank_killed_while_loading_is_named_by_the_others(shards: Any, tmp_path: Any) -> None:
    """Rank 1 is still hashing a large shard when it is killed; rank 0, waiting for it to agree that every
    rank loaded, notices its heartbeat stop and fails naming it (it does not wait for the load timeout)."""
    slow = tmp_path / "shards"
    shutil.copytree(shards("llama", 2, 1), slow)
    big = slow / "model-rank-1-part-0.safetensors"
    with open(big, "wb") as f:
        f.truncate(8 << 30)  # sparse: no disk, but 8 GiB to hash
    manifest = json.loads((slow / "manifest.json").read_text())
    manifest["files"][1]["size"] = 8 << 30
    (slow / "manifest.json").write_text(json.dumps(manifest))
    rt = DTPRuntime.start(world_size=2, backend="gloo", timeout_s=30.0, threads=1)
    outcome: dict[str, BaseException] = {}

    def load() -> None:
        try:
            rt.load(slow)
        except BaseException as exc:
            outcome["error"] = exc

    try:
        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive(), outcome
        os.kill(rt.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        thread.join(30.0)
        assert not thread.is_alive()
        message = str(outcome["error"])
        assert isinstance(outcome["error"], RankFailure), message
        assert "rank 1 killed by SIGKILL" in message, message
        assert "rank 0: agreeing that every rank loaded its shard failed: rank 1 stopped responding" in message
        assert time.monotonic() - t0 < 20.0
        assert _all_gone(rt)
    finally:
        rt.stop(force=True)


def test_a_rank_dead_between_commands_is_reported_at_the_next(shards: Any) -> None:
    """Idle ranks wait on the launcher, not on each other: the launcher checks them before every command."""
    rt = DTPRuntime.start(world_size=1, backend="gloo", timeout_s=30.0, threads=1)
    try:
        os.kill(rt.pids[0], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(RankFailure, match=r"rank 0 killed by SIGKILL while idle"):
            rt.load(shards("llama", 2, 1))
        assert _all_gone(rt)
    finally:
        rt.stop(force=True)
