"""The object store as a local directory (the embedded default): key K is the file ROOT/K; writes are a
temporary file under ROOT/.staging/ renamed into place; multipart parts wait in ROOT/.staging/multipart/
(app.core.storage.object_store says the rules both stores keep)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from app.core.storage.object_store import (
    CHUNK,
    STAGING,
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
                _, digest = copy_hashing(src, out)
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
        check_part_number(number)
        d = self._upload_dir(key, upload_id)
        fd, name = tempfile.mkstemp(dir=d, prefix=".part-")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                n, digest = copy_hashing(stream, out, limit=length)
            if n != length:
                raise BadPart(f"part {number}: {n} bytes arrived, {length} announced")
            os.replace(tmp, d / f"{number:05d}")  # a part sent again replaces the earlier one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return Part(number=number, etag=digest, size=n)

    def list_parts(self, key: str, upload_id: str) -> list[Part]:
        d = self._upload_dir(key, upload_id)
        return [Part(number=int(p.name), etag=sha256_file(p), size=p.stat().st_size)
                for p in sorted(d.iterdir()) if p.name.isdigit()]

    def complete_multipart(self, key: str, upload_id: str, parts: list[Part]) -> ObjectInfo:
        d = self._upload_dir(key, upload_id)
        check_part_list(parts, {p.number: p for p in self.list_parts(key, upload_id)})
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
