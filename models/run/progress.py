"""How long work reports progress and is asked to stop: one callback type for the whole package.

A `Progress` is called as progress(stage, fraction) with fraction in [0, 1] of that stage; the CLI
draws bars from it and the worker stores it on the job row. A `ShouldStop` is polled between units
of work (micro-batches, optimiser steps); when it returns True the work raises `Cancelled` and
leaves whatever it has already made durable (checkpoints, caches) in place. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, float], None]
ShouldStop = Callable[[], bool]


class Cancelled(RuntimeError):
    """The caller asked the work to stop (checked between units of work)."""
