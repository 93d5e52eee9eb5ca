"""The files of a run directory (a `dtp-layout optimise --out`, a job's work directory), named once, and the
artifacts a job publishes from them (`ARTIFACTS`: kind, stage, names, content type). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

AFFINITY_FILE = "affinity.safetensors"
REPORT_FILE = "report.json"
RUN_FILE = "run.json"  # the parameters of the run and the stages it finished (models.run.runner.RunRecord)
BLOCKS_FILE = "blocks.npy"
LAYOUTS_DIR = "layouts"
STABILITY_DIR = "stability"
STABILITY_FILE = "stability.json"
PROBE_DIR = "probe"  # the training probe's candidates, runs, cost.json and probe.json (models.probe.probe)
EXPORT_DIRS = ("checkpoint", "shards")
DISTILL_DIR = "distill"
DISTILL_SUMMARY = f"{DISTILL_DIR}/summary.json"  # GET /v1/jobs/{id}/metrics reads the headline from the artifact


@dataclass(frozen=True)
class ArtifactSpec:
    """What a job publishes, declared once: the `kind` of its artifacts (GET /v1/jobs/{id}/artifacts), the
    stage that publishes them (None: the run's end), the names they have (one name, or `dir/*`), the
    content type a download is served with (None: by each file's extension) and a line saying what it is.
    The stages (models/run/stages.py) check that each stage writes what it publishes, the worker's recorders
    take the kinds from here and refuse a file declared nowhere, and the dashboard reads the list through
    GET /v1/spec (`artifacts`)."""

    kind: str
    stage: str | None
    pattern: str
    content_type: str | None
    doc: str


ARTIFACTS: tuple[ArtifactSpec, ...] = (
    ArtifactSpec("affinity", "affinity", AFFINITY_FILE, "application/octet-stream",
                 "the affinity pass's edge scores (safetensors), as the tenant's cache holds them"),
    ArtifactSpec("checkpoint", "exporting", f"{EXPORT_DIRS[0]}/*", None,
                 "the optimised layout's permuted Hugging Face checkpoint"),
    ArtifactSpec("shards", "exporting", f"{EXPORT_DIRS[1]}/*", None, "the per-rank DTP shards and their manifest"),
    ArtifactSpec("distill", "distilling", f"{DISTILL_DIR}/metrics.csv", "text/csv",
                 "the distillation's evaluations: layout, seed, step, kl, ppl, loss, lr"),
    ArtifactSpec("distill", "distilling", DISTILL_SUMMARY, "application/json",
                 "the distillation's summary: dense perplexity, the headline, the data read"),
    ArtifactSpec("distill", "distilling", f"{DISTILL_DIR}/curves.png", "image/png", "the distillation's curves"),
    ArtifactSpec("report", None, REPORT_FILE, "application/json",
                 "the run's report: every layout's scores, the bounds, the timings"),
)
ARTIFACT_KINDS: tuple[str, ...] = tuple(dict.fromkeys(a.kind for a in ARTIFACTS))


class UndeclaredArtifact(LookupError):
    """A file about to be published that ARTIFACTS does not declare (a programming error, not the job's)."""


def artifact_spec(name: str) -> ArtifactSpec | None:
    """The declaration an artifact name falls under (`checkpoint/model.safetensors` → checkpoint/*)."""
    return next((a for a in ARTIFACTS if fnmatchcase(name, a.pattern)), None)


def kind_of(name: str) -> str:
    """The declared kind of an artifact name; UndeclaredArtifact when none declares it."""
    spec = artifact_spec(name)
    if spec is None:
        raise UndeclaredArtifact(f"artifact {name!r} is declared nowhere (models/run/files.py ARTIFACTS)")
    return spec.kind


def published_by(stage: str | None) -> tuple[ArtifactSpec, ...]:
    """What a stage publishes (None: the run's end)."""
    return tuple(a for a in ARTIFACTS if a.stage == stage)
