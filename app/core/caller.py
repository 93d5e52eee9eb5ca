"""Who a request or job acts for: its tenant, and whether it sees every tenant's jobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # the owner recorded on the jobs it submits; None when the API is open
    admin: bool  # sees and cancels every tenant's jobs (everyone is, when the API is open)
    key_name: str | None = None


OPEN = Caller(tenant=None, admin=True)
