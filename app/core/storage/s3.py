"""The object store as an S3 bucket under a prefix (any S3-compatible service), through boto3
(app.core.storage.object_store says the rules both stores keep)."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from app.core.storage.object_store import (
    CHUNK,
    MULTIPART_THRESHOLD,
    BadPart,
    ObjectChanged,
    ObjectInfo,
    ObjectMissing,
    Part,
    PendingUpload,
    check_key,
    check_part_list,
    check_part_number,
    check_prefix,
    copy_hashing,
)
from models.io.digest import sha256_file


class S3Store:
    """An S3 bucket (any S3-compatible service: AWS, MinIO, Ceph, R2, GCS's XML API) under a prefix."""

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        # boto3 reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_REGION itself.
        # Checksums only when the API requires them: botocore >= 1.36 otherwise adds CRC trailers
        # (aws-chunked bodies) that several S3-compatible services (GCS, R2, older MinIO) refuse.
        self.client = client or boto3.client("s3", config=Config(
            retries={"max_attempts": 5, "mode": "standard"}, signature_version="s3v4",
            request_checksum_calculation="when_required", response_checksum_validation="when_required"))
        self.transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD,
                                       max_concurrency=4, io_chunksize=CHUNK)

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _errors(self) -> Any:
        from botocore.exceptions import ClientError

        return ClientError

    @staticmethod
    def _code(exc: Any) -> str:
        return str(exc.response.get("Error", {}).get("Code", ""))

    def local_path(self, key: str) -> Path | None:
        return None

    def sweep_staging(self, older_than_s: float) -> int:
        return 0

    def put_file(self, path: Path, key: str, *, sha256: str | None = None) -> ObjectInfo:
        digest = sha256 or sha256_file(path)  # the metadata goes with the PUT: hashed before sending
        self.client.upload_file(str(path), self.bucket, self._k(key), Config=self.transfer,
                                ExtraArgs={"Metadata": {"sha256": digest}})
        info = self.head(key)
        if info is None:
            raise ObjectMissing(key)
        return info

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self.client.head_object(Bucket=self.bucket, Key=self._k(key))
        except self._errors() as exc:
            if self._code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return ObjectInfo(key=key, size=int(r["ContentLength"]), etag=r["ETag"].strip('"'),
                          modified=r["LastModified"].timestamp(), sha256=r.get("Metadata", {}).get("sha256"))

    def read(self, key: str, start: int = 0, length: int | None = None, *,
             etag: str | None = None) -> Iterator[bytes]:
        if length == 0:
            return iter(())
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._k(key)}
        if start or length is not None:
            args["Range"] = f"bytes={start}-" + ("" if length is None else str(start + length - 1))
        if etag is not None:
            args["IfMatch"] = f'"{etag}"'
        try:
            body = self.client.get_object(**args)["Body"]
        except self._errors() as exc:
            code = self._code(exc)
            if code in ("404", "NoSuchKey"):
                raise ObjectMissing(key) from None
            if code in ("412", "PreconditionFailed"):
                raise ObjectChanged(key) from None
            raise
        return self._iter(body)

    @staticmethod
    def _iter(body: Any) -> Iterator[bytes]:
        try:
            yield from body.iter_chunks(CHUNK)
        finally:
            body.close()

    def fetch(self, key: str, dest: Path) -> ObjectInfo:
        info = self.head(key)
        if info is None:
            raise ObjectMissing(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            self.client.download_file(self.bucket, self._k(key), str(tmp), Config=self.transfer)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return info

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._k(key))

    def delete_prefix(self, prefix: str) -> int:
        n, batch = 0, []
        for info in self.list_prefix(prefix):
            batch.append({"Key": self.prefix + info.key})
            if len(batch) == 1000:
                n += self._delete_batch(batch)
                batch = []
        if batch:
            n += self._delete_batch(batch)
        return n

    def _delete_batch(self, batch: list[dict[str, str]]) -> int:
        r = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        if r.get("Errors"):
            raise OSError(f"could not delete {len(r['Errors'])} objects: {r['Errors'][0]}")
        return len(batch)

    def list_prefix(self, prefix: str) -> Iterator[ObjectInfo]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + check_prefix(prefix))
        for page in pages:
            for obj in page.get("Contents", []):
                yield ObjectInfo(key=obj["Key"][len(self.prefix):], size=int(obj["Size"]),
                                 etag=obj["ETag"].strip('"'), modified=obj["LastModified"].timestamp())

    def begin_multipart(self, key: str) -> str:
        r = self.client.create_multipart_upload(Bucket=self.bucket, Key=self._k(key))
        return str(r["UploadId"])

    def put_part(self, key: str, upload_id: str, number: int, stream: BinaryIO, length: int) -> Part:
        check_part_number(number)
        # Spooled to a local temporary file first: botocore signs (and on a retry re-sends) the body, which
        # needs a seekable one; a request stream is not. Disk, not memory: a part may be large.
        with tempfile.TemporaryFile() as spool:
            n, _ = copy_hashing(stream, spool, limit=length)
            if n != length:
                raise BadPart(f"part {number}: {n} bytes arrived, {length} announced")
            spool.seek(0)
            try:
                r = self.client.upload_part(Bucket=self.bucket, Key=self._k(key), UploadId=upload_id,
                                            PartNumber=number, Body=spool, ContentLength=length)
            except self._errors() as exc:
                if self._code(exc) == "NoSuchUpload":
                    raise ObjectMissing(f"no multipart upload {upload_id!r}") from None
                raise
        return Part(number=number, etag=r["ETag"].strip('"'), size=length)

    def list_parts(self, key: str, upload_id: str) -> list[Part]:
        out: list[Part] = []
        try:
            pages = self.client.get_paginator("list_parts").paginate(
                Bucket=self.bucket, Key=self._k(key), UploadId=upload_id)
            for page in pages:
                out.extend(Part(number=int(p["PartNumber"]), etag=p["ETag"].strip('"'), size=int(p["Size"]))
                           for p in page.get("Parts", []))
        except self._errors() as exc:
            if self._code(exc) == "NoSuchUpload":
                raise ObjectMissing(f"no multipart upload {upload_id!r}") from None
            raise
        return out

    def complete_multipart(self, key: str, upload_id: str, parts: list[Part]) -> ObjectInfo:
        check_part_list(parts, {p.number: p for p in self.list_parts(key, upload_id)})
        self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=self._k(key), UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": p.number, "ETag": f'"{p.etag}"'} for p in parts]})
        info = self.head(key)
        if info is None:
            raise ObjectMissing(key)
        return info

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._k(key), UploadId=upload_id)
        except self._errors() as exc:
            if self._code(exc) not in ("NoSuchUpload", "404"):
                raise

    def list_multipart(self, prefix: str = "") -> list[PendingUpload]:
        out = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=self.prefix + check_prefix(prefix))
        for page in pages:
            for u in page.get("Uploads", []):
                out.append(PendingUpload(key=u["Key"][len(self.prefix):], upload_id=u["UploadId"],
                                         started=u["Initiated"].timestamp()))
        return out

    def presign_get(self, key: str, *, expires_s: int, filename: str | None = None) -> str | None:
        params: dict[str, Any] = {"Bucket": self.bucket, "Key": self._k(key)}
        if filename is not None:
            params["ResponseContentDisposition"] = f'attachment; filename="{filename}"'
        return str(self.client.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s))
