"""An S3 call that fails after botocore's retries (a 500 from the store, as moto answered once under load)
is an outage for the caller: a JSON 503 with Retry-After, never the API's 500."""

from __future__ import annotations

from botocore.exceptions import ClientError
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api import errors
from app.core.storage.root import StoreUnavailable


def test_a_failed_object_store_call_is_a_503_not_a_500():
    app = FastAPI()
    errors.install(app)

    @app.put("/part")
    def put_part() -> None:
        raise ClientError({"Error": {"Code": "InternalError", "Message": "Internal Server Error"}}, "UploadPart")

    @app.get("/unreachable")
    def unreachable() -> None:
        raise StoreUnavailable("object store s3://b/p: ConnectTimeoutError")

    @app.get("/bug")
    def bug() -> None:
        raise RuntimeError("a bug")

    client = TestClient(app, raise_server_exceptions=False)
    failed = client.put("/part")
    assert failed.status_code == 503 and failed.headers["Retry-After"] == "5"
    assert failed.json()["error"] == "store_unavailable" and "object store" in failed.json()["detail"]
    assert client.get("/unreachable").json()["error"] == "store_unavailable"  # the store's own outage error too
    assert client.get("/bug").status_code == 500  # anything else stays a logged bug
