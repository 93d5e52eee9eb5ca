"""/docs (Swagger UI) and /redoc (Redoc) are served from the package, work offline and load nothing
from another origin: a real `dtp-layout serve` (API keys on: the docs stay public), Debian's Chromium
with every request to another origin aborted and recorded, each page's operation list drawn (one
entry per operation of /openapi.json), Redoc's search answering (its Web Worker runs), and no console
error (a CSP violation is one). The vendored files are the ones app/ui/docs/VENDORED.md names."""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path

import httpx
import pytest

from app.ui.router import CSP
from tests import browser_kit
from tests.app.conftest import API_KEYS, api_keys_setting
from tests.service_kit import ServeProcess

DOCS = Path(__file__).resolve().parents[3] / "app" / "ui" / "docs"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    serve = ServeProcess(tmp_path_factory.mktemp("docs") / "var", serve_args=("--no-worker",),
                         DTP_LAYOUT_API_KEYS=api_keys_setting(API_KEYS))
    serve.start()
    yield serve
    serve.stop()


def operations(url: str) -> int:
    spec = httpx.get(f"{url}/openapi.json").json()
    return sum(1 for item in spec["paths"].values() for method in item if method in ("get", "post", "put", "delete"))


def test_the_vendored_files_are_the_ones_vendored_md_names():
    table = (DOCS / "VENDORED.md").read_text()
    rows = re.findall(r"\| `static/([\w.-]+)` \|.*\| `([0-9a-f]{64})` \|", table)
    assert {name for name, _ in rows} == {"swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"}
    for name, digest in rows:
        assert hashlib.sha256((DOCS / "static" / name).read_bytes()).hexdigest() == digest, name


def test_the_pages_and_files_carry_the_csp_and_no_inline_script(served):
    with httpx.Client(base_url=served.url) as client:
        docs, redoc = client.get("/docs"), client.get("/redoc")
        assert docs.headers["content-security-policy"] == CSP
        assert "https://" not in docs.text and "<script>" not in docs.text
        policy = redoc.headers["content-security-policy"]
        assert "script-src 'self';" in policy and "unsafe" not in policy and "https:" not in policy
        nonce = re.search(r"'nonce-([\w-]+)'", policy).group(1)
        assert f'data-style-nonce="{nonce}"' in redoc.text and "<script>" not in redoc.text
        assert nonce not in client.get("/redoc").headers["content-security-policy"]  # one per page load
        asset = client.get("/docs/static/swagger-ui-bundle.js")
        assert asset.status_code == 200 and asset.headers["content-security-policy"] == CSP
        assert client.get("/docs/static/swagger-ui-bundle.js", headers={"If-None-Match": asset.headers["etag"]}
                          ).status_code == 304
        missing = client.get("/docs/static/../router.py")
        assert missing.status_code == 404 and missing.json()["field"] == "path"


@pytest.mark.browser
@pytest.mark.parametrize(("path", "item"), [("/docs", ".opblock"), ("/redoc", "[data-section-id^='operation/']")])
def test_the_docs_pages_render_offline_from_this_server_only(served, playwright, path, item, tmp_path):
    foreign: list[str] = []
    errors: list[str] = []

    def only_this_server(route):
        if route.request.url.startswith(served.url + "/"):
            route.continue_()
        else:  # offline: nothing else answers
            foreign.append(route.request.url)
            route.abort()

    with browser_kit.browser_context(playwright) as context:
        context.route("**/*", only_this_server)
        page = context.new_page()
        page.on("console", lambda msg: msg.type == "error" and errors.append(msg.text))
        page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
        t0 = time.perf_counter()
        page.goto(served.url + path)
        page.wait_for_selector(item)  # the context's default: browser_kit.PAGE_WAIT_MS, stretched by the load
        drawn = page.locator(item).count()
        print(f"{path}: {drawn} operations drawn {(time.perf_counter() - t0) * 1e3:.0f} ms after the request, offline")
        assert drawn == operations(served.url)
        if path == "/redoc":  # the search runs in a blob: Web Worker the page's CSP allows
            page.fill("input[placeholder='Search...']", "cancel")
            page.wait_for_selector("[data-role='search:results'] li[data-item-id$='operation/cancel_job']")
        page.screenshot(path=str(tmp_path / f"{path.strip('/')}.png"))
    assert foreign == []
    assert errors == []
