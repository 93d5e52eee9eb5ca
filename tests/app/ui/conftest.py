"""The dashboard's browser tests: Playwright driving Debian's Chromium (tests/browser_kit.py)."""

from __future__ import annotations

import pytest

from tests import browser_kit


@pytest.fixture(scope="module")
def playwright():
    """Playwright, once per module; skipped (failed when CI=true) without it or without Chromium."""
    with browser_kit.playwright_or_skip() as p:
        yield p
