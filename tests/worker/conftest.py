"""The worker tests' embedded service: settings over tmp_path (SQLite, the local store, CPU), migrated, with
the tiny model and token ids provisioned (tests/service_kit.py)."""

from __future__ import annotations

import pytest

from app.core.db import database
from app.core.migrate import upgrade
from tests.service_kit import make_settings, provision


@pytest.fixture
def embedded(tmp_path):
    """(settings, database) of a fresh embedded service under tmp_path."""
    settings = make_settings(tmp_path, device="cpu")
    upgrade(settings.database_url)
    provision(settings)
    return settings, database(settings.database_url)
