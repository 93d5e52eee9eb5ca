"""Debian's Chromium driven by Playwright (never a browser Playwright downloads): used by the
dashboard tests and by bench/screenshots.py.

The browser is /usr/bin/chromium (`apt-get install chromium`; .ci/run installs it), or the one
DTP_LAYOUT_TEST_CHROMIUM names. Each context gets a fresh user-data-dir.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.patience_kit import patient

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/lib/chromium/chromium")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def chromium_path() -> str | None:
    explicit = os.environ.get("DTP_LAYOUT_TEST_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return next((c for c in CANDIDATES if os.access(c, os.X_OK)), shutil.which("chromium"))


def unavailable() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install -e '.[dev]')"
    if chromium_path() is None:
        return "Chromium not found (apt-get install chromium; or set DTP_LAYOUT_TEST_CHROMIUM)"
    return None


# Playwright's own default for a launch, a navigation or a wait on a selector, stretched by the machine's
# load (tests/patience_kit.py): Chromium's start-up and a page's first draw take several times longer on a
# busy machine, and a wait on a selector returns as soon as the page is ready.
PAGE_WAIT_MS = 30_000


@contextmanager
def browser_context(playwright: Any, *, width: int = 1280, height: int = 800, **options: Any) -> Iterator[Any]:
    """A persistent context of the system Chromium with a fresh user-data-dir, downloads accepted; its
    waits' default is PAGE_WAIT_MS stretched by the machine's load."""
    profile = tempfile.mkdtemp(prefix="dtp-layout-chromium-")
    context = playwright.chromium.launch_persistent_context(
        profile, executable_path=chromium_path(), args=LAUNCH_ARGS, headless=True, accept_downloads=True,
        viewport={"width": width, "height": height}, timeout=patient(PAGE_WAIT_MS), **options)
    context.set_default_timeout(patient(PAGE_WAIT_MS))
    try:
        yield context
    finally:
        context.close()
        shutil.rmtree(profile, ignore_errors=True)


@contextmanager
def playwright_or_skip() -> Iterator[Any]:
    """Playwright's sync API, or the test skipped (failed when CI=true) naming what is missing."""
    import pytest

    reason = unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        yield playwright
