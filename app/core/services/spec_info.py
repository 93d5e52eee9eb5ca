"""`GET /v1/spec`: what a job may leave out and what this server can read, for the dashboard's form and
for anyone writing a spec by hand.

The defaults are read off the request models (`app.core.schemas.jobs.field_defaults`, themselves generated from
the one declaration, models/run/jobspec.py, whose every field `fields` lists), the corpora off
`models.io.assets.available_corpora` (what this install has, not what the code knows of), the data root
off the disk. The example is the API's first example with its calibration source swapped for one this
server has, so that a form that starts from it submits a job that runs. Torch-free.
"""

from __future__ import annotations

import copy
from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.core.jobstate import STAGES, STATUSES
from app.core.schemas.jobs import (
    EXAMPLE_DISTILL_SPEC,
    EXAMPLE_SPEC,
    DistillJobSpec,
    JobSpec,
    field_defaults,
    required_fields,
)
from app.core.services.sources import check_name
from app.core.settings import Settings
from models.affinity.names import SCORES
from models.io.assets import CORPORA, available_corpora
from models.layouts.names import RANDOM_SEED_BASE
from models.run import jobspec
from models.run.files import ARTIFACTS
from models.variants.set import ablation_names

DATA_SUFFIXES = (".txt", ".jsonl", ".npy")  # what models.data.calibration reads from a file
MAX_DATA_NAMES = 200


def data_catalogue(data_root: Path, limit: int = MAX_DATA_NAMES) -> list[str]:
    """The names under the data root a job may give as a source (two levels: `name` and `dir/name`): .txt,
    .jsonl and .npy files, and directories with .txt files in them; each a plain name inside the root."""
    root = Path(data_root)
    if not root.is_dir():
        return []
    base = root.resolve()
    found: list[str] = []

    def plain(path: Path, name: str) -> bool:
        try:
            check_name(name, "source", "data")
            return path.resolve().is_relative_to(base)
        except (ValueError, OSError):
            return False

    def has_text(directory: Path) -> bool:
        try:
            return any(p.suffix == ".txt" and p.is_file() for p in directory.iterdir())
        except OSError:
            return False

    def walk(directory: Path, prefix: str, depth: int) -> None:
        try:
            entries = sorted(directory.iterdir(), key=lambda p: p.name)
        except OSError:
            return
        for entry in entries:
            name = f"{prefix}{entry.name}"
            if len(found) >= limit or not plain(entry, name):
                continue
            if entry.is_file() and entry.suffix in DATA_SUFFIXES:
                found.append(name)
            elif entry.is_dir():
                if has_text(entry):
                    found.append(name)
                if depth < 2:
                    walk(entry, f"{name}/", depth + 1)

    walk(root, "", 1)
    return found[:limit]


def _sources(settings: Settings) -> list[dict[str, Any]]:
    corpora = [{"source": f"corpus:{name}", "kind": "corpus", "description": CORPORA[name]}
               for name in available_corpora()]
    data = [{"source": name, "kind": "data", "description": None} for name in data_catalogue(settings.data_dir)]
    return corpora + data


def _runnable(source: str, sources: list[str]) -> str:
    """`source` when this server has it; else its first corpus, else its first data name, else `source`."""
    return source if source in sources or not sources else sources[0]


def _json_default(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def declared_fields() -> list[dict[str, Any]]:
    """Every field of the job spec as models/run/jobspec.py declares it (what the form draws its inputs,
    choices, bounds and placeholders from): path, kind, default (absent where required), doc, and the
    rule's bounds, choices, lengths and item rule where it has them."""
    out = []
    for f in jobspec.FIELDS:
        rule = f.rule
        entry: dict[str, Any] = {"path": f.path, "kind": rule.kind, "required": f.required, "doc": rule.doc,
                                 "nullable": rule.nullable}
        if not f.required:
            entry["default"] = _json_default(f.default)
        for key in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            if getattr(rule, key) is not None:
                entry[key] = getattr(rule, key)
        if rule.choices:
            entry["choices"] = list(rule.choices)
        if rule.item is not None:
            entry["item"] = {key: getattr(rule.item, key) for key in ("kind", "ge", "le", "min_length", "max_length")
                             if getattr(rule.item, key) is not None}
        out.append(entry)
    return out


def spec_info(*, settings: Settings) -> dict[str, Any]:
    sources = _sources(settings)
    names = [s["source"] for s in sources]
    example = copy.deepcopy(EXAMPLE_SPEC)
    example["calibration"]["source"] = _runnable(example["calibration"]["source"], names)
    distill = copy.deepcopy(EXAMPLE_DISTILL_SPEC["distill"])
    for part in ("train", "eval"):
        if isinstance(distill.get(part), dict) and "source" in distill[part]:
            distill[part]["source"] = _runnable(distill[part]["source"], names)
    return {
        "defaults": field_defaults(JobSpec),
        "distill_defaults": field_defaults(DistillJobSpec),
        "required": required_fields(JobSpec),
        "sources": sources,
        "example": example,
        "distill_example": distill,
        "ablations": {score: {"paper": ablation_names(score, 0), "restarts": ablation_names(score, 1)}
                      for score in SCORES},
        "random_seed_base": RANDOM_SEED_BASE,
        "max_calibration_tokens": settings.max_calibration_tokens,
        "fields": declared_fields(),
        "statuses": list(STATUSES),
        "stages": list(STAGES),
        "artifacts": [asdict(a) for a in ARTIFACTS],
    }
