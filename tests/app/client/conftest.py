"""The client tests' service: `keyed_service` (tests/app/conftest.py) named by the environment."""

from __future__ import annotations

import pytest

from tests.app.conftest import API_KEYS


@pytest.fixture
def env(keyed_service, monkeypatch):
    """The service and the `ci` key from the environment, as a CI job would set them."""
    monkeypatch.setenv("DTP_LAYOUT_URL", keyed_service.url)
    monkeypatch.setenv("DTP_LAYOUT_API_KEY", API_KEYS["ci"])
    return keyed_service
