"""How long work reports progress and is asked to stop: one callback type for the whole package.

A `Progress` is called as progress(stage, fraction) with fraction in [0, 1] of that stage; the CLI
draws bars from it and the worker stores it on the job row. A `ShouldStop` is polled between units
of work (micro-batches, optimiser steps); when it returns True the work raises `Cancelled` and
leaves whatever it has already made durable (checkpoints, caches) in place.

Work that takes no callback (loading tensors, reading a calibration set in a child process, the
optimiser's sweeps, the export's writes) is stopped through a `StopSignal` instead: whoever runs it
(a worker's job, on a cancel, a lost lease, a stall, a time limit or its shutdown) sets the signal of
the thread the work runs in (`stopped_by`), and the work calls `check_stop()` at its safe points,
which raises `Cancelled` once the signal is set; `models.io.sandbox` kills its child process then.
Outside `stopped_by` (the CLI), `check_stop` does nothing. Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Progress = Callable[[str, float], None]
ShouldStop = Callable[[], bool]


class Cancelled(RuntimeError):
    """The caller asked the work to stop (checked between units of work)."""


class StopSignal:
    """One run's stop: set once, with the reason, by whoever ends the run's work; read at its safe points."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


_current: ContextVar[StopSignal | None] = ContextVar("dtp_layout_stop_signal", default=None)


@contextmanager
def stopped_by(signal: StopSignal) -> Iterator[StopSignal]:
    """The work done in this thread inside the block stops (at its next `check_stop`) once `signal` is set."""
    token = _current.set(signal)
    try:
        yield signal
    finally:
        _current.reset(token)


def current_stop() -> StopSignal | None:
    """The signal the work in this thread answers to, if any."""
    return _current.get()


def check_stop() -> None:
    """A safe point: raise `Cancelled` when the signal of this thread's work is set."""
    signal = _current.get()
    if signal is not None and signal.is_set():
        raise Cancelled(signal.reason or "stopped")
