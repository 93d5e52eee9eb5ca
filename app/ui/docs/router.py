"""/docs (Swagger UI) and /redoc (Redoc) from files this package ships (app/ui/docs/static, see
VENDORED.md), under the dashboard's Content-Security-Policy: no script, style or font from another
origin, no inline script, nothing the pages load leaves this server. FastAPI's own pages load both
from a public CDN, on the dashboard's origin and without integrity hashes, and are blank offline.

The page is a few lines of HTML naming the OpenAPI document's URL in `data-openapi`; the vendored
bundle and a small init script (`swagger-init.js`, `redoc-init.js`) draw it. Files are read once and
looked up by name (a request path never becomes a file path). Torch-free.
"""

from __future__ import annotations

import hashlib
import html
import secrets
from functools import lru_cache
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.ui.router import CSP, MEDIA_TYPES, SECURITY_HEADERS, Asset, asset_response

router = APIRouter(include_in_schema=False)

STATIC = "/docs/static"


@lru_cache(maxsize=1)
def assets() -> dict[str, Asset]:
    """Every file under app/ui/docs/static by its relative name (read once per process)."""
    out = {}
    base = resources.files("app.ui.docs") / "static"
    for folder, prefix in ((base, ""), (base / "licenses", "licenses/")):
        for node in sorted(folder.iterdir(), key=lambda n: n.name):
            suffix = Path(node.name).suffix
            if node.is_file() and suffix in MEDIA_TYPES and not node.name.startswith("."):
                body = node.read_bytes()
                out[prefix + node.name] = Asset(body, MEDIA_TYPES[suffix], f'"{hashlib.sha256(body).hexdigest()[:32]}"')
    return out


def _page(request: Request, *, title: str, styles: list[str], scripts: list[str], mount: str,
          style_nonce: str | None = None) -> Response:
    root = str(request.scope.get("root_path") or "").rstrip("/")
    openapi = request.app.openapi_url or "/openapi.json"

    def url(name: str) -> str:
        return html.escape(f"{root}{STATIC}/{name}", quote=True)

    links = "".join(f'<link rel="stylesheet" href="{url(name)}">' for name in styles)
    tags = "".join(f'<script src="{url(name)}"></script>' for name in scripts)
    page = (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{html.escape(title)}</title><link rel="icon" href="data:,">{links}</head>'
            f'<body data-openapi="{html.escape(root + openapi, quote=True)}"'
            + (f' data-style-nonce="{style_nonce}"' if style_nonce else "")
            + f'><div id="{mount}"></div>{tags}</body></html>')
    headers = {**SECURITY_HEADERS, "Cache-Control": "no-store"}
    if style_nonce:
        headers["Content-Security-Policy"] = redoc_csp(style_nonce)
    return Response(page, media_type=MEDIA_TYPES[".html"], headers=headers)


# Redoc cannot run under the dashboard's CSP as it is: it styles itself with <style> elements
# (styled-components) and searches in a Web Worker made from a blob: URL. Its page alone gets, on top of
# that CSP: those <style> elements when they carry the page's nonce (Redoc's `nonce` option), the two
# its bundle injects as it loads, before any option is read (by their sha256: an empty one and the
# scrollbar's fixed CSS), and blob: workers. Scripts stay 'self' only; no inline style attribute, no
# 'unsafe-inline', no 'unsafe-eval', no other origin.
REDOC_STYLE_HASHES = ("'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='",
                      "'sha256-QMIg+bpjm3JdElJ388KYke01izlUW0UoNOeKjpMxdgc='")


def redoc_csp(style_nonce: str) -> str:
    styles = " ".join(("'self'", f"'nonce-{style_nonce}'", *REDOC_STYLE_HASHES))
    return CSP.replace("style-src 'self'", f"style-src {styles}") + "; worker-src blob:"


@router.get("/docs")
def swagger(request: Request) -> Response:
    return _page(request, title=f"{request.app.title} – Swagger UI", styles=["swagger-ui.css"],
                 scripts=["swagger-ui-bundle.js", "swagger-init.js"], mount="swagger-ui")


@router.get("/redoc")
def redoc(request: Request) -> Response:
    return _page(request, title=f"{request.app.title} – ReDoc", styles=[],
                 scripts=["redoc.standalone.js", "redoc-init.js"], mount="redoc", style_nonce=secrets.token_urlsafe(18))


@router.api_route(STATIC + "/{name:path}", methods=["GET", "HEAD"])
def static(request: Request, name: str) -> Response:
    return asset_response(request, assets().get(name), name=name, what="API docs")
