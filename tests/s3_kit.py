"""A real S3 API server for tests: moto's ThreadedMotoServer (its HTTP server in a thread of this process,
spoken to over the network by boto3 exactly as an S3 service would be; not moto's mock decorators).

    def test_x(s3_server):                  # tests/conftest.py re-exports the fixtures
        env = s3_server.env(bucket)         # AWS_* variables and DTP_LAYOUT_STORAGE_URL for a subprocess
        store = s3_server.store(bucket)     # an S3Store on it

One server per test session (it starts in ~0.3 s; each test takes a fresh bucket: `s3_bucket`)."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.service_kit import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
               "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def env(self, bucket: str, prefix: str = "dtp") -> dict[str, str]:
        """What a process needs to use the bucket as its store."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint,
                "DTP_LAYOUT_STORAGE_URL": f"s3://{bucket}/{prefix}"}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def create_bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def store(self, bucket: str, prefix: str = "dtp") -> Any:
        from app.core.storage.s3 import S3Store

        return S3Store(bucket, prefix, client=self.client())

    def keys(self, bucket: str) -> list[str]:
        """Every object key in the bucket (the test's view, not through the code under test)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", []))

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server()
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)  # boto3 clients made by the code under test, in this process
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the session's server."""
    return s3_server.create_bucket()
