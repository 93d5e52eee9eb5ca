"""The Hugging Face Hub: which hub models and datasets a job may name, and how a worker gets a hub
model onto local disk before loading it.

A hub id is never read as a path: the worker fetches it through huggingface_hub (the cache, or a
download of config.json first, checked against the server's limits, then the safetensors, JSON and
tokenizer files of the snapshot) and loads the snapshot directory by its absolute path, so a
directory named like the id in any working directory is never looked at. DTP_LAYOUT_HUB_MODELS and
DTP_LAYOUT_HUB_DATASETS turn the hub off (empty) or limit it to owners and ids. Torch-free.
"""

from __future__ import annotations

import json
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
from app.core.settings import Settings
from models.io.gguf_header import GGUFError, GGUFLimits

SNAPSHOT_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt"]  # never pickles


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
    if not source.startswith("hf:"):
        return None
    name = source[3:].split(":", 1)[0]
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


def _fetch(location: ModelLocation, check: Callable[[dict[str, Any]], None], limits: GGUFLimits) -> ModelLocation:
    """The hub model as a local snapshot directory, its config checked before any weight is fetched."""
    from huggingface_hub import hf_hub_download, snapshot_download


    repo, revision = str(location.hub_id), location.revision
    if location.gguf_file:
        path = Path(hf_hub_download(repo, location.gguf_file, revision=revision))
        check(bounded_gguf_config(path, limits))
        return ModelLocation(path=path.parent.absolute(), gguf_file=location.gguf_file)
    config_path = Path(hf_hub_download(repo, "config.json", revision=revision))
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelRefused("model.id", f"hub model {repo!r}: config.json is larger than {MAX_CONFIG_BYTES} bytes")
    config = json.loads(config_path.read_text())
    check(config if isinstance(config, dict) else {})
    snapshot = Path(snapshot_download(repo, revision=revision, allow_patterns=SNAPSHOT_FILES))
    return ModelLocation(path=snapshot.absolute())


def prepare_model(*, settings: Settings, spec: JobSpec) -> ModelLocation:
    """Where the worker loads the job's model from, after the checks the API made at submit (run again:
    the model root, the hub and the settings may have changed since). Raises SourceError (a ValueError)
    naming the problem; a hub model comes back as its snapshot directory in the HF cache."""
    from app.core.services.model_limits import check_model_config

    def check(config: dict[str, Any]) -> None:
        if problems := check_model_config(config, spec=spec, settings=settings):
            raise ModelRefused(problems[0][0], "; ".join(f"{field}: {message}" for field, message in problems))

    location = resolve_model(settings.models_dir, spec.model.id, revision=spec.model.revision,
                             gguf_file=spec.model.gguf_file)
    if location.hub_id is None:
        gguf = location.path if location.path and location.path.suffix == ".gguf" else (
            location.path / location.gguf_file if location.path and location.gguf_file else None)
        config = bounded_gguf_config(gguf, settings.gguf_limits()) if gguf is not None else read_config(location)
        if config is not None:
            check(config)
        return location
    if problem := model_problem(settings, location.hub_id):
        raise SourceError("model.id", problem)
    try:
        return _fetch(location, check, settings.gguf_limits())
    except ModelRefused:
        raise
    except Exception as exc:  # network, missing repo or file, offline cache miss: the job fails naming the id
        where = f"{location.hub_id!r}" + (f" at revision {location.revision!r}" if location.revision else "")
        raise SourceError("model.id", f"cannot fetch hub model {where}: {type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0][:300] if str(exc) else ''}") from exc
