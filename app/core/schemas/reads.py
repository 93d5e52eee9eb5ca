"""The API's response models for reading jobs (a job, lists, artifacts, scores, metrics, health) and the
routes' shared query parameters (pydantic)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from app.core import safe_text
from app.core.jobstate import Status
from app.core.schemas.jobs import EXAMPLE_SPEC, _clean_or_none
from models.schedules.grammar import ACCEPTED, MAX_SCHEDULE_CHARS, parse_schedule


class Links(BaseModel):
    self: str
    layouts: str
    artifacts: str
    metrics: str
    cancel: str


class TimelineEntry(BaseModel):
    stage: str = Field(description="`queued` (waiting for a worker), then a stage name")
    attempt: int = Field(description="the worker run (0 for `queued`)")
    started_at: datetime | None
    finished_at: datetime | None = Field(description="null while the span runs")
    seconds: float | None = Field(description="duration; while running, so far")
    state: Literal["done", "running", "failed", "cancelled", "interrupted"]


class JobOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "3f6c1d0e9a8b4c7d8e9f0a1b2c3d4e5f", "status": "running", "stage": "affinity", "progress": 0.42,
        "eta_s": 12.5, "stages_done": ["loading", "calibration"], "affinity_cached": False, "cancel_requested": False,
        "attempts": 1,
        "owner": None, "spec": EXAMPLE_SPEC, "schedule": "dtp:1", "fingerprint": "9c1e…", "error": None,
        "error_stage": None,
        "created_at": "2026-11-30T10:00:00Z", "started_at": "2026-11-30T10:00:01Z", "finished_at": None,
        "updated_at": "2026-11-30T10:00:09Z", "timings": {"loading": 3.1, "calibration": 0.4}, "summary": None,
        "device": {"device": "cuda:0", "name": "NVIDIA H200", "memory_total_gib": 139.81, "capability": "9.0",
                   "cuda": "13.0", "torch": "2.11.0+cu130", "visible_devices": 1},
        "timeline": [
            {"stage": "queued", "attempt": 0, "started_at": "2026-11-30T10:00:00Z",
             "finished_at": "2026-11-30T10:00:01Z", "seconds": 0.8, "state": "done"},
            {"stage": "loading", "attempt": 1, "started_at": "2026-11-30T10:00:01Z",
             "finished_at": "2026-11-30T10:00:04Z", "seconds": 3.1, "state": "done"},
            {"stage": "affinity", "attempt": 1, "started_at": "2026-11-30T10:00:05Z", "finished_at": None,
             "seconds": 4.0, "state": "running"}],
        "links": {"self": "/v1/jobs/3f6c…", "layouts": "/v1/jobs/3f6c…/layouts",
                  "artifacts": "/v1/jobs/3f6c…/artifacts", "metrics": "/v1/jobs/3f6c…/metrics",
                  "cancel": "/v1/jobs/3f6c…/cancel"}}]})

    id: str
    status: Status
    stage: str | None = Field(default=None, description="current stage while running; the failing stage when failed")
    progress: float = Field(description="fraction of the current stage done")
    eta_s: float | None = Field(default=None, description="seconds left in the current stage (estimate)")
    stages_done: list[str]
    affinity_cached: bool = Field(description="the affinity came from an earlier job with the same fingerprint")
    cancel_requested: bool = Field(default=False, description="a cancel was requested (a running job stops between "
                                                              "micro-batches)")
    attempts: int
    owner: str | None
    spec: dict[str, Any]
    schedule: str = Field(description=f"the schedule the job runs, canonical: the spec's `schedule`, or dtp:δ of "
                                      f"its `delta` (accepted: {ACCEPTED})")
    fingerprint: str
    error: str | None
    error_stage: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    timings: dict[str, float]
    expired_at: datetime | None = Field(
        default=None, description="when the job's artifacts were removed from the store (its downloads are then 410 "
                                  "Gone; the job, its layouts and scores stay)")
    expired_reason: Literal["deleted", "retention"] | None = Field(
        default=None, description="deleted: DELETE /v1/jobs/{id}; retention: DTP_LAYOUT_RETENTION_DAYS passed")
    summary: dict[str, Any] | None = Field(
        default=None, description="tokens, random expectation, upper bound and J per layout once the job succeeded; "
                                  "`serve`: how to serve its shards with vLLM (`available`, `commands`: the client's "
                                  "download and `dtp-layout vllm-serve`, `devices` = L, `schedule`, `docs`), or "
                                  "`available: false` and `why`")
    device: dict[str, Any] | None = Field(
        default=None, description="where the worker runs the job (latest attempt): `device` (cpu, cuda:N), `name` "
                                  "(e.g. NVIDIA H200), `memory_total_gib`, `capability`, `cuda`, `torch`; null "
                                  "until a worker picked the job up")
    timeline: list[TimelineEntry] = Field(
        default_factory=list, description="time spans from the job's history: queued, then each stage attempt "
                                          "(an interrupted attempt, then its resumption)")
    links: Links


class JobList(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int
    next: str | None


class LayoutSummary(BaseModel):
    name: str
    J: float
    random_expectation: float
    upper_bound: float
    upper_bound_exact: bool
    # per layer; null where the job's schedule has no such edge (spd:B: only its layers' syncs drop)
    up_fraction: list[float | None]
    down_fraction: list[float | None]
    link: str


class LayoutList(BaseModel):
    items: list[LayoutSummary]


class ArtifactOut(BaseModel):
    name: str
    kind: str
    size: int
    sha256: str
    link: str


class ArtifactList(BaseModel):
    items: list[ArtifactOut] = Field(description="the job's files; empty once they were removed from the store")
    expired_at: datetime | None = Field(default=None, description="when the artifacts were removed from the store "
                                                                  "(DELETE /v1/jobs/{id}, or the retention period); "
                                                                  "null while they are there")
    expired_reason: Literal["deleted", "retention"] | None = Field(default=None, description="deleted or retention")
    removed: int = Field(default=0, description="how many artifacts the job had published before they were removed")


class ScoresOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "job_id": "3f6c1d0e9a8b4c7d8e9f0a1b2c3d4e5f", "model": "smollm2-135m", "revision": None, "devices": 3,
        "schedule": "dtp:1", "delta": 1, "score": "fo", "finished_at": "2026-11-30T10:01:00Z", "tokens": 2048,
        "random_expectation": 19.667, "upper_bound": 31.775,
        "layouts": {"optimised": 30.242, "contiguous": 19.993, "random-1000": 19.651}}]})

    job_id: str
    model: str
    revision: str | None
    devices: int
    schedule: str = Field(description="the job's schedule, canonical (dtp:1, pt:2, …)")
    delta: int = Field(description="the δ of the job's layouts: a dtp schedule's δ; for a schedule without one, the "
                                   "spec's `delta`")
    score: str
    finished_at: datetime | None
    tokens: int | None
    random_expectation: float | None
    upper_bound: float | None
    layouts: dict[str, float] = Field(description="J per layout name")


class Curve(BaseModel):
    layout: str
    seed: int
    steps: list[int] = Field(description="evaluation steps (optimiser steps taken before each evaluation)")
    kl: list[float | None] | None = Field(
        default=None, description="mean per-token KL(dense ‖ DTP) in nats on the evaluation blocks, per step")
    ppl: list[float | None] | None = Field(default=None, description="the DTP model's perplexity, per step")
    loss: list[float | None] | None = Field(
        default=None, description="mean training loss since the previous evaluation (null at step 0)")
    lr: list[float | None] | None = Field(default=None, description="lr of the last step taken")


class MetricsOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "job_id": "3f6c1d0e9a8b4c7d8e9f0a1b2c3d4e5f", "status": "succeeded", "stage": None,
        "curves": [
            {"layout": "optimised", "seed": 0, "steps": [0, 100, 200], "kl": [0.91, 0.21, 0.12],
             "ppl": [40.1, 22.3, 20.9], "loss": [None, 0.52, 0.25], "lr": [1e-5, 9.2e-5, 1e-5]},
            {"layout": "contiguous", "seed": 0, "steps": [0, 100, 200], "kl": [1.72, 0.35, 0.2],
             "ppl": [75.0, 25.6, 22.2], "loss": [None, 0.81, 0.38], "lr": [1e-5, 9.2e-5, 1e-5]}],
        "summary": {"dense_ppl": 19.8, "headline": {
            "reference": "contiguous", "candidate": "optimised", "reference_final_step": 200,
            "reference_final_kl": 0.2, "candidate_final_kl": 0.12, "candidate_step_to_reference_final_kl": 131.0,
            "multipliers": [{"step": 100, "reference_kl": 0.35, "candidate_step": 62.5, "multiplier": 1.6},
                            {"step": 200, "reference_kl": 0.2, "candidate_step": 131.0, "multiplier": 1.53}]}},
    }]})

    job_id: str
    status: Status
    stage: str | None
    curves: list[Curve] = Field(description="one curve per (layout, seed), in the job's layout order; empty until "
                                            "the first evaluation")
    summary: dict[str, Any] | None = Field(
        default=None, description="once summary.json exists: dense_ppl and the headline (the step at which the "
                                  "candidate reaches the reference's final KL, and the compute multipliers)")


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)


# ---- query parameters shared by the routes ------------------------------------------------------------

def _text_query(max_length: int, description: str) -> Any:
    from fastapi import Query

    return Query(max_length=max_length, description=f"{description} (printable characters; compared after "
                                                    "NFC normalisation)")


def _int_query(ge: int, le: int, description: str) -> Any:
    from fastapi import Query

    return Query(ge=ge, le=le, description=description)


ModelFilter = Annotated[str | None, _text_query(300, "model id as submitted"), AfterValidator(_clean_or_none)]
OwnerFilter = Annotated[str | None, _text_query(100, "owner (tenant); only an admin sees other tenants' jobs"),
                        AfterValidator(_clean_or_none)]
RevisionFilter = Annotated[str | None, _text_query(128, "hub revision as submitted"), AfterValidator(_clean_or_none)]
LayoutFilter = Annotated[str | None, _text_query(64, "only this layout"), AfterValidator(_clean_or_none)]


def _canonical_schedule(value: str | None) -> str | None:
    """A schedule filter in the canonical form the jobs' rows hold (`spd:3,1` → `spd:1,3`, `dtp:01` → `dtp:1`);
    a ScheduleError (a ValueError: 422) names the bad part and the accepted forms."""
    return None if value is None else str(parse_schedule(safe_text.clean(value)))


ScheduleFilter = Annotated[str | None, _text_query(MAX_SCHEDULE_CHARS, f"only jobs of this schedule, compared in "
                                                                      f"canonical form; accepted: {ACCEPTED}"),
                           AfterValidator(_canonical_schedule)]
DeltaFilter = Annotated[int | None, _int_query(0, 1024, "δ: short for schedule=dtp:δ (as in a job spec); with "
                                                       "`schedule`, the two must agree")]
