"""Readiness: is the database reachable, and is the broker reachable and this service's.

`/readyz` needs no key, so it must cost next to nothing whoever calls it (issue 41: 40 clients at 117
req/s, each call a database and a broker round trip on a request thread, moved another tenant's p50 from
25 to 216 ms). The round trips run at most once per CACHE_S, in one thread, whoever is waiting; the
answer in between comes from the event loop. The route itself is rate-limited per client address.

The broker's database identity (app.core.broker_owner): `serve` and `worker` mark the broker with their
database's and refuse another's; the API now does the same at startup — a broker that serves another
database stops it (two services sharing a broker drop each other's jobs after a few deliveries, and
those jobs stayed queued while /readyz said 200). A database or broker it cannot reach at startup does
not stop it: the mark is tried again by each probe, and until it is made /readyz answers 503.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import anyio

from app.core.broker_owner import mark_broker
from app.core.settings import Settings

log = logging.getLogger(__name__)
CACHE_S = 1.5
UNREACHABLE = "error: unreachable (the reason is in the server's log)"
FOREIGN = "error: it serves another database (the reason is in the server's log)"


class BrokerServesAnother(RuntimeError):
    """The broker carries another database's mark: this API must not start on it."""


class Readiness:
    """The cached answer to /readyz: (ready, checks)."""

    def __init__(self, settings: Settings, database_probe: Callable[[], None], broker_probe: Callable[[], None],
                 *, cache_s: float = CACHE_S) -> None:
        self.settings, self.cache_s = settings, cache_s
        self.probes = {"database": database_probe, "broker": broker_probe}
        self.marked = False  # the broker carries this service's database's mark
        self.refusal: str | None = None
        self._answer: tuple[bool, dict[str, str]] | None = None
        self._at = float("-inf")
        self._lock: anyio.Lock | None = None
        self._mark_lock = threading.Lock()

    def mark(self) -> None:
        """Mark the broker as this database's (idempotent). BrokerServesAnother when it serves another;
        any other failure (the database or the broker down) leaves it unmarked, to be tried again."""
        with self._mark_lock:
            if self.marked:
                return
            refusal = mark_broker(self.settings)
            if refusal is not None:
                self.refusal = refusal
                raise BrokerServesAnother(refusal)
            self.marked = True

    def startup(self) -> None:
        """At the API's start: refuse a broker of another database; say so in the log when the mark
        could not be checked (the probes try again)."""
        try:
            self.mark()
        except BrokerServesAnother:
            raise
        except Exception as exc:
            log.warning("could not check which database the broker serves (%s: %s); /readyz answers 503 until "
                        "it is checked", type(exc).__name__, str(exc)[:200])

    def check(self) -> tuple[bool, dict[str, str]]:
        """The round trips (in a thread): each dependency's state, the broker's mark included."""
        checks: dict[str, str] = {}
        for name, probe in self.probes.items():
            try:
                probe()
                checks[name] = "ok"
            except Exception:
                log.warning("readyz: the %s is unreachable", name, exc_info=True)
                checks[name] = UNREACHABLE
        if checks["broker"] == "ok":
            try:
                self.mark()
            except BrokerServesAnother as exc:
                log.error("readyz: %s", exc)
                checks["broker"] = FOREIGN
            except Exception:
                log.warning("readyz: could not check which database the broker serves", exc_info=True)
                checks["broker"] = UNREACHABLE
        return all(v == "ok" for v in checks.values()), checks

    async def answer(self) -> tuple[bool, dict[str, str]]:
        """The latest answer, at most CACHE_S old; one probe at a time, its waiters share its answer."""
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self._answer is None or time.monotonic() - self._at >= self.cache_s:
                self._answer = await anyio.to_thread.run_sync(self.check)
                self._at = time.monotonic()
            return self._answer
