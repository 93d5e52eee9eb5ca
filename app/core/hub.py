"""The Hugging Face Hub: which hub models and datasets a job may name, and how a worker gets a hub
model onto local disk before loading it.

A hub id is never read as a path: the worker fetches it through huggingface_hub (the cache, or a
download of config.json first, checked against the server's limits, then the safetensors, JSON and
tokenizer files of the snapshot) and loads the snapshot directory by its absolute path, so a
directory named like the id in any working directory is never looked at. DTP_LAYOUT_HUB_MODELS and
DTP_LAYOUT_HUB_DATASETS turn the hub off (empty) or limit it to owners and ids. Torch-free.

What is fetched is held to an upload's limits (a hub repository is anyone's; issue 41): the snapshot's
files are listed with their sizes from the hub's metadata first, and only the top-level files an upload
may hold are fetched, by exact name at the listed commit, each tokenizer file within its kind's cap
(app.core.services.upload_checks), each JSON within JSON_MAX_BYTES, all of them within
HUB_MAX_MODEL_BYTES (`snapshot_files`); the same rule is applied to the snapshot on disk before it is
loaded (an offline cache included). A GGUF's header and tensor table are read from its first
GGUF_MAX_METADATA_BYTES (a ranged request) and checked before the file is downloaded
(`gguf_head_config`), then checked again on the downloaded file. The cache itself is held to
HUB_CACHE_MAX_BYTES (`make_cache_room`): what a fetch adds must fit beside what is cached, after the
models no job has used for an hour are deleted, least recently used first; a fetch that still does not fit
fails the job, naming the setting.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.core.schemas.jobs import JobSpec
from app.core.services.sources import (
    MAX_CONFIG_BYTES,
    ModelLocation,
    SourceError,
    read_config,
    read_gguf_config,
    resolve_model,
)
from app.core.services.upload_checks import size_problem
from app.core.services.upload_files import model_file_problem
from app.core.settings import Settings
from models.data.source import parse_data_source
from models.io.gguf_header import GGUFError, GGUFLimits, read_header
from models.io.gguf_tensors import checked_config


def allowed(name: str, allow: str) -> bool:
    """`name` (owner/name or a bare name) is allowed by `allow`: `*`, or a comma list of owners and ids."""
    if allow.strip() == "*":
        return True
    items = {a.strip() for a in allow.split(",") if a.strip()}
    owner = name.split("/", 1)[0] if "/" in name else None
    return name in items or (owner is not None and owner in items)


def _refusal(kind: str, name: str, allow: str, setting: str) -> str:
    if not allow.strip():
        return f"hub {kind}s are turned off on this server ({setting} is empty): {name!r} cannot be used"
    return f"hub {kind} {name!r} is not allowed on this server; allowed owners and ids ({setting}): {allow.strip()}"


def model_problem(settings: Settings, hub_id: str) -> str | None:
    return None if allowed(hub_id, settings.hub_models) else _refusal("model", hub_id, settings.hub_models,
                                                                       "DTP_LAYOUT_HUB_MODELS")


def dataset_problem(settings: Settings, source: str) -> str | None:
    """For `hf:OWNER/NAME[:CONFIG[:SPLIT]]` sources; None for everything else."""
    parsed = parse_data_source(source)
    if parsed.kind != "hf":
        return None
    name = parsed.dataset
    return None if allowed(name, settings.hub_datasets) else _refusal("dataset", name, settings.hub_datasets,
                                                                       "DTP_LAYOUT_HUB_DATASETS")


class ModelRefused(SourceError):
    """The model's config breaks the server's limits (app.core.services.model_limits)."""


def bounded_gguf_config(path: Path, limits: GGUFLimits) -> dict[str, Any]:
    """A GGUF file's config from its header read with bounds (models.io.gguf_header), or ModelRefused: a
    file whose header the bounded reader refuses is never handed to a loader that loops over what the
    file declares (a hub repository is anyone's)."""
    try:
        return read_gguf_config(path, limits=limits)
    except (OSError, GGUFError) as exc:
        raise ModelRefused("model.id", f"GGUF file {path.name!r}: cannot read its header: {exc}") from None


def snapshot_files(listing: list[tuple[str, int | None]], settings: Settings, *, repo: str) -> list[str]:
    """The files of a hub snapshot listed as (path, size) that a job fetches: the top-level ones an upload
    may hold (never a pickle, a .gguf or a subdirectory), each within its limit and all within
    HUB_MAX_MODEL_BYTES; ModelRefused naming the file and the setting (module docstring)."""
    chosen, total = [], 0
    for name, size in listing:
        if "/" in name or name.endswith(".gguf") or model_file_problem(name) is not None:
            continue
        if size is None:
            raise ModelRefused("model.id", f"hub model {repo!r}: the hub states no size for {name!r}")
        problem = size_problem(settings, name, size)
        if problem is None and name.endswith(".json") and size > settings.json_max_bytes:
            problem = f"is {size} bytes; a JSON file is at most {settings.json_max_bytes} (DTP_LAYOUT_JSON_MAX_BYTES)"
        if problem:
            raise ModelRefused("model.id", f"hub model {repo!r}: {name!r} {problem}")
        chosen.append(name)
        total += size
    if total > settings.hub_max_model_bytes:
        raise ModelRefused("model.id", f"hub model {repo!r}: its files are {total} bytes; a hub model is at most "
                                       f"{settings.hub_max_model_bytes} bytes (DTP_LAYOUT_HUB_MAX_MODEL_BYTES)")
    return chosen


def _check_size(size: int, settings: Settings, name: str) -> None:
    if size > settings.hub_max_model_bytes:
        raise ModelRefused("model.id", f"GGUF file {name!r} is {size} bytes; a hub model is at most "
                                       f"{settings.hub_max_model_bytes} bytes (DTP_LAYOUT_HUB_MAX_MODEL_BYTES)")


def gguf_head_config(head: bytes, size: int, settings: Settings, *, name: str) -> dict[str, Any]:
    """A hub GGUF's config from `head`, the first bytes of its `size`, once the file is within
    HUB_MAX_MODEL_BYTES and its header and tensor table pass (models.io.gguf_tensors); ModelRefused."""
    _check_size(size, settings, name)
    try:
        return checked_config(read_header(head, file_size=size, limits=settings.gguf_limits()), file_size=size)
    except GGUFError as exc:
        raise ModelRefused("model.id", f"GGUF file {name!r}: cannot read its header: {exc}") from None


def _hub_listing(repo: str, revision: str | None) -> tuple[str, dict[str, int | None]] | None:
    """(the commit `revision` names, each file's size) from the hub's metadata, nothing downloaded; None
    when the hub cannot be asked (offline, unreachable): then only the local cache is read."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise
    except Exception:  # the network: the cache may hold it (as hf_hub_download falls back to it)
        return None
    return str(info.sha), {s.rfilename: s.size for s in info.siblings or []}


def _hub_head(repo: str, name: str, commit: str, length: int) -> bytes:
    """At most the first `length` bytes of a hub file (a ranged request; a server that sends the whole
    file is read no further than `length`)."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    headers = {**build_hf_headers(), "Range": f"bytes=0-{length - 1}"}
    out = bytearray()
    with get_session().stream("GET", hf_hub_url(repo, name, revision=commit), headers=headers,
                              follow_redirects=True) as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            out += chunk[:length - len(out)]
            if len(out) >= length:
                break
    return bytes(out)


def local_listing(directory: Path) -> list[tuple[str, int | None]]:
    """(name, size) of a snapshot directory's top-level files, as `snapshot_files` takes them."""
    return [(p.name, p.stat().st_size) for p in sorted(directory.iterdir()) if p.is_file()]


def check_snapshot(directory: Path, settings: Settings, *, repo: str) -> None:
    """A snapshot on disk held to `snapshot_files`' rule, and each safetensors header within
    SAFETENSORS_MAX_HEADER_BYTES from its 8-byte length (as an upload's is), before any loader reads it."""
    snapshot_files(local_listing(directory), settings, repo=repo)
    limit = settings.safetensors_max_header_bytes
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0  # malformed: the loader's own error
        if length > limit:
            raise ModelRefused("model.id", f"hub model {repo!r}: {path.name!r} declares a {length}-byte header; "
                                           f"headers are at most {limit} bytes "
                                           "(DTP_LAYOUT_SAFETENSORS_MAX_HEADER_BYTES)")


CACHE_IDLE_S = 3600.0  # a cached model used more recently than this may be another worker's load: never deleted


def plan_cache_room(cached: list[tuple[str, int, float]], *, keep: str, need: int, cap: int,
                    now: float) -> list[str] | None:
    """Which cached repositories to delete, least recently used first, so that `need` more bytes fit beside
    the rest under `cap`; None when deleting every one idle for CACHE_IDLE_S still leaves too little.
    cached: (repo id, bytes on disk, last accessed, epoch seconds); `keep`'s own bytes are not counted
    (a fetch of a cached file adds nothing) and it is never deleted."""
    others = [c for c in cached if c[0] != keep]
    used = sum(size for _, size, _ in others)
    chosen: list[str] = []
    for repo_id, size, _ in sorted((c for c in others if now - c[2] >= CACHE_IDLE_S), key=lambda c: c[2]):
        if used + need <= cap:
            break
        chosen.append(repo_id)
        used -= size
    return chosen if used + need <= cap else None


def make_cache_room(repo: str, need: int, settings: Settings, *, cache_dir: Path | None = None) -> list[str]:
    """Delete what `plan_cache_room` chooses from huggingface_hub's model cache so a fetch of `need` bytes of
    `repo` fits under HUB_CACHE_MAX_BYTES; ModelRefused when it cannot. Returns the repositories deleted."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = [r for r in scan_cache_dir(cache_dir).repos if r.repo_type == "model"]
    except CacheNotFound:  # nothing cached yet
        repos = []
    cached = [(r.repo_id, r.size_on_disk, r.last_accessed) for r in repos]
    cap = settings.hub_cache_max_bytes
    chosen = plan_cache_room(cached, keep=repo, need=need, cap=cap, now=time.time())
    if chosen is None:
        raise ModelRefused("model.id", f"hub model {repo!r}: its {need} bytes do not fit in this worker's hub cache "
                                       f"beside the models used within the last hour (DTP_LAYOUT_HUB_CACHE_MAX_BYTES "
                                       f"= {cap}); try again later")
    if chosen:
        scan_cache_dir(cache_dir).delete_revisions(
            *(rev.commit_hash for r in repos if r.repo_id in chosen for rev in r.revisions)).execute()
    return chosen


def _fetch(location: ModelLocation, check: Callable[[dict[str, Any]], None], settings: Settings) -> ModelLocation:
    """The hub model as a local snapshot directory, its config checked before any weight is fetched and
    what is fetched held to the limits (module docstring). Without the hub's listing (offline), only
    the cache is read."""
    from huggingface_hub import hf_hub_download, snapshot_download

    repo = str(location.hub_id)
    listing = _hub_listing(repo, location.revision)
    commit, sizes = listing if listing is not None else (location.revision, {})
    local_only = listing is None
    if location.gguf_file:
        if listing is not None:
            size = sizes.get(location.gguf_file)
            if size is None:
                raise ModelRefused("model.gguf_file", f"hub model {repo!r} has no file {location.gguf_file!r}")
            head = _hub_head(repo, location.gguf_file, str(commit), min(size, settings.gguf_max_metadata_bytes))
            check(gguf_head_config(head, size, settings, name=location.gguf_file))
            make_cache_room(repo, size, settings)
        path = Path(hf_hub_download(repo, location.gguf_file, revision=commit, local_files_only=local_only))
        _check_size(path.stat().st_size, settings, path.name)
        check(bounded_gguf_config(path, settings.gguf_limits()))
        return ModelLocation(path=path.parent.absolute(), gguf_file=location.gguf_file)
    files = snapshot_files(list(sizes.items()), settings, repo=repo) if listing is not None else None
    config_path = Path(hf_hub_download(repo, "config.json", revision=commit, local_files_only=local_only))
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelRefused("model.id", f"hub model {repo!r}: config.json is larger than {MAX_CONFIG_BYTES} bytes")
    config = json.loads(config_path.read_text())
    check(config if isinstance(config, dict) else {})
    if files is not None:
        make_cache_room(repo, sum(sizes.get(name) or 0 for name in files), settings)
    snapshot = Path(snapshot_download(repo, revision=commit, allow_patterns=files, local_files_only=local_only))
    check_snapshot(snapshot, settings, repo=repo)  # what is on disk, an offline cache's too
    return ModelLocation(path=snapshot.absolute())


def _checker(settings: Settings, spec: JobSpec) -> Callable[[dict[str, Any]], None]:
    from app.core.services.model_limits import check_model_config

    def check(config: dict[str, Any]) -> None:
        if problems := check_model_config(config, spec=spec, settings=settings):
            raise ModelRefused(problems[0][0], "; ".join(f"{field}: {message}" for field, message in problems))

    return check


def check_local_model(location: ModelLocation, *, settings: Settings, spec: JobSpec) -> ModelLocation:
    """A local model (a model-root name or an upload's copy) checked again before the worker loads it: a
    GGUF's header and tensor table by the bounded reader, strictly (a file it refuses is never handed to
    the loader, which would dequantise what it does not know), else the directory's config.json."""
    assert location.path is not None
    gguf = location.path if location.path.suffix == ".gguf" else (
        location.path / location.gguf_file if location.gguf_file else None)
    config = bounded_gguf_config(gguf, settings.gguf_limits()) if gguf is not None else read_config(location)
    if config is not None:
        _checker(settings, spec)(config)
    return location


def prepare_model(*, settings: Settings, spec: JobSpec) -> ModelLocation:
    """Where the worker loads the job's model from, after the checks the API made at submit (run again:
    the model root, the hub and the settings may have changed since). Raises SourceError (a ValueError)
    naming the problem; a hub model comes back as its snapshot directory in the HF cache."""
    location = resolve_model(settings.models_dir, spec.model.id, revision=spec.model.revision,
                             gguf_file=spec.model.gguf_file)
    if location.hub_id is None:
        return check_local_model(location, settings=settings, spec=spec)
    if problem := model_problem(settings, location.hub_id):
        raise SourceError("model.id", problem)
    try:
        return _fetch(location, _checker(settings, spec), settings)
    except ModelRefused:
        raise
    except Exception as exc:  # network, missing repo or file, offline cache miss: the job fails naming the id
        where = f"{location.hub_id!r}" + (f" at revision {location.revision!r}" if location.revision else "")
        raise SourceError("model.id", f"cannot fetch hub model {where}: {type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from exc
