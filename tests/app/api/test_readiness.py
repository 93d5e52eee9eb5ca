"""The API's readiness (issue 41): like `serve` and `worker`, the API (uvicorn's factory, the API image)
marks the broker with its database's identity and refuses to start on a broker that serves another — an API
on database X sharing a broker with workers on Y had every job dropped after 4 deliveries while /readyz
said 200; /readyz is cheap (its database and broker round trips at most once per 1.5 s, whoever asks) and
rate-limited per client address. On the real Postgres and Redis."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from app.api.main import create_app
from app.api.readiness import CACHE_S, BrokerServesAnother
from app.core.migrate import upgrade
from tests.service_kit import make_settings

pytestmark = pytest.mark.postgres


def settings_on(tmp_path, postgres_server, broker: tuple[str, str], name: str, **overrides):
    url = postgres_server.create_database(f"dtp_ready_{name}")
    upgrade(url)
    return make_settings(tmp_path / name, database_url=url, broker_url=broker[0], broker_key_prefix=broker[1],
                         **overrides)


def test_an_api_refuses_a_broker_that_serves_another_database(tmp_path, postgres_server, redis_broker):
    broker = (redis_broker[0], f"{redis_broker[1]}ready-owner:")
    first = settings_on(tmp_path, postgres_server, broker, "x")
    second = settings_on(tmp_path, postgres_server, broker, "y")
    with TestClient(create_app(first)) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok"}, ready.text
    with pytest.raises(BrokerServesAnother, match="already serves another database") as refused, \
            TestClient(create_app(second)):
        pass
    assert "dtp_ready_x" in str(refused.value) and "dtp_ready_y" in str(refused.value)
    with TestClient(create_app(first)) as client:  # the same database again: its own mark
        assert client.get("/readyz").status_code == 200


def test_readyz_is_one_round_trip_per_period_and_rate_limited(tmp_path, postgres_server, redis_broker):
    broker = (redis_broker[0], f"{redis_broker[1]}ready-cheap:")
    settings = settings_on(tmp_path, postgres_server, broker, "cheap", rate_limit_per_min=1, rate_limit_burst=30)
    app = create_app(settings)
    statements: list[str] = []
    with TestClient(app) as client:
        event.listen(app.state.db.engine, "before_cursor_execute",
                     lambda _conn, _cursor, statement, *_: statements.append(statement))
        t0 = time.monotonic()
        codes = [client.get("/readyz").status_code for _ in range(40)]
        took = time.monotonic() - t0
        limited = client.get("/readyz")
    assert codes[:30] == [200] * 30 and set(codes[30:]) == {429}, codes  # the burst, then 1 a minute
    assert limited.json()["error"] == "rate_limited" and int(limited.headers["Retry-After"]) >= 1, limited.text
    # one database round trip per CACHE_S at most, not one per request
    assert 1 <= statements.count("SELECT 1") <= 2 + took / CACHE_S, (statements, took)
    print(f"40 /readyz in {took:.2f} s: {statements.count('SELECT 1')} database round trips")
