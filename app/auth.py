"""Optional API keys: with DTP_LAYOUT_API_KEYS=name:key,... every /v1 request needs `X-API-Key`,
and the key's name is the owner recorded on the jobs it submits. Unset: the API is open."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request, Security
from fastapi.security import APIKeyHeader

api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False,
                              description="required when the server sets DTP_LAYOUT_API_KEYS")


def owner(request: Request, key: str | None = Security(api_key_header)) -> str | None:
    """The caller's owner name (None when the API is open); 401 for a missing or unknown key."""
    table: dict[str, str] = request.app.state.api_keys
    if not table:
        return None
    if key:
        for known, name in table.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return name
    raise HTTPException(status_code=401, detail="missing or unknown X-API-Key",
                        headers={"WWW-Authenticate": "X-API-Key"})
