"""A stopped run's work ends (models.base.progress.StopSignal): its sandboxed child process and the child's
process group are killed within the grace period — also a child whose SIGTERM handler only notes it (as
a forked Celery worker's does) or that ignores SIGTERM — and the work done in the run's thread stops at
its next safe point: a calibration set tokenised by a backtracking regex (`b*b*\\d` over lines of
2,000 `b`s, minutes of CPU per chunk), each GGUF tensor loaded, each optimiser layer, each tensor exported.
Before this, each went on until it finished or hit its own limit (300 CPU-s for the tokenizer)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from models.base.progress import Cancelled, StopSignal, check_stop, stopped_by
from models.io.sandbox import STOP_GRACE_S, ChildLimits, run_limited

# The child may spin for a minute: only the stop ends it within the test's bounds.
LONG = ChildLimits(memory_bytes=256 << 20, cpu_s=60, timeout_s=120)
# From the stop to the child gone: the poll (0.1 s), SIGTERM, and SIGKILL after the grace; slack for 2 busy cores.
GONE_WITHIN_S = STOP_GRACE_S + 2.0


def _spin(report: Any) -> None:
    report("spin.json")
    while True:
        pass


def _spin_ignoring_sigterm(ready: str, report: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(ready).touch()
    _spin(report)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run_stopped_after(call: Any, delay_s: float, ready: Path | None = None) -> tuple[BaseException | None, int, float,
                                                                                      float]:
    """`call()` in a thread under a stop signal set `delay_s` after its child appears (and `ready` exists):
    (what it raised, the child's pid, seconds from the stop to the call's end, seconds from the stop to
    the child gone)."""
    before = _children()
    stop, outcome = StopSignal(), {}

    def target() -> None:
        with stopped_by(stop):
            try:
                call()
            except BaseException as exc:  # what the call ended with is the test's subject
                outcome["raised"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (new := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert new, "the child process never started"
    (pid,) = new
    while ready is not None and not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(delay_s)
    assert not _gone(pid)
    assert os.getpgid(pid) == pid  # a process group of its own: what the stop kills
    t0 = time.monotonic()
    stop.set("cancelled during calibration")
    while not _gone(pid) and time.monotonic() - t0 < 30:
        time.sleep(0.01)
    gone_s = time.monotonic() - t0
    thread.join(30)
    return outcome.get("raised"), pid, time.monotonic() - t0, gone_s


@pytest.mark.serial  # a wall-time bound
def test_a_stop_kills_a_child_whose_sigterm_handler_only_notes_it():
    """A Python handler for SIGTERM in the caller (Celery's warm-shutdown one) is inherited by a forked
    child, where it noted the signal and went on: the child resets it to the default action."""
    noted: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, _frame: noted.append(sig))
    try:
        raised, pid, ended_s, gone_s = _run_stopped_after(
            lambda: run_limited(_spin, (), limits=LONG, what="spin.json"), delay_s=0.5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert isinstance(raised, Cancelled) and "cancelled during calibration" in str(raised), raised
    assert gone_s < GONE_WITHIN_S and ended_s < GONE_WITHIN_S + 1, (gone_s, ended_s)
    assert not psutil.pid_exists(pid) or _gone(pid)
    print(f"stop → child gone: {gone_s:.2f} s")


@pytest.mark.serial  # a wall-time bound
def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path):
    ready = tmp_path / "ignoring"
    raised, _pid, ended_s, gone_s = _run_stopped_after(
        lambda: run_limited(_spin_ignoring_sigterm, (str(ready),), limits=LONG, what="spin.json"), delay_s=0.2,
        ready=ready)
    assert isinstance(raised, Cancelled), raised
    assert STOP_GRACE_S - 0.2 < gone_s < GONE_WITHIN_S, gone_s  # SIGTERM ignored; SIGKILL after the grace
    assert ended_s < GONE_WITHIN_S + 1


@pytest.mark.serial  # a wall-time bound
def test_a_stopped_calibration_kills_its_tokenizer_child(tmp_path: Path):
    from models.data.calibration import CalibrationSpec, load_blocks
    from tests.tiny import backtracking_tokenizer

    text = tmp_path / "bs.txt"
    text.write_text(("b" * 2000 + "\n") * 64)
    spec = CalibrationSpec(source=str(text), sequences=8, seq_len=1024)
    raised, _pid, ended_s, gone_s = _run_stopped_after(lambda: load_blocks(spec, backtracking_tokenizer()), delay_s=1.0)
    assert isinstance(raised, Cancelled), raised
    assert gone_s < GONE_WITHIN_S and ended_s < GONE_WITHIN_S + 1, (gone_s, ended_s)
    print(f"stop → tokenizer child gone: {gone_s:.2f} s")


def test_check_stop_does_nothing_outside_a_stopped_run():
    check_stop()  # the CLI's runs: no signal
    stop = StopSignal()
    with stopped_by(stop):
        check_stop()
        stop.set("lease lost")
        stop.set("a later reason")  # the first reason stays
        with pytest.raises(Cancelled, match="lease lost"):
            check_stop()
    check_stop()  # outside the block again


def _stop_at_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, n: int, stop: StopSignal) -> list[int]:
    """Count the calls the safe point wrapping `owner.name` lets through, setting `stop` in the n-th."""
    calls: list[int] = []
    original = getattr(owner, name).__wrapped__

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            stop.set(f"cancelled during loading ({name})")
        return original(*args, **kwargs)

    monkeypatch.setattr(getattr(owner, name), "__wrapped__", counting)
    return calls


@pytest.mark.parametrize(("where", "n"), [("dequantize", 3), ("_get_field_parts", 5), ("_gguf_parse_value", 5)])
def test_a_stopped_gguf_load_ends_at_its_next_tensor_or_metadata_value(tmp_path: Path, monkeypatch, where: str,
                                                                       n: int):
    """Each tensor dequantised, each metadata field or array element read and each value parsed is a safe
    point: the load raises there, with nothing more done after the stop."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    from models.io.loading import ModelSource, load_model
    from tests.tiny import tiny_gguf

    path = tmp_path / "tiny.gguf"
    tiny_gguf(path)
    load_model(ModelSource(str(path)))  # unstopped: loads, and installs the safe points
    owner = {"dequantize": gguf, "_get_field_parts": gguf.GGUFReader, "_gguf_parse_value": hf_gguf}[where]
    assert getattr(getattr(owner, where), "checks_stop", False)
    stop = StopSignal()
    calls = _stop_at_call(monkeypatch, owner, where, n, stop)
    with stopped_by(stop), pytest.raises(Cancelled, match="cancelled during loading"):
        load_model(ModelSource(str(path)))
    assert len(calls) == n  # none after the stop


def test_a_stopped_optimiser_ends_at_its_next_layer():
    from models.optimise import optimise
    from tests.models.optimise.kit import affinity_of

    affinity = affinity_of(4, 8, 64, seed=1)
    stop = StopSignal()
    stop.set("cancelled during optimising")
    with stopped_by(stop), pytest.raises(Cancelled, match="optimising"):
        optimise(affinity, 4)
    assert optimise(affinity, 4).sweeps >= 1  # without the signal it runs as before


def test_a_stopped_export_ends_at_its_next_tensor(tmp_path: Path):
    from models.export.resident import export_rank_shards
    from models.families import model_shape
    from models.layouts import layout as lay
    from tests.tiny import tiny_model

    model = tiny_model("llama")
    layout = lay.contiguous(model_shape(model.config), 2)
    written: list[float] = []
    stop = StopSignal()

    def progress(_stage: str, fraction: float) -> None:
        written.append(fraction)
        if len(written) == 2:
            stop.set("cancelled during exporting")

    with stopped_by(stop), pytest.raises(Cancelled, match="exporting"):
        export_rank_shards(model, layout, tmp_path / "shards", progress=progress)
    assert len(written) == 2  # no tensor written after the stop
    assert not (tmp_path / "shards").exists()  # the writers aborted, nothing published
