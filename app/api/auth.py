"""Who is calling: the X-API-Key dependency, the per-key rate limit, and the bind-address rule.

With keys (app/core/keys.py), every /v1 request needs `X-API-Key`; the key names a tenant, and the caller
sees only that tenant's jobs unless the key is an admin key. With no key at all the API is open (one
user on loopback): every caller sees everything, and jobs have no owner.

Who is calling is decided before anything reads the request's body: `CallerGate`, a pure ASGI
middleware, checks the key and charges the rate limit for every /v1 and /ui/api request as soon as
its headers are in, answers 401/429 itself (with `Connection: close` when a body was announced, so
that the server does not read it), and leaves the `Caller` in the request's state for the `caller`
dependency. A malformed or oversized body from someone without a key is therefore 401, and a flood
over the rate limit 429, without a byte of it parsed.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from fastapi import Request, Security
from fastapi.security import APIKeyHeader
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import error_response
from app.api.ratelimit import RateLimiter
from app.core import logs
from app.core.caller import OPEN, Caller
from app.core.errors import ApiError, TooManyRequests, Unauthorized
from app.core.keys import MAX_KEY_LENGTH, KeyRing

api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False,
                              description="an API key from `dtp-layout keys create` (needed once any key exists)")




def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _charge(limiter: RateLimiter, who: str, what: str) -> None:
    wait = limiter.take(who)
    if wait > 0:
        per_min = round(limiter.rate * 60)
        raise TooManyRequests(f"rate limit: at most {per_min} requests per minute {what} (bursts of "
                              f"{int(limiter.burst)}); retry after {wait:.1f} s", field="X-API-Key",
                              retry_after_s=wait)


async def identify(state: Any, key: str | None, client: str) -> Caller:
    """The caller presenting `key` from address `client`; Unauthorized (401) for a missing, unknown or
    revoked key, TooManyRequests (429) over the rate limit.

    Async: it runs on the event loop (no worker-thread round trip per request): hashing the key, a dict
    lookup and the rate limiter are microseconds; only the key table's periodic re-read touches the
    database, and that runs in a worker thread."""
    ring: KeyRing = state.keys
    limiter: RateLimiter = state.rate_limiter
    if ring.stale():
        await run_in_threadpool(ring.refresh)
    if not ring.keyed():
        _charge(limiter, f"addr:{client}", "per client address")
        return OPEN
    info = ring.lookup(key) if key and len(key) <= MAX_KEY_LENGTH else None
    if info is None:
        _charge(limiter, f"addr:{client}", "per client address without a valid key")
        if not key:
            raise Unauthorized("this server needs an X-API-Key header (its operator makes keys with "
                               "`dtp-layout keys create NAME`)")
        raise Unauthorized("unknown or revoked X-API-Key")
    logs.update(tenant=info.tenant)
    _charge(limiter, f"key:{info.name}", f"for key {info.name!r}")
    return Caller(tenant=info.tenant, admin=info.admin, key_name=info.name)


async def caller(request: Request, key: str | None = Security(api_key_header)) -> Caller:
    """The calling tenant, as `CallerGate` found it before the body was read; a route outside the
    gate's paths (or an app without the gate) decides here, the same way."""
    known = request.scope.get("state", {}).get(STATE_KEY)
    if isinstance(known, Caller):
        return known
    return await identify(request.app.state, key, _client(request))


STATE_KEY = "caller"
# The paths whose routes take the caller: decided before the body is read. Any other route that takes
# it (none today) still gets it from the dependency.
GUARDED = ("/v1", "/ui/api/")
_KEY_HEADER = b"x-api-key"


def _guarded(path: str) -> bool:
    return path == GUARDED[0] or path.startswith((GUARDED[0] + "/", *GUARDED[1:]))


def _announces_body(headers: Any) -> bool:
    for name, value in headers:
        if (name == b"content-length" and value.strip() not in (b"", b"0")) or name == b"transfer-encoding":
            return True
    return False


class CallerGate:
    """Key check and rate limit for /v1 and /ui/api, before the route reads or parses the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):]
        if not _guarded(path):
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        key = next((value.decode("latin-1") for name, value in headers if name == _KEY_HEADER), None)
        client = scope.get("client")
        try:
            who = await identify(scope["app"].state, key, client[0] if client else "unknown")
        except ApiError as exc:
            extra = {"Connection": "close"} if _announces_body(headers) else {}
            response = error_response(exc.status, exc.detail, exc.field, {**exc.headers, **extra}, code=exc.code)
            await response(scope, receive, send)
            return
        except Exception:
            # e.g. the key table unreadable: the route's dependency decides again, and the app's
            # exception handlers answer (503) as for any route
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[STATE_KEY] = who
        await self.app(scope, receive, send)


def install(app: Any) -> None:
    app.add_middleware(CallerGate)


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
