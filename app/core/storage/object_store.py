"""The object store: where published artifacts, the affinity cache, converted models and uploads live.

Two implementations of one interface (`ObjectStore`), chosen by `open_store(settings)` (app.core.storage.backends;
the classes are app.core.storage.local's and .s3's; this module holds the interface, the key rules and what
both share):

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
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol, runtime_checkable
from urllib.parse import urlparse

if TYPE_CHECKING:
    pass

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


def check_part_number(number: int) -> None:
    if not 1 <= number <= MAX_PARTS:
        raise BadPart(f"part number {number} is outside 1..{MAX_PARTS}")


def copy_hashing(src: BinaryIO, dst: BinaryIO, limit: int | None = None) -> tuple[int, str]:
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

    def sweep_staging(self, older_than_s: float) -> int:
        """Remove the store's own temporaries left by a killed process, older than `older_than_s`; how
        many (S3 keeps none: an object is visible only once whole, and multiparts are listed apart)."""
        ...


def check_part_list(parts: list[Part], received: dict[int, Part]) -> None:
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
