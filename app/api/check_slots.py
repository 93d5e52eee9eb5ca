"""Upload completions are checked off the threads that answer requests, a bounded number at once.

Completing an upload assembles its files and reads what they hold (app.core.upload_checks: in a child
process, for up to DTP_LAYOUT_UPLOAD_CHECK_TIMEOUT_S). Run on the route threads, as many hostile
completions as API threads would leave no thread for another tenant's `GET /v1/jobs` or `/healthz`.
Here each completion holds a slot: at most DTP_LAYOUT_UPLOAD_CHECKS_PER_TENANT of one tenant's (more
is 429) and DTP_LAYOUT_UPLOAD_CHECKS_MAX in all (more is 503), both with Retry-After, and it runs in
a thread of its own capacity limiter, never one of the DTP_LAYOUT_API_THREADS that serve the others.
Slots are counted on the event loop's thread: no lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from app.core.errors import ServiceUnavailable, TooManyRequests

RETRY_AFTER_S = 5


class CheckSlots:
    def __init__(self, *, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self.held: dict[str, int] = {}
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """The threads completions run in (made on first use: inside the event loop)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.total)
        return self._limiter

    @contextmanager
    def slot(self, tenant: str | None) -> Iterator[None]:
        """Hold one slot for `tenant` while the block runs; 429 or 503 (Retry-After) when none is free."""
        key = tenant or ""
        if self.held.get(key, 0) >= self.per_tenant:
            raise TooManyRequests(f"{self.per_tenant} of this tenant's upload completions are being checked; "
                                  "complete this one when they are done (DTP_LAYOUT_UPLOAD_CHECKS_PER_TENANT)",
                                  field="upload_id", retry_after_s=RETRY_AFTER_S, code="too_many_checks")
        if sum(self.held.values()) >= self.total:
            raise ServiceUnavailable(f"{self.total} upload completions are being checked on this server; try again "
                                     "shortly (DTP_LAYOUT_UPLOAD_CHECKS_MAX)", field="upload_id",
                                     headers={"Retry-After": str(RETRY_AFTER_S)}, code="checks_busy")
        self.held[key] = self.held.get(key, 0) + 1
        try:
            yield
        finally:
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]
