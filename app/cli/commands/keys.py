"""`dtp-layout keys create | list | revoke`: the service's API keys (app/core/keys.py).

Keys go into the `api_keys` table of DTP_LAYOUT_DATABASE_URL (the migrations are applied first), or
with `create --settings` nowhere: the command then prints the DTP_LAYOUT_API_KEYS entry to add. The
key is printed once, alone on stdout (`KEY=$(dtp-layout keys create ci)`); the rest goes to stderr.
Torch-free, so that it runs in the slim API image.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _settings(args: argparse.Namespace) -> Any:
    from app.core.settings import settings_for_var_dir

    return settings_for_var_dir(getattr(args, "var_dir", None))


def _database(settings: Any) -> Any:
    from app.core.db import database
    from app.core.migrate import upgrade

    if settings.database_url.startswith("sqlite"):
        settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    return database(settings.database_url)


def _fail(message: str) -> int:
    print(f"dtp-layout keys: error: {message}", file=sys.stderr)
    return 2


def cmd_create(args: argparse.Namespace) -> int:
    from app.core.keys import check_name, create_key, new_key, settings_entry

    settings = _settings(args)
    tenant = args.tenant or args.name
    try:
        check_name(args.name, "key name")
        check_name(tenant, "tenant")
        if args.settings:
            key = new_key()
        else:
            key = create_key(_database(settings), name=args.name, tenant=tenant, admin=args.admin)
    except ValueError as exc:
        return _fail(str(exc))
    role = "admin (sees and cancels every tenant's jobs)" if args.admin else f"tenant {tenant!r}"
    print(key)
    if args.settings:
        print(f"\nkey {args.name!r} for {role}: not stored anywhere. Add this entry to DTP_LAYOUT_API_KEYS "
              "(comma-separated) and restart the API:\n\n"
              f"  {settings_entry(args.name, key, admin=args.admin, tenant=tenant)}\n", file=sys.stderr)
    else:
        print(f"\nkey {args.name!r} for {role}: its sha256 digest is stored in the api_keys table; the API accepts "
              f"it within {settings.key_cache_s:g} s. This is the only time the key is shown.", file=sys.stderr)
    print("Send it as a header: curl -H 'X-API-Key: <the key above>' http://HOST:PORT/v1/jobs", file=sys.stderr)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from app.core.keys import list_keys

    settings = _settings(args)
    rows = list_keys(_database(settings), settings)
    if args.json:
        print(json.dumps(rows, default=str, indent=1))
        return 0
    print(f"{'name':<24} {'tenant':<24} {'admin':<5} {'source':<8} {'created':<19} state")
    for r in rows:
        created = r["created_at"].strftime("%Y-%m-%d %H:%M:%S") if r["created_at"] else "-"
        state = f"revoked {r['revoked_at']:%Y-%m-%d %H:%M:%S}" if r["revoked_at"] else "active"
        print(f"{r['name']:<24} {r['tenant']:<24} {'yes' if r['admin'] else 'no':<5} {r['source']:<8} {created:<19} "
              f"{state}")
    if not rows:
        print("(no keys: the API is open unless DTP_LAYOUT_REQUIRE_KEYS is set)", file=sys.stderr)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from app.core.keys import revoke_key

    settings = _settings(args)
    if any(name == args.name for name, *_ in settings.key_entries()):
        return _fail(f"key {args.name!r} is listed in DTP_LAYOUT_API_KEYS: remove its entry there and restart the API")
    if not revoke_key(_database(settings), args.name):
        return _fail(f"no active key named {args.name!r} in the api_keys table (see `dtp-layout keys list`)")
    print(f"revoked key {args.name!r}; the API refuses it within {settings.key_cache_s:g} s", file=sys.stderr)
    return 0


def keys_exist(settings: Any) -> bool:
    """Whether the API will ask for keys (any key in the settings or the table, or REQUIRE_KEYS)."""
    from app.core.db import database
    from app.core.keys import KeyRing

    return KeyRing(settings, database(settings.database_url)).keyed()


def register(sub: Any) -> None:
    p = sub.add_parser("keys", help="API keys of the service: create, list, revoke",
                       description="Keys are stored as their sha256 digest in the api_keys table of "
                                   "DTP_LAYOUT_DATABASE_URL (or, with create --settings, in DTP_LAYOUT_API_KEYS). "
                                   "Once any key exists, every /v1 call needs X-API-Key.")
    keys = p.add_subparsers(dest="keys_command", required=True)
    c = keys.add_parser("create", help="make a key; it is printed once")
    c.add_argument("name", help="key name (letters, digits, '._-'; never reused)")
    c.add_argument("--admin", action="store_true", help="sees and cancels every tenant's jobs")
    c.add_argument("--tenant", help="the tenant whose jobs the key sees and owns (default: the key name); "
                                    "several keys of one team share a tenant")
    c.add_argument("--settings", action="store_true", help="store nothing: print the DTP_LAYOUT_API_KEYS entry")
    c.set_defaults(func=cmd_create)
    s = keys.add_parser("list", help="names, tenants and states (never a key or a digest)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_list)
    r = keys.add_parser("revoke", help="revoke a key of the api_keys table")
    r.add_argument("name")
    r.set_defaults(func=cmd_revoke)
    for q in (c, s, r):
        q.add_argument("--var-dir", help="base directory of the embedded defaults (DTP_LAYOUT_VAR_DIR)")
