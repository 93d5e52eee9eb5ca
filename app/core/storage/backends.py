"""Which object store a service opens: the local directory or S3, from its settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.core.storage.local import LocalStore
from app.core.storage.object_store import ObjectStore, parse_url
from app.core.storage.s3 import S3Store

if TYPE_CHECKING:
    from app.core.settings import Settings


def open_store(settings: Settings) -> ObjectStore:
    """The store the settings name: S3 when DTP_LAYOUT_STORAGE_URL is set, else STORAGE_ROOT."""
    if settings.storage_url:
        bucket, prefix = parse_url(settings.storage_url)
        return S3Store(bucket, prefix)
    return LocalStore(settings.storage)
