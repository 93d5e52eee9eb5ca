"""Where a job's model and calibration data come from, without ever letting a request pick a path.

A model id is either a name under the server's model root (a checkpoint directory or a `.gguf`
file) or a hub id `owner/name`; a calibration source is `corpus:NAME` (one this server's workers
have), `hf:OWNER/NAME[:CONFIG[:SPLIT]]` (a hub dataset id, never a path of the working directory) or a
name under the data root. Names are relative, without `..`, and must resolve (symlinks followed)
inside their root. Torch-free: the API process uses this module.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

from models.data.source import parse_data_source
from models.io.assets import CORPORA as ASSET_CORPORA
from models.io.assets import available_corpora
from models.io.bounded_json import load_object
from models.io.gguf_header import GGUFError, GGUFLimits, read_header
from models.io.gguf_tensors import checked_config
from models.io.ids import GGUF_FILE, HUB_ID, REVISION, hf_dataset_refusal
from models.schedules.grammar import ScheduleSpec, schedule_spec

CORPORA = tuple(ASSET_CORPORA)  # the names; which of them an install has: models.io.assets, submit_corpora
# The spelling; whether the name is a hub dataset id (owner/name, not a path): models.io.ids.hf_dataset_refusal.
HF_SOURCE = re.compile(r"^hf:[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?(:[A-Za-z0-9._-]*){0,2}$")
_NAME_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=@-]*$")


class SourceError(ValueError):
    """A model or data reference the server refuses; `field` is the spec field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_name(name: str, field: str, what: str) -> PurePosixPath:
    """A relative name: parts of letters, digits, `._+=@-`, no `..`, no leading dot or slash."""
    if not name or len(name) > 300 or "\\" in name or "\x00" in name or name.startswith(("/", "~")):
        raise SourceError(field, f"{what} {name!r} must be a relative name under the server's root "
                                 "(no absolute path, no '~', no backslash)")
    if any(not _NAME_PART.fullmatch(part) for part in name.split("/")):  # also '', '.' and '..'
        raise SourceError(field, f"{what} {name!r}: each path part must be a plain name (letters, digits, "
                                 "'._+=@-', not starting with '.'), without '..'")
    return PurePosixPath(name)


def resolve_under(root: Path, name: str, field: str, what: str) -> Path | None:
    """`root/name` with symlinks resolved, or None when it does not exist. Raises if it escapes root."""
    rel = check_name(name, field, what)
    base = Path(root).resolve()
    candidate = base.joinpath(*rel.parts)
    if not candidate.exists() and not candidate.is_symlink():
        return None
    resolved = candidate.resolve()
    if not resolved.is_relative_to(base):
        raise SourceError(field, f"{what} {name!r} resolves outside the server's root")
    return resolved


@dataclass(frozen=True)
class ModelLocation:
    """A resolved model: a local directory or .gguf file (`path`), or a hub id."""

    hub_id: str | None = None
    path: Path | None = None
    gguf_file: str | None = None
    revision: str | None = None

    @property
    def is_local(self) -> bool:
        return self.path is not None

    def loader_args(self) -> dict[str, Any]:
        """Keyword arguments for `models.io.loading.ModelSource`."""
        if self.path is not None:
            return {"path_or_id": str(self.path), "revision": None,
                    "gguf_file": None if self.path.suffix == ".gguf" else self.gguf_file}
        return {"path_or_id": self.hub_id, "revision": self.revision, "gguf_file": self.gguf_file}


def resolve_model(model_root: Path, model_id: str, *, revision: str | None = None,
                  gguf_file: str | None = None) -> ModelLocation:
    """A name under the model root wins over a hub id of the same spelling."""
    if revision is not None and (not REVISION.fullmatch(revision) or ".." in revision):
        raise SourceError("model.revision", f"revision {revision!r} is not a valid branch, tag or commit "
                                            "(letters, digits, '._/-', no '..')")
    if gguf_file is not None and not GGUF_FILE.fullmatch(gguf_file):
        raise SourceError("model.gguf_file", f"gguf_file must be a plain file name ending in .gguf, got {gguf_file!r}")
    looks_like_name = True
    try:
        local = resolve_under(model_root, model_id, "model.id", "model")
    except SourceError:
        if not HUB_ID.fullmatch(model_id):
            raise
        local, looks_like_name = None, False
    if local is not None:
        if local.is_file():
            if local.suffix != ".gguf":
                raise SourceError("model.id", f"model {model_id!r} is a file but not a .gguf file")
            if gguf_file:
                raise SourceError("model.gguf_file", "give either a .gguf model id or gguf_file, not both")
            return ModelLocation(path=local)
        if gguf_file:
            if not (local / gguf_file).is_file():
                raise SourceError("model.gguf_file", f"no file {gguf_file!r} in model {model_id!r}")
        elif not (local / "config.json").is_file():
            raise SourceError("model.id", f"model {model_id!r} has no config.json (a Hugging Face checkpoint "
                                          "directory, or name a .gguf file with gguf_file)")
        return ModelLocation(path=local, gguf_file=gguf_file, revision=None)
    if HUB_ID.fullmatch(model_id) and ".." not in model_id:
        return ModelLocation(hub_id=model_id, gguf_file=gguf_file, revision=revision)
    hint = " (names under the model root are relative, e.g. 'tiny' or 'team/model.gguf')" if looks_like_name else ""
    raise SourceError("model.id", f"no model named {model_id!r} under the server's model root, and not a hub id "
                                  f"of the form 'owner/name'{hint}")


def submit_corpora(setting: str) -> list[str]:
    """The corpus names a job may name at submit, from DTP_LAYOUT_CORPORA: `auto`, those this process
    can read (right wherever the API and its workers share a machine and its corpus settings: the
    embedded default); otherwise the comma-separated names the operator says the workers have."""
    if setting.strip().lower() in ("", "auto"):
        return available_corpora()
    return [name.strip() for name in setting.split(",") if name.strip()]


def resolve_data(data_root: Path, source: str, field: str = "calibration.source", *,
                 corpora: Collection[str] | None = None) -> str:
    """The source string `models.data.calibration` reads: corpus:/hf: as they are, a name as its absolute path.
    `field` is the spec field named in errors (calibration.source, distill.train.source, …); `corpora`,
    when given, the corpus names the workers have (the API's submit check; the worker reads and refuses
    a missing one itself)."""
    parsed = parse_data_source(source)
    if parsed.kind == "corpus":
        name = parsed.value
        if name not in CORPORA:
            raise SourceError(field, f"unknown corpus {source!r}; known: " + ", ".join(f"corpus:{c}" for c in CORPORA))
        if corpora is not None and name not in corpora:
            have = ", ".join(f"corpus:{c}" for c in CORPORA if c in corpora) or "none"
            raise SourceError(field, f"{source} is not installed on this server (its text is not in the workers' "
                                     f"corpus directory); available here: {have}")
        return source
    if parsed.kind == "hf":
        if not HF_SOURCE.fullmatch(source):
            raise SourceError(field, f"{source!r}: expected hf:OWNER/NAME[:CONFIG[:SPLIT]] (letters, digits, '._-')")
        if refusal := hf_dataset_refusal(parsed.dataset):
            raise SourceError(field, refusal)
        return source
    what = "calibration source" if field == "calibration.source" else "data source"
    path = resolve_under(data_root, source, field, what)
    if path is None:
        raise SourceError(field, f"no file or directory {source!r} under the server's data root; "
                          "expected corpus:kjv, corpus:shakespeare, hf:OWNER/NAME[:CONFIG[:SPLIT]] or a name under "
                          "the data root (.txt, .jsonl, .npy or a directory of .txt)")
    return str(path)


# ---- reading a config without weights ------------------------------------------------------------

# What submit reads of a server-side model (a GGUF header, a config.json), per file: keyed by (scope, path,
# size, mtime), so that a changed file is read again. `scope` is the tenant whose submit read it: a submit
# answered at once because the file was read for another tenant would tell that some tenant named this
# model. Files read at server start (`warm_configs`) are under WARM, shared by every tenant: no tenant
# caused those reads.
_config_cache: dict[tuple[str | None, str, int, int], dict[str, Any] | None] = {}
WARM = "\0server-start"
MAX_CACHED = 4096  # entries; past it the cache starts over (files × tenants; the model root is the operator's)
_MISSING = object()


def _cached(path: Path, read: Callable[[Path], dict[str, Any] | None], scope: str | None) -> dict[str, Any] | None:
    """`read(path)`, or what it returned for this path, size and mtime before (a copy: callers may fill it in)."""
    try:
        st = path.stat()
    except OSError:
        return None
    ident = (str(path), st.st_size, st.st_mtime_ns)
    found = _config_cache.get((WARM, *ident), _MISSING)
    if found is _MISSING:
        found = _config_cache.get((scope, *ident), _MISSING)
    if found is _MISSING:
        found = read(path)
        if len(_config_cache) >= MAX_CACHED:
            _config_cache.clear()
        _config_cache[(scope, *ident)] = found
    return None if found is None else dict(found)  # type: ignore[call-overload]


def gguf_config(path: Path, *, scope: str | None = None) -> dict[str, Any] | None:
    """The architecture fields of a GGUF file's header (read with bounds: read_gguf_config), or None when
    it cannot be read; cached per file and `scope` (the tenant; `_config_cache`): a read takes 0.05-0.5 s
    for a real vocabulary, seconds from a cold disk."""
    return _cached(path, _read_gguf_config, scope)


def read_gguf_config(path: Path, *, limits: GGUFLimits | None = None) -> dict[str, Any]:
    """The architecture fields of a GGUF file's header, read with bounds (models.io.gguf_header: no count
    or length is looped over before it is checked against the file's size and `limits`), once its tensor
    table agrees with them (models.io.gguf_tensors). Raises GGUFError (a ValueError) saying what is wrong."""
    limits = limits or GGUFLimits()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise GGUFError("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            try:
                # pages read: the header's only; its tensor table checked against its config
                return checked_config(read_header(view, file_size=size, limits=limits), file_size=size)
            except GGUFError as exc:
                problem = str(exc)  # only the text: the traceback's frames hold views that keep the mapping open
    raise GGUFError(problem)


def _read_gguf_config(path: Path) -> dict[str, Any] | None:
    try:
        return read_gguf_config(path)
    except (OSError, ValueError):  # an unreadable file fails the job's loading stage with the loader's message
        return None


def _hub_config(location: ModelLocation, scope: str | None = None) -> dict[str, Any] | None:
    if location.gguf_file:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(str(location.hub_id), "config.json", revision=location.revision)
    except Exception:
        return None
    if not isinstance(cached, str):
        return None
    return _json_config(Path(cached), scope)


MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 64  # DTP_LAYOUT_JSON_MAX_DEPTH's default: a config is a few levels deep


def _json_config(path: Path, scope: str | None = None) -> dict[str, Any] | None:
    return _cached(path, _read_json_config, scope)


def _read_json_config(path: Path) -> dict[str, Any] | None:
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return None  # not a config: the loader refuses it in the worker
        return load_object(path.read_bytes(), name=path.name, max_bytes=MAX_CONFIG_BYTES, max_depth=MAX_CONFIG_DEPTH)
    except (OSError, ValueError):
        return None


def read_config(location: ModelLocation, *, scope: str | None = None) -> dict[str, Any] | None:
    """The model's config as a dict when it is readable without downloading weights, else None;
    `scope`: the tenant whose cached GGUF metadata may be reused (gguf_config)."""
    if location.path is None:
        return _hub_config(location, scope)
    if location.path.suffix == ".gguf":
        return gguf_config(location.path, scope=scope)
    if location.gguf_file:
        return gguf_config(location.path / location.gguf_file, scope=scope)
    return _json_config(location.path / "config.json", scope)


def forget_configs() -> None:
    """Drop the cached model metadata (a worker, between jobs: no job's speed depends on another's)."""
    _config_cache.clear()


def warm_configs(model_root: Path, hub_cache: Path | None = None, *, budget_s: float = 5.0,
                 max_files: int = 256) -> int:
    """Read, at server start, what submit reads of the models already there: every .gguf header and
    config.json under the model root (4 levels deep) and the config.json of every snapshot in the
    Hugging Face cache, into the cache every tenant shares (WARM). Bounded by `budget_s` and
    `max_files` (what is left is read, per tenant, by the first submit naming it). Returns the files read."""
    deadline = time.monotonic() + budget_s
    found: list[tuple[Path, Callable[[Path], dict[str, Any] | None]]] = []
    base = Path(model_root)
    if base.is_dir():
        for directory, dirs, files in os.walk(base):
            depth = len(Path(directory).relative_to(base).parts)
            dirs[:] = [] if depth >= 4 else sorted(d for d in dirs if not d.startswith("."))
            found += [(Path(directory) / f, _read_gguf_config) for f in sorted(files) if f.endswith(".gguf")]
            if "config.json" in files:
                found.append((Path(directory) / "config.json", _read_json_config))
    if hub_cache is not None and hub_cache.is_dir():
        found += [(p, _read_json_config) for p in sorted(hub_cache.glob("models--*/snapshots/*/config.json"))]
    read = 0
    for path, reader in found[:max_files]:
        if time.monotonic() > deadline:
            break
        _cached(path, reader, WARM)
        read += 1
    return read


def config_namespace(config: dict[str, Any]) -> SimpleNamespace:
    """A config object for `models.families` (the defaults transformers would fill in)."""
    ns = SimpleNamespace(**config)
    if getattr(ns, "num_key_value_heads", None) is None:
        ns.num_key_value_heads = getattr(ns, "num_attention_heads", None)
    if getattr(ns, "head_dim", None) is None:
        ns.head_dim = None
    if getattr(ns, "hidden_size", None) is None:
        ns.hidden_size = 0
    return ns


# ---- fingerprints -----------------------------------------------------------------------------------

def _file_identity(path: Path, root: Path) -> list[list[Any]]:
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix in (".json", ".safetensors", ".gguf", ".txt",
                                                                    ".jsonl", ".npy", ".model"))
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.relative_to(root)) if f.is_relative_to(root) else f.name, st.st_size, st.st_mtime_ns])
    return out


def fingerprint(*, model_id: str, revision: str | None, gguf_file: str | None, dtype: str,
                calibration: dict[str, Any], model_path: Path | None = None, data_path: Path | None = None,
                schedule: str | None = None) -> str:
    """What the affinity result depends on: the model (and, for local files, their sizes and mtimes),
    its revision, GGUF file and dtype, the calibration spec (and its local files), and `schedule`: what
    besides the paper's chain the pass computes (`affinity_schedule`; None for the chain alone, so that
    the fingerprints of dtp:1 jobs are those they had before schedules existed)."""
    key: dict[str, Any] = {"model": model_id, "revision": revision, "gguf_file": gguf_file, "dtype": dtype,
                           "calibration": calibration}
    if schedule is not None:
        key["schedule"] = schedule
    if model_path is not None:
        key["model_files"] = _file_identity(model_path, model_path.parent)
    if data_path is not None:
        key["data_files"] = _file_identity(data_path, data_path.parent)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def affinity_schedule(schedule: str | ScheduleSpec, devices: int) -> str | None:
    """The part of a job's schedule its affinity file depends on: the edges of its J_σ (dtp:2 adds
    KV→KV and neuron→neuron edges, pt:D every lag in a block), and for spd:auto:K the layers SPD's rule
    chooses, which depend on the devices simulated. None for dtp:1, whose pass is the paper's chain."""
    spec = schedule_spec(schedule)
    if str(spec) == "dtp:1":
        return None
    return f"{spec}@L={devices}" if not spec.resolvable else str(spec)
