"""One conversion per model: a GGUF model is dequantised once into a safetensors copy in a cache, keyed
by its content, and every later load of it (any job, any command) reads that copy.

    cache = ConvertedCache(root, namespace=tenant_scope(tenant))
    source = cache.converted_source(ModelSource(path), dtype="float32")  # converts on the first call only
    load_config(source); load_model(source, dtype="float32"); load_tokenizer(source)

An entry is what `save_pretrained` writes (config.json, model*.safetensors, the tokenizer's files when
the GGUF carries one) plus `converted.json` saying what it was made from, in
`ROOT/NAMESPACE/ENTRY/`, loaded back by transformers' `from_pretrained` like any checkpoint directory.
Only GGUF sources are converted: a safetensors directory or hub snapshot already is the format an
entry would hold (from_pretrained casts its dtype on load), so it comes back unchanged.

Key. ENTRY is a digest of the GGUF file's sha256, the dtype, and the versions of the code that
dequantises (transformers, gguf, torch) and of this layout (`FORMAT`): a renamed or copied file reuses
the entry, an edited one (or an upgrade that could change the dequantised values) makes a new one. A
hub GGUF is the file huggingface_hub resolves for (id, revision, file), hashed like a local one, so
two revisions with the same bytes share an entry. Hashing reads the whole file (0.2 s for the 98 MB
SmolLM2 GGUF; ~1 min per 40 GB): the digest is memoised in `ROOT/NAMESPACE/sha256/`, keyed by the
file's (real path, device, inode, size, mtime, ctime), so a second load reads no byte of the GGUF;
any rewrite of the file changes mtime or ctime and is hashed again.

Namespace. The caller's scope (`[A-Za-z0-9][A-Za-z0-9_.-]*`): entries and hash memos of one
namespace are never looked at from another. A converted copy of a server-root or hub model derives
from the server's files, but which model a job names is the tenant's input, and a hit (seconds
instead of a minute) would tell a tenant that another one ran the model: the worker passes the same
per-tenant scope as its affinity cache (docs/security.md, "What a job reads"); a single-user CLI
uses `DEFAULT_NAMESPACE`.

Writes are atomic. One process converts an entry at a time (an flock on `.ENTRY.lock`; a second one
waits, then finds the entry and loads it); the copy is written to `.ENTRY.tmp-*` and renamed into
place, so a reader sees no entry or a whole one, and if the lock is not honoured (a filesystem without
flock) the rename that finds the entry already there discards its own copy and uses the winner's.
A temporary directory left by a killed conversion is removed by the next conversion of that entry.

Mirror. Given an `EntryMirror` (the worker passes its object store: app's workers on other machines share
no disk), an entry missing here is pulled from the mirror before converting, and an entry converted here
is pushed to it (its manifest last: a mirror entry without one is incomplete and never pulled). The
directory is then a local cache of the mirror.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol

from models.io.assets import cache_dir
from models.io.atomic import atomic_write_text
from models.io.loading import DTYPES, ModelLoadError, ModelSource, load_model, load_tokenizer

FORMAT = 1  # bump when an entry's layout or the conversion changes
MANIFEST = "converted.json"
DEFAULT_NAMESPACE = "local"
NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
SHA256 = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 20
# Versions of the code whose output an entry holds: an upgrade converts again rather than trust that
# the dequantisation is unchanged.
CONVERTER_PACKAGES = ("transformers", "gguf", "torch")


class EntryMirror(Protocol):
    """A shared copy of the entries, named `NAMESPACE/ENTRY` (see the module docstring)."""

    def pull(self, name: str, dest: Path) -> bool:
        """Write entry `name`'s files into the new directory `dest`; False when the mirror has no whole
        entry of that name."""
        ...

    def push(self, entry: Path, name: str) -> None:
        """Copy the complete local entry directory `entry` to the mirror as `name` (manifest last)."""
        ...


def default_root() -> Path:
    """`converted/` under the cache directory of models.io.assets (`$DTP_LAYOUT_CACHE_DIR`)."""
    return cache_dir() / "converted"


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def gguf_path(source: ModelSource) -> Path | None:
    """The local GGUF file `source` names (a hub one fetched, or found in the HF cache, by
    huggingface_hub as from_pretrained would), or None for a safetensors source."""
    where, gguf = source.resolved()
    if not gguf:
        return None
    if Path(where).is_dir():
        return Path(where) / gguf
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(where, gguf, revision=source.revision))
    except Exception as exc:  # offline cache miss, missing repo or file, network
        raise ModelLoadError(f"model {source.path_or_id!r}: cannot fetch {gguf}: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class ConvertedCache:
    """Converted copies under `root/namespace/` (root: `default_root()` unless given)."""

    root: Path | None = None
    namespace: str = DEFAULT_NAMESPACE
    mirror: EntryMirror | None = None

    def __post_init__(self) -> None:
        if not NAMESPACE.fullmatch(self.namespace):
            raise ModelLoadError(f"converted-model namespace must match {NAMESPACE.pattern}, got {self.namespace!r}")

    @property
    def directory(self) -> Path:
        return Path(self.root if self.root is not None else default_root()).expanduser().absolute() / self.namespace

    # ---- the content key ------------------------------------------------------------------------------

    def file_sha256(self, path: Path) -> str:
        """sha256 of the file's bytes, hashed once per (real path, device, inode, size, mtime, ctime)."""
        real = path.resolve()
        st = real.stat()
        identity = json.dumps([str(real), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
        memo = self.directory / "sha256" / hashlib.sha256(identity.encode()).hexdigest()[:40]
        try:
            known = memo.read_text().strip()
            if SHA256.fullmatch(known):
                return known
        except OSError:
            pass
        h = hashlib.sha256()
        with open(real, "rb") as f:
            while block := f.read(CHUNK):
                h.update(block)
        digest = h.hexdigest()
        atomic_write_text(memo, digest)
        return digest

    def key(self, source: ModelSource, dtype: str) -> dict[str, Any] | None:
        """What an entry is made from (its manifest), or None for a source that needs no conversion."""
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        path = gguf_path(source)
        if path is None:
            return None
        if not path.is_file():
            raise ModelLoadError(f"model: GGUF file {path} does not exist")
        return {"format": FORMAT, "gguf_sha256": self.file_sha256(path), "dtype": dtype,
                "versions": {name: _package_version(name) for name in CONVERTER_PACKAGES}}

    @staticmethod
    def entry_name(key: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    # ---- entries --------------------------------------------------------------------------------------

    def lookup(self, source: ModelSource, *, dtype: str) -> Path | None:
        """The complete entry for (source, dtype) if there is one, else None (never converts)."""
        key = self.key(source, dtype)
        if key is None:
            return None
        entry = self.directory / self.entry_name(key)
        if not (entry / MANIFEST).is_file() and self.mirror is not None:
            self._pull(entry)
        return entry if (entry / MANIFEST).is_file() else None

    def _pull(self, entry: Path) -> bool:
        """The mirror's copy of `entry` installed here (a temporary directory renamed), if it has one."""
        assert self.mirror is not None
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.parent / f".{entry.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            if not self.mirror.pull(f"{self.namespace}/{entry.name}", tmp) or not (tmp / MANIFEST).is_file():
                return False
            publish(tmp, entry)
            return True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def converted_source(self, source: ModelSource, *, dtype: str = "float32") -> ModelSource:
        """The source to load instead of `source`: its converted copy (made now if there is none), or
        `source` itself when it needs no conversion."""
        try:
            key = self.key(source, dtype)
            if key is None:
                return source
            entry = self.directory / self.entry_name(key)
            if not (entry / MANIFEST).is_file():
                self._convert(source, key, entry)
        except OSError as exc:  # a full disk, an unwritable root: said, not hidden by a direct load
            raise ModelLoadError(f"model {source.path_or_id!r}: converted-model cache {self.directory}: "
                                 f"{type(exc).__name__}: {exc}") from exc
        return ModelSource(str(entry))

    def _convert(self, source: ModelSource, key: dict[str, Any], entry: Path) -> None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with open(entry.parent / f".{entry.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
            try:
                if (entry / MANIFEST).is_file():  # converted by whoever held the lock before us
                    return
                if self.mirror is not None and self._pull(entry):  # converted on another machine
                    return
                for stale in entry.parent.glob(f".{entry.name}.tmp-*"):  # a killed conversion's
                    shutil.rmtree(stale, ignore_errors=True)
                tmp = entry.parent / f".{entry.name}.tmp-{uuid.uuid4().hex[:8]}"
                try:
                    self._write(source, key, tmp)
                    publish(tmp, entry)
                    if self.mirror is not None:
                        self.mirror.push(entry, f"{self.namespace}/{entry.name}")
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _write(source: ModelSource, key: dict[str, Any], out: Path) -> None:
        t0 = time.perf_counter()
        model = load_model(source, dtype=key["dtype"], device="cpu")  # GGUF dequantised by transformers
        model.save_pretrained(out)
        del model
        tokenizer = load_tokenizer(source)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        _, gguf = source.resolved()
        manifest = {**key, "source": {"path_or_id": source.path_or_id, "revision": source.revision,
                                      "gguf_file": gguf}, "tokenizer": tokenizer is not None,
                    "convert_seconds": round(time.perf_counter() - t0, 3)}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: its presence marks a whole copy


def publish(tmp: Path, entry: Path) -> Path:
    """Rename the finished copy `tmp` to `entry`; if `entry` appeared meanwhile (another process won the
    race) ours is discarded and theirs kept. Returns `entry`."""
    try:
        os.rename(tmp, entry)
    except OSError:
        if not (entry / MANIFEST).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return entry
