"""Waits that stretch with the machine's load: a test's wait on a process's start-up (a server's banner, a
browser, the ranks of a runtime) is a bound on readiness, not a measurement, and on a busy machine (a CI
runner beside other jobs, `make test` beside a running job) the same start-up takes several times longer.

The stretch is the 1-minute load average per core, never below 1 (an idle or normally busy machine keeps
the figures as written) and at most MAX_STRETCH (a real hang still fails, later). A `Deadline` re-reads
the load while it is waited on, so a machine that becomes busy during the wait stretches it too. Waits
that stand for a promise of the product (a watchdog's seconds, a request's timeout) are not stretched.
"""

from __future__ import annotations

import os
import time

MAX_STRETCH = 8.0


def load_stretch() -> float:
    """How many times longer than on an idle machine a start-up may take now: load average per core, 1–8."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform: the figures as written
        return 1.0
    return min(MAX_STRETCH, max(1.0, per_core))


def patient(seconds: float) -> float:
    """`seconds` as written for an idle machine, stretched by the load now."""
    return seconds * load_stretch()


class Deadline:
    """`seconds` from now, stretched by the highest load seen while waiting."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.t0, self.stretch = seconds, time.monotonic(), load_stretch()

    def left(self) -> float:
        self.stretch = max(self.stretch, load_stretch())
        return self.t0 + self.seconds * self.stretch - time.monotonic()

    def expired(self) -> bool:
        return self.left() <= 0

    def bound(self) -> str:
        """What the wait allowed, for a failure's message."""
        return f"{self.seconds:.0f} s × load stretch {self.stretch:.1f}"
