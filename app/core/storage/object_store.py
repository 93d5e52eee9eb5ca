"""The object store: where published artifacts, the affinity cache, converted models and uploads live.

Two implementations of one interface (`ObjectStore`), chosen by `open_store(settings)`:

    LocalStore(root)              the embedded default: key K is the file ROOT/K (as app.core.storage.root
                                  always laid it out); the API and the workers must share ROOT
    S3Store(bucket, prefix)       DTP_LAYOUT_STORAGE_URL=s3://BUCKET/PREFIX: key K is the object
                                  PREFIX/K; endpoint and credentials from the standard AWS variables
                                  (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
                                  AWS_REGION / AWS_DEFAULT_REGION), read by boto3 itself

Keys are relative POSIX paths (`jobs/<id>/artifacts/<name>`, `affinity/<tenant>/<fp>/…`,
`converted/<tenant>/…`, `uploads/<tenant>/<id>/…`) built by the service from ids it chose, never from a
request; both stores refuse keys with `..`, empty or hidden (`.`-leading) segments.

Everything streams: `put_file` reads a local file in chunks (S3: boto3's managed transfer, multipart past
MULTIPART_THRESHOLD), `read` yields a byte range in chunks, `fetch` writes to a local file. A whole
shard is never held in memory.

Writes are atomic for readers: a key holds nothing or a whole object. LocalStore writes a temporary file
under ROOT/.staging/ and renames it; S3 makes an object visible only when its PUT or its multipart
upload completes. Explicit multipart (`begin_multipart` / `put_part` / `complete_multipart` /
`abort_multipart` / `list_multipart`) is for resumable client uploads: parts may arrive in any order,
from any API process, and a part sent again replaces the earlier one. S3's rule applies to both stores
(checked by both, so the local default refuses what S3 would): every part but the last at least
MIN_PART_BYTES, part numbers 1..10000. LocalStore keeps in-progress parts in
ROOT/.staging/multipart/<upload id>/ (with the key in `key`, its start time in the directory's mtime)
and concatenates them into the key on completion (a temporary file renamed into place).

sha256. `put_file` hashes what it sends and returns it; S3 stores it as the object's metadata
(`x-amz-meta-sha256`), `head` returns it. A multipart object has none in the store (its sha256 is known
only when complete): the caller records it (the database row is the authority for every object a
reader is shown; a stored sha256 is a hint).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable
from urllib.parse import urlparse

if TYPE_CHECKING:
    from app.core.settings import Settings

CHUNK = 1 << 20
MIN_PART_BYTES = 5 << 20  # S3's floor for every part but the last
MAX_PARTS = 10_000
MULTIPART_THRESHOLD = 64 << 20  # put_file: one PUT below this, a multipart upload above
STAGING = ".staging"  # LocalStore's temporary files and multipart parts (never a key: keys have no hidden segment)
_SEGMENT = re.compile(r"[^/\x00]+")


class ObjectMissing(FileNotFoundError):
    """No object under the key (or no multipart upload of that id)."""


class ObjectChanged(Exception):
    """The object was replaced between the caller's check and its read (S3: If-Match failed)."""


class BadPart(ValueError):
    """A multipart request the store refuses: part number out of range, a part under MIN_PART_BYTES
    that is not the last, a part list that does not match the parts sent."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str  # opaque, quoted-less; changes when the object is rewritten
    modified: float  # unix seconds
    sha256: str | None = None  # the stored hint (put_file); None for multipart objects and in listings


@dataclass(frozen=True)
class Part:
    number: int
    etag: str
    size: int


@dataclass(frozen=True)
class PendingUpload:
    key: str
    upload_id: str
    started: float  # unix seconds


def check_key(key: str) -> str:
    """`key` if it is a relative path of non-hidden segments without `.`/`..`; ValueError otherwise."""
    parts = key.split("/")
    if not key or len(key) > 900 or any(not _SEGMENT.fullmatch(p) or p.startswith(".") for p in parts):
        raise ValueError(f"storage key {key!r} is not a relative path of plain segments")
    return key


def check_prefix(prefix: str) -> str:
    """A listing / deletion prefix: '' (everything) or a key-like path ending in '/'."""
    if prefix and not prefix.endswith("/"):
        raise ValueError(f"storage prefix {prefix!r} must end with '/'")
    if prefix:
        check_key(prefix.rstrip("/"))
    return prefix


def _check_part_number(number: int) -> None:
    if not 1 <= number <= MAX_PARTS:
        raise BadPart(f"part number {number} is outside 1..{MAX_PARTS}")


def _copy_hashing(src: BinaryIO, dst: BinaryIO, limit: int | None = None) -> tuple[int, str]:
    """Copy `src` to `dst` in chunks (at most `limit` bytes); (bytes, sha256 hex)."""
    h, n = hashlib.sha256(), 0
    while limit is None or n < limit:
        block = src.read(CHUNK if limit is None else min(CHUNK, limit - n))
        if not block:
            break
        h.update(block)
        dst.write(block)
        n += len(block)
    return n, h.hexdigest()


def _sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


@runtime_checkable
class ObjectStore(Protocol):
    """What the API and the workers need of a store (see the module docstring)."""

    url: str  # where it is, for logs and docs: a directory or s3://bucket/prefix

    def put_file(self, path: Path, key: str, *, sha256: str | None = None) -> ObjectInfo:
        """Upload a local file under `key` (replacing any object there); its size, etag and sha256
        (`sha256`: the caller's digest of the file, which then is not hashed again)."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size, etag and stored sha256; None when there is none."""
        ...

    def read(self, key: str, start: int = 0, length: int | None = None, *,
             etag: str | None = None) -> Iterator[bytes]:
        """`length` bytes (None: to the end) from `start`, in chunks. With `etag`, the object must still
        be that one (ObjectChanged otherwise). ObjectMissing when absent (raised on the first next())."""
        ...

    def fetch(self, key: str, dest: Path) -> ObjectInfo:
        """Write the object to the local file `dest` (a temporary file renamed into place)."""
        ...

    def delete(self, key: str) -> None:
        """Remove one object (no error when absent)."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under `prefix` ('…/'); how many."""
        ...

    def list_prefix(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under `prefix` ('' or '…/') with its size, etag and time (sha256 None)."""
        ...

    def begin_multipart(self, key: str) -> str:
        """Start a multipart upload to `key`; its upload id."""
        ...

    def put_part(self, key: str, upload_id: str, number: int, stream: BinaryIO, length: int) -> Part:
        """Send part `number` (1..10000) of exactly `length` bytes read from `stream`, in chunks."""
        ...

    def list_parts(self, key: str, upload_id: str) -> list[Part]:
        """The parts received so far (for a client resuming)."""
        ...

    def complete_multipart(self, key: str, upload_id: str, parts: list[Part]) -> ObjectInfo:
        """Make the object from `parts` (ascending numbers; every one but the last >= MIN_PART_BYTES)."""
        ...

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop an upload and its parts (no error when already gone)."""
        ...

    def list_multipart(self, prefix: str = "") -> list[PendingUpload]:
        """Uploads begun and neither completed nor aborted, under `prefix`."""
        ...

    def presign_get(self, key: str, *, expires_s: int, filename: str | None = None) -> str | None:
        """A URL that GETs the object without credentials for `expires_s` seconds; None (LocalStore)."""
        ...

    def local_path(self, key: str) -> Path | None:
        """The file of `key` when the store is a local directory (the API then verifies it with
        VerifiedFiles' stat check); None for S3."""
        ...


# ---- the local directory ------------------------------------------------------------------------------

class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.url = str(self.root)

    # keys and staging

    def local_path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"storage key {key!r} leaves the storage root")
        return path

    def _staging(self, *parts: str) -> Path:
        d = self.root.joinpath(STAGING, *parts)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _tmp(self) -> tuple[BinaryIO, Path]:
        fd, name = tempfile.mkstemp(dir=self._staging("tmp"), prefix="put-")
        return os.fdopen(fd, "wb"), Path(name)

    def _install(self, tmp: Path, key: str) -> Path:
        dest = self.local_path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)  # same filesystem: atomic
        return dest

    def _info(self, key: str, path: Path, sha256: str | None = None) -> ObjectInfo:
        st = path.stat()
        return ObjectInfo(key=key, size=st.st_size, etag=f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}",
                          modified=st.st_mtime, sha256=sha256)

    # objects

    def put_file(self, path: Path, key: str, *, sha256: str | None = None) -> ObjectInfo:
        check_key(key)
        out, tmp = self._tmp()
        try:
            with out, open(path, "rb") as src:
                _, digest = _copy_hashing(src, out)
            dest = self._install(tmp, key)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self._info(key, dest, digest)

    def link_in(self, path: Path, key: str) -> ObjectInfo:
        """put_file without a copy when `path` is on the root's filesystem (a worker's work directory): a
        hard link renamed into place (the work file stays for a resumed attempt; removing the work
        directory later leaves the object). Another filesystem: copied."""
        check_key(key)
        tmp = self._staging("tmp") / f"link-{uuid.uuid4().hex}"
        try:
            os.link(path, tmp)
        except OSError:
            return self.put_file(path, key)
        try:
            dest = self._install(tmp, key)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self._info(key, dest)

    def head(self, key: str) -> ObjectInfo | None:
        path = self.local_path(key)
        if not path.is_file():
            return None
        return self._info(key, path)

    def read(self, key: str, start: int = 0, length: int | None = None, *,
             etag: str | None = None) -> Iterator[bytes]:
        path = self.local_path(key)
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed by the generator)
        except FileNotFoundError:
            raise ObjectMissing(key) from None
        return self._iter(f, key, path, start, length, etag)

    def _iter(self, f: BinaryIO, key: str, path: Path, start: int, length: int | None,
              etag: str | None) -> Iterator[bytes]:
        with f:
            if etag is not None:
                st = os.fstat(f.fileno())
                if f"{st.st_ino:x}-{st.st_size:x}-{st.st_mtime_ns:x}" != etag:
                    raise ObjectChanged(key)
            f.seek(start)
            remaining = length
            while remaining is None or remaining > 0:
                block = f.read(CHUNK if remaining is None else min(CHUNK, remaining))
                if not block:
                    break
                if remaining is not None:
                    remaining -= len(block)
                yield block

    def fetch(self, key: str, dest: Path) -> ObjectInfo:
        src = self.local_path(key)
        if not src.is_file():
            raise ObjectMissing(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self._info(key, src)

    def delete(self, key: str) -> None:
        self.local_path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        n = 0
        for info in list(self.list_prefix(prefix)):
            self.delete(info.key)
            n += 1
        base = self.root / check_prefix(prefix) if prefix else None
        if base is not None and base.is_dir():
            shutil.rmtree(base, ignore_errors=True)  # the emptied directories
        return n

    def list_prefix(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self.root / check_prefix(prefix) if prefix else self.root
        if not base.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue  # lock files and temporaries of models.io.converted: not objects
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                try:
                    yield self._info(key, path)
                except FileNotFoundError:
                    continue  # removed while listing

    # multipart

    def _upload_dir(self, key: str, upload_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", upload_id):
            raise ObjectMissing(f"no multipart upload {upload_id!r}")
        d = self.root / STAGING / "multipart" / upload_id
        try:
            recorded = (d / "key").read_text()
        except FileNotFoundError:
            raise ObjectMissing(f"no multipart upload {upload_id!r}") from None
        if recorded != key:
            raise ObjectMissing(f"no multipart upload {upload_id!r} for {key!r}")
        return d

    def begin_multipart(self, key: str) -> str:
        check_key(key)
        upload_id = uuid.uuid4().hex
        d = self._staging("multipart", upload_id)
        (d / "key").write_text(key)
        return upload_id

    def put_part(self, key: str, upload_id: str, number: int, stream: BinaryIO, length: int) -> Part:
        _check_part_number(number)
        d = self._upload_dir(key, upload_id)
        fd, name = tempfile.mkstemp(dir=d, prefix=".part-")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                n, digest = _copy_hashing(stream, out, limit=length)
            if n != length:
                raise BadPart(f"part {number}: {n} bytes arrived, {length} announced")
            os.replace(tmp, d / f"{number:05d}")  # a part sent again replaces the earlier one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return Part(number=number, etag=digest, size=n)

    def list_parts(self, key: str, upload_id: str) -> list[Part]:
        d = self._upload_dir(key, upload_id)
        return [Part(number=int(p.name), etag=_sha256_path(p), size=p.stat().st_size)
                for p in sorted(d.iterdir()) if p.name.isdigit()]

    def complete_multipart(self, key: str, upload_id: str, parts: list[Part]) -> ObjectInfo:
        d = self._upload_dir(key, upload_id)
        _check_part_list(parts, {p.number: p for p in self.list_parts(key, upload_id)})
        out, tmp = self._tmp()
        try:
            with out:
                h = hashlib.sha256()
                for part in parts:
                    with open(d / f"{part.number:05d}", "rb") as src:
                        while block := src.read(CHUNK):
                            h.update(block)
                            out.write(block)
            dest = self._install(tmp, key)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        shutil.rmtree(d, ignore_errors=True)
        return self._info(key, dest, h.hexdigest())

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            d = self._upload_dir(key, upload_id)
        except ObjectMissing:
            return
        shutil.rmtree(d, ignore_errors=True)

    def list_multipart(self, prefix: str = "") -> list[PendingUpload]:
        check_prefix(prefix)
        base = self.root / STAGING / "multipart"
        if not base.is_dir():
            return []
        out = []
        for d in sorted(base.iterdir()):
            try:
                key = (d / "key").read_text()
                started = (d / "key").stat().st_mtime
            except (FileNotFoundError, NotADirectoryError):
                continue
            if key.startswith(prefix):
                out.append(PendingUpload(key=key, upload_id=d.name, started=started))
        return out

    def presign_get(self, key: str, *, expires_s: int, filename: str | None = None) -> str | None:
        return None

    def sweep_staging(self, older_than_s: float) -> int:
        """Remove temporaries of put_file left by a killed process (multipart uploads are swept through
        list_multipart / abort_multipart, as on S3); how many."""
        base = self.root / STAGING / "tmp"
        if not base.is_dir():
            return 0
        n, cutoff = 0, time.time() - older_than_s
        for p in base.iterdir():
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
                    n += 1
            except FileNotFoundError:
                continue
        return n


def _check_part_list(parts: list[Part], received: dict[int, Part]) -> None:
    if not parts:
        raise BadPart("a multipart upload needs at least one part")
    numbers = [p.number for p in parts]
    if numbers != sorted(set(numbers)):
        raise BadPart("the parts must be listed in ascending order, each once")
    for i, part in enumerate(parts):
        got = received.get(part.number)
        if got is None or got.etag != part.etag:
            raise BadPart(f"part {part.number} was not received (or not with that etag)")
        if i < len(parts) - 1 and got.size < MIN_PART_BYTES:
            raise BadPart(f"part {part.number} has {got.size} bytes; every part but the last needs at least "
                          f"{MIN_PART_BYTES}")


# ---- S3-compatible ---------------------------------------------------------------------------------------

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

    def put_file(self, path: Path, key: str, *, sha256: str | None = None) -> ObjectInfo:
        digest = sha256 or _sha256_path(path)  # the metadata goes with the PUT: hashed before sending
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
        _check_part_number(number)
        # Spooled to a local temporary file first: botocore signs (and on a retry re-sends) the body, which
        # needs a seekable one; a request stream is not. Disk, not memory: a part may be large.
        with tempfile.TemporaryFile() as spool:
            n, _ = _copy_hashing(stream, spool, limit=length)
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
        _check_part_list(parts, {p.number: p for p in self.list_parts(key, upload_id)})
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


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of s3://BUCKET[/PREFIX]; ValueError naming what is accepted."""
    u = urlparse(url)
    if u.scheme != "s3" or not u.netloc or u.query or u.fragment:
        raise ValueError(f"storage URL {url!r}: expected s3://BUCKET/PREFIX")
    prefix = u.path.strip("/")
    try:
        if prefix:
            check_key(prefix)
    except ValueError:
        raise ValueError(f"storage URL {url!r}: expected s3://BUCKET/PREFIX with a PREFIX of plain path "
                         "segments") from None
    return u.netloc, prefix


def open_store(settings: Settings) -> ObjectStore:
    """The store the settings name: S3 when DTP_LAYOUT_STORAGE_URL is set, else STORAGE_ROOT."""
    if settings.storage_url:
        bucket, prefix = parse_url(settings.storage_url)
        return S3Store(bucket, prefix)
    return LocalStore(settings.storage)
