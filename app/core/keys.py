"""API keys: made by `dtp-layout keys create`, stored as their sha256 digest, looked up in constant time.

A key is `dtpk_` + 43 url-safe characters (256 random bits). Only its sha256 digest is stored: in
the `api_keys` table (created, listed and revoked with `dtp-layout keys`; takes effect within
DTP_LAYOUT_KEY_CACHE_S), or as a `NAME:sha256:HEX[:admin]` entry of DTP_LAYOUT_API_KEYS. A plain,
unsalted sha256 is enough for a 256-bit random secret: neither a dictionary nor a brute force can
invert it, and a slow salted hash would cost every request for nothing.

Each key belongs to a tenant (its name unless `--tenant` says otherwise): the jobs it submits carry
the tenant as `owner`, and it sees only its tenant's jobs. An admin key sees and cancels all jobs.
The API is keyed as soon as any key exists (revoked ones included, so that revoking the last key
never reopens it) or DTP_LAYOUT_REQUIRE_KEYS is set; otherwise it is open (loopback use).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from app.core import safe_text
from app.core.db import ApiKey, Database, utcnow
from app.core.settings import KEY_NAME, Settings

KEY_PREFIX = "dtpk_"
MAX_KEY_LENGTH = 256  # longer X-API-Key values are refused before hashing


@dataclass(frozen=True)
class KeyInfo:
    name: str
    tenant: str
    admin: bool
    source: str  # "database" or "settings"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def settings_entry(name: str, key: str, *, admin: bool = False, tenant: str | None = None) -> str:
    """The DTP_LAYOUT_API_KEYS entry of a key (its digest, never the key)."""
    flags = (":admin" if admin else "") + (f":tenant={tenant}" if tenant and tenant != name else "")
    return f"{name}:sha256:{key_digest(key)}{flags}"


def check_name(value: str, what: str) -> str:
    """`value` NFC-normalised (app/core/safe_text.py) if it is a key or tenant name; else ValueError."""
    value = safe_text.nfc(value)
    if not KEY_NAME.fullmatch(value):
        raise ValueError(f"{what} {value!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a letter "
                         "or digit")
    return value


class KeyRing:
    """The keys the API accepts: the settings' entries and the table's live rows, re-read from the
    database at most every `key_cache_s` seconds. One request at a time re-reads the table; the others
    go on with the entries already loaded instead of queueing behind it (and holding a worker thread)."""

    def __init__(self, settings: Settings, db: Database) -> None:
        self.settings, self.db = settings, db
        self._static = [(bytes.fromhex(d), KeyInfo(name, tenant, admin, "settings"))
                        for name, d, admin, tenant in settings.key_entries()]
        self._lock = threading.Lock()
        self._loaded_at = -1e18
        self._entries: list[tuple[bytes, KeyInfo]] = list(self._static)
        self._any_key = False

    def stale(self) -> bool:
        """Whether the table should be read again (`refresh`) before answering."""
        return time.monotonic() - self._loaded_at >= self.settings.key_cache_s

    def refresh(self) -> None:
        """Re-read the table if it is stale. Blocks only the first caller; a concurrent one returns at
        once and uses the entries already loaded (after the very first load, which everyone waits for)."""
        if not self.stale():
            return
        first = self._loaded_at < 0
        if not self._lock.acquire(blocking=first):
            return
        try:
            if not self.stale():
                return
            started = time.monotonic()  # a key revoked before this read is refused from now on
            with self.db.session() as session:
                rows = session.execute(select(ApiKey.name, ApiKey.tenant, ApiKey.digest, ApiKey.admin,
                                              ApiKey.revoked_at)).all()
            # replaced whole: readers never see a half-built table
            self._entries = self._static + [(bytes.fromhex(r.digest), KeyInfo(r.name, r.tenant, r.admin, "database"))
                                            for r in rows if r.revoked_at is None]
            self._any_key = bool(rows or self._static)
            self._loaded_at = started
        finally:
            self._lock.release()

    def keyed(self) -> bool:
        """Whether requests need a key."""
        if self.settings.require_keys or self._static:
            return True
        self.refresh()
        return self._any_key

    def lookup(self, key: str) -> KeyInfo | None:
        """The key's owner, comparing its digest with every known digest in constant time."""
        self.refresh()
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known, info in self._entries:
            if hmac.compare_digest(known, digest):  # no early exit: the time does not depend on which matched
                found = info
        return found


# ---- the table, for `dtp-layout keys` --------------------------------------------------------------

def create_key(db: Database, *, name: str, tenant: str | None = None, admin: bool = False) -> str:
    """A new key stored by digest; the key itself is returned once. ValueError for a taken name."""
    check_name(name, "key name")
    check_name(tenant or name, "tenant")
    key = new_key()
    try:
        with db.transaction() as session:
            session.add(ApiKey(name=name, tenant=tenant or name, digest=key_digest(key), admin=admin,
                               created_at=utcnow()))
    except IntegrityError as exc:
        raise ValueError(f"a key named {name!r} already exists (names are never reused, revoked keys "
                         "included)") from exc
    return key


def list_keys(db: Database, settings: Settings) -> list[dict[str, Any]]:
    """Name, tenant, admin flag, source and state of every key (never a digest)."""
    out: list[dict[str, Any]] = [{"name": name, "tenant": tenant, "admin": admin, "source": "settings",
                                  "created_at": None, "revoked_at": None}
                                 for name, _digest, admin, tenant in settings.key_entries()]
    with db.session() as session:
        for row in session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.name)):
            out.append({"name": row.name, "tenant": row.tenant, "admin": row.admin, "source": "database",
                        "created_at": row.created_at, "revoked_at": row.revoked_at})
    return out


def revoke_key(db: Database, name: str) -> bool:
    """Revoke the table's key `name`; False when there is no such live key."""
    with db.transaction() as session:
        row = session.scalars(select(ApiKey).where(ApiKey.name == name)).first()
        if row is None or row.revoked_at is not None:
            return False
        row.revoked_at = utcnow()
    return True
