"""Serves the dashboard: `/ui/…` is the single-page app (every route answers index.html), the files
under `/ui/static/` come from this package, and `/ui/api/models` lists the names a job may give as
`model.id`. The pages talk to the /v1 API like any other client (X-API-Key when keys are on).

Static files are read once from the package and looked up by name in that table: a request path
never becomes a file path. Torch-free.
"""

from __future__ import annotations

import hashlib
import html
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import RedirectResponse, Response

from app.api.deps import CallerDep
from app.core.services.sources import SourceError, resolve_model

router = APIRouter(include_in_schema=False)

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".txt": "text/plain; charset=utf-8",
    ".md": "text/plain; charset=utf-8",
}
# Only this origin's scripts, styles and API; no inline script, no frames, no plugins.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
       "font-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}
MAX_MODELS = 200


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


def _walk(node: Traversable, prefix: str = "") -> Iterator[tuple[str, Traversable]]:
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.name.startswith("."):
            continue
        name = f"{prefix}{child.name}"
        if child.is_dir():
            yield from _walk(child, f"{name}/")
        elif Path(child.name).suffix in MEDIA_TYPES:
            yield name, child


@lru_cache(maxsize=1)
def static_assets() -> dict[str, Asset]:
    """Every file under app/ui/static by its relative name (read once per process)."""
    assets = {}
    for name, node in _walk(resources.files("app.ui") / "static"):
        body = node.read_bytes()
        assets[name] = Asset(body=body, media_type=MEDIA_TYPES[Path(name).suffix],
                             etag=f'"{hashlib.sha256(body).hexdigest()[:32]}"')
    return assets


def _root(request: Request) -> str:
    return str(request.scope.get("root_path") or "").rstrip("/")


def _index(request: Request) -> Response:
    page = static_assets()["index.html"].body.decode()
    page = page.replace("__BASE__", html.escape(f"{_root(request)}/ui/", quote=True))
    return Response(page, media_type=MEDIA_TYPES[".html"], headers={**SECURITY_HEADERS, "Cache-Control": "no-store"})


@router.get("/")
def home(request: Request) -> RedirectResponse:
    return RedirectResponse(f"{_root(request)}/ui/", status_code=307)


def asset_response(request: Request, asset: Asset | None, *, name: str, what: str) -> Response:
    """A packaged static file (the dashboard's, the API docs'): 404 naming it when absent, 304 when the
    client's ETag matches, else the bytes; always under the security headers."""
    if asset is None:
        raise HTTPException(status_code=404, detail=f"no {what} file {name!r}")
    headers = {**SECURITY_HEADERS, "ETag": asset.etag, "Cache-Control": "no-cache"}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.media_type, headers=headers)


@router.api_route("/ui/static/{name:path}", methods=["GET", "HEAD"])
def static(request: Request, name: str) -> Response:
    return asset_response(request, static_assets().get(name), name=name, what="dashboard")


def _gguf_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.gguf") if p.is_file())[:20]


def model_catalogue(model_root: Path, limit: int = MAX_MODELS) -> list[dict[str, Any]]:
    """The names under the model root a job may give as `model.id` (two levels: `name` and `team/name`),
    with the .gguf files of each directory; every name is checked as a submission would check it."""
    root = Path(model_root)
    if not root.is_dir():
        return []
    found: list[dict[str, Any]] = []

    def consider(path: Path, name: str) -> bool:
        """Adds `name` when it is a model; False when it is a plain directory to look into."""
        try:
            if path.is_file():
                if path.suffix == ".gguf":
                    resolve_model(root, name)
                    found.append({"id": name, "gguf_files": []})
                return True
            ggufs = _gguf_files(path)
            if (path / "config.json").is_file() or ggufs:
                resolve_model(root, name, gguf_file=None if (path / "config.json").is_file() else ggufs[0])
                found.append({"id": name, "gguf_files": ggufs})
                return True
        except (SourceError, OSError):
            return True
        return False

    base = root.resolve()
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if len(found) >= limit:
            break
        if entry.name.startswith(".") or not entry.resolve().is_relative_to(base) or consider(entry, entry.name):
            continue
        try:
            children = sorted(entry.iterdir(), key=lambda p: p.name)
        except OSError:
            continue
        for child in children:
            if len(found) >= limit:
                break
            if not child.name.startswith("."):
                consider(child, f"{entry.name}/{child.name}")
    return found[:limit]


@router.get("/ui/api/models")
def models(request: Request, _caller: CallerDep) -> dict[str, Any]:
    """Needs a valid key like /v1 once the service has keys (the model root is shared by every tenant)."""
    return {"items": model_catalogue(request.app.state.settings.models_dir)}


@router.api_route("/ui", methods=["GET", "HEAD"])
def ui_without_slash(request: Request) -> RedirectResponse:
    """`/ui` (the address `dtp-layout serve` prints) is `/ui/`: the page's relative links and its routes
    are under `/ui/`, so the address is made canonical before the page loads (the query kept)."""
    query = request.url.query
    return RedirectResponse(f"{_root(request)}/ui/" + (f"?{query}" if query else ""), status_code=307)


@router.api_route("/ui/{route:path}", methods=["GET", "HEAD"])
def page(request: Request, route: str = "") -> Response:
    """Every dashboard route is the same page; the script draws the route."""
    return _index(request)
