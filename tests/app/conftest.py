"""A running service for the client and dashboard tests: `dtp-layout serve` on its embedded default
(SQLite, local worker) with API keys on, the tiny model and token ids provisioned."""

from __future__ import annotations

import pytest

from tests.faults import Faults
from tests.service_kit import ServeProcess, make_settings, provision

# Two tenants (the key's name is the owner of the jobs it submits).
API_KEYS = {"ci": "ci-key-0123456789abcdef", "alice": "alice-key-0123456789abcdef"}
# The worker sleeps this long between micro-batches and before each distillation step (tests/faults.py):
# a job is slow enough to be cancelled while it runs, and still finishes in seconds.
STAGE_DELAY_S = 0.1


def api_keys_setting(keys: dict[str, str]) -> str:
    """DTP_LAYOUT_API_KEYS for these name → key pairs (each key's tenant is its name; digests only)."""
    from app.core.keys import settings_entry

    return ",".join(settings_entry(name, key) for name, key in keys.items())


@pytest.fixture(scope="session")
def keyed_service(tmp_path_factory):
    var = tmp_path_factory.mktemp("keyed-service") / "var"
    provision(make_settings(var))
    serve = ServeProcess(var, faults=Faults(stage_delay_s=STAGE_DELAY_S),
                         DTP_LAYOUT_API_KEYS=api_keys_setting(API_KEYS))
    serve.start()
    yield serve
    serve.stop()
