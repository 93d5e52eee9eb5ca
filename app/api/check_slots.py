"""Upload completions are checked off the threads that answer requests, a bounded number at once.

Completing an upload assembles its files and reads what they hold (app.core.services.upload_checks: in a child
process, for up to DTP_LAYOUT_UPLOAD_CHECK_TIMEOUT_S). Run on the route threads, as many hostile
completions as API threads would leave no thread for another tenant's `GET /v1/jobs` or `/healthz`.
Here each completion holds a slot: at most DTP_LAYOUT_UPLOAD_CHECKS_PER_TENANT of one tenant's (more
is 429) and DTP_LAYOUT_UPLOAD_CHECKS_MAX in all (more is 503), both with Retry-After, and it runs in
a thread of its own capacity limiter, never one of the DTP_LAYOUT_API_THREADS that serve the others.
Slots are counted on the event loop's thread: no lock. A second `complete` of an upload this process is
already completing is 409 before any slot is counted (the database's mark says the same across processes):
a retry of the same upload never spends the tenant's slots nor answers 429 for them.

Slots are shared fairly (issue 41: two tenants holding 2 slowed completions each kept a third one's at 503
for as long as their checks ran). A tenant that already holds a slot takes another only while one stays
free after it — the last free slot is kept for a tenant holding none — and while no other tenant was
refused for want of a slot in the last WAITING_S seconds (that tenant is waiting: it gets the next free
slot). Past its share a tenant is 429 (Retry-After), not the others 503. What one check may cost is
bounded apart (upload_checks: a CPU budget scaled by the bytes it reads).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from app.core.errors import Conflict, ServiceUnavailable, TooManyRequests

RETRY_AFTER_S = 5
WAITING_S = 2 * RETRY_AFTER_S  # a tenant refused 503 this recently counts as waiting for a slot


class CheckSlots:
    def __init__(self, *, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self.held: dict[str, int] = {}
        self.completing: set[tuple[str, str]] = set()  # (tenant, upload id): scoped, so no other tenant learns of it
        self.waiting: dict[str, float] = {}  # tenant → when it was last refused 503 (time.monotonic)
        self._limiter: anyio.CapacityLimiter | None = None

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """The threads completions run in (made on first use: inside the event loop)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.total)
        return self._limiter

    @contextmanager
    def slot(self, tenant: str | None, upload_id: str) -> Iterator[None]:
        """Hold one slot for `tenant` while the block runs; 409 when this tenant's `upload_id` is already
        being completed here, else 429 or 503 (Retry-After) when no slot is free."""
        key = tenant or ""
        if (key, upload_id) in self.completing:
            raise Conflict(f"upload {upload_id!r} is being completed by another request; GET it to see when it "
                           "is complete", field="upload_id", code="upload_completing")
        if self.held.get(key, 0) >= self.per_tenant:
            raise TooManyRequests(f"{self.per_tenant} of this tenant's upload completions are being checked; "
                                  "complete this one when they are done (DTP_LAYOUT_UPLOAD_CHECKS_PER_TENANT)",
                                  field="upload_id", retry_after_s=RETRY_AFTER_S, code="too_many_checks")
        self._check_share(key)
        if sum(self.held.values()) >= self.total:
            self.waiting[key] = time.monotonic()
            raise ServiceUnavailable(f"{self.total} upload completions are being checked on this server; try again "
                                     "shortly (DTP_LAYOUT_UPLOAD_CHECKS_MAX)", field="upload_id",
                                     headers={"Retry-After": str(RETRY_AFTER_S)}, code="checks_busy")
        self.waiting.pop(key, None)
        self.held[key] = self.held.get(key, 0) + 1
        self.completing.add((key, upload_id))
        try:
            yield
        finally:
            self.completing.discard((key, upload_id))
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]

    def others_waiting(self, key: str) -> bool:
        """Whether a tenant other than `key` was refused a slot within WAITING_S (stale entries dropped)."""
        now = time.monotonic()
        for tenant, since in list(self.waiting.items()):
            if now - since > WAITING_S:
                del self.waiting[tenant]
        return any(tenant != key for tenant in self.waiting)

    def _check_share(self, key: str) -> None:
        """429 when `key` already holds a slot and another would take more than its share: the last free
        slot (kept for a tenant holding none), or any while another tenant waits."""
        held = self.held.get(key, 0)
        if not held or not key:  # the open API (no keys) has one user: nobody to share with
            return
        free = self.total - sum(self.held.values())
        if free <= 1 or self.others_waiting(key):
            raise TooManyRequests(f"this tenant holds {held} of the {self.total} upload-check slots and the rest are "
                                  "kept for other tenants; complete this one when one of its checks is done "
                                  "(DTP_LAYOUT_UPLOAD_CHECKS_MAX)", field="upload_id", retry_after_s=RETRY_AFTER_S,
                                  code="too_many_checks")
