"""Who is calling: the X-API-Key dependency, the per-key rate limit, and the bind-address rule.

With keys (app/keys.py), every /v1 request needs `X-API-Key`; the key names a tenant, and the caller
sees only that tenant's jobs unless the key is an admin key. With no key at all the API is open (one
user on loopback): every caller sees everything, and jobs have no owner.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from fastapi import Request, Security
from fastapi.security import APIKeyHeader

from app import logs
from app.errors import TooManyRequests, Unauthorized
from app.keys import MAX_KEY_LENGTH, KeyRing
from app.ratelimit import RateLimiter

api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False,
                              description="an API key from `dtp-layout keys create` (needed once any key exists)")


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # the owner recorded on the jobs it submits; None when the API is open
    admin: bool  # sees and cancels every tenant's jobs (everyone is, when the API is open)
    key_name: str | None = None


OPEN = Caller(tenant=None, admin=True)


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _charge(limiter: RateLimiter, who: str, what: str) -> None:
    wait = limiter.take(who)
    if wait > 0:
        per_min = round(limiter.rate * 60)
        raise TooManyRequests(f"rate limit: at most {per_min} requests per minute {what} (bursts of "
                              f"{int(limiter.burst)}); retry after {wait:.1f} s", field="X-API-Key",
                              retry_after_s=wait)


def caller(request: Request, key: str | None = Security(api_key_header)) -> Caller:
    """The calling tenant; 401 for a missing, unknown or revoked key, 429 over the rate limit."""
    state = request.app.state
    ring: KeyRing = state.keys
    limiter: RateLimiter = state.rate_limiter
    if not ring.keyed():
        _charge(limiter, f"addr:{_client(request)}", "per client address")
        return OPEN
    info = ring.lookup(key) if key and len(key) <= MAX_KEY_LENGTH else None
    if info is None:
        _charge(limiter, f"addr:{_client(request)}", "per client address without a valid key")
        if not key:
            raise Unauthorized("this server needs an X-API-Key header (its operator makes keys with "
                               "`dtp-layout keys create NAME`)")
        raise Unauthorized("unknown or revoked X-API-Key")
    logs.update(tenant=info.tenant)
    _charge(limiter, f"key:{info.name}", f"for key {info.name!r}")
    return Caller(tenant=info.tenant, admin=info.admin, key_name=info.name)


def is_loopback(host: str) -> bool:
    if host.strip("[]") in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(host: str, *, keyed: bool, insecure_open: bool) -> str | None:
    """Why `serve` must not listen on `host`, or None: off loopback the API needs keys."""
    if keyed or insecure_open or is_loopback(host):
        return None
    return (f"refusing to listen on {host} without API keys: anyone who can reach it could submit jobs and read "
            "every result. Create a key first (`dtp-layout keys create NAME --admin`), or pass --insecure-open "
            "to run open on purpose.")
