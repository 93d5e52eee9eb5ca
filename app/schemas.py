"""The API's request and response models (pydantic), with the examples shown at /docs."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from models.ids import GGUF_FILE, REVISION

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
Stage = Literal["loading", "calibration", "affinity", "optimising", "exporting"]

EXAMPLE_SPEC: dict[str, Any] = {
    "model": {"id": "smollm2-135m", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32"},
    "devices": 3,
    "delta": 1,
    "calibration": {"source": "corpus:kjv", "sequences": 8, "seq_len": 256},
    "score": "fo",
    "random_layouts": 2,
    "ablations": False,
    "export": {"checkpoint": True, "shards": True},
    "distill": None,
}
EXAMPLE_HUB_SPEC: dict[str, Any] = {
    "model": {"id": "HuggingFaceTB/SmolLM2-135M", "revision": "main", "dtype": "bfloat16"},
    "devices": 3,
    "delta": 1,
    "calibration": {"source": "calibration/tokens.npy", "sequences": 64, "seq_len": 1024},
    "score": "add",
    "random_layouts": 4,
    "ablations": True,
    "export": {"checkpoint": False, "shards": True},
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelRef(_Strict):
    id: str = Field(min_length=1, max_length=300,
                    description="a hub id `owner/name`, or a name under the server's model root (a checkpoint "
                                "directory or a .gguf file)", examples=["smollm2-135m", "Qwen/Qwen2.5-0.5B"])
    revision: str | None = Field(default=None, max_length=128, pattern=REVISION.pattern,
                                 description="hub branch, tag or commit (hub models only)")
    gguf_file: str | None = Field(default=None, max_length=200, pattern=GGUF_FILE.pattern,
                                  description="a .gguf file inside the model directory or hub repo")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="weights dtype for the run")


class CalibrationIn(_Strict):
    """The calibration spec of `models/calibration.py`; a file source is a name under the data root."""

    source: str = Field(min_length=1, max_length=300,
                        description="corpus:kjv | corpus:shakespeare | hf:NAME[:CONFIG[:SPLIT]] | a name under the "
                                    "server's data root (.txt, .jsonl, .npy of token ids, or a directory of .txt)",
                        examples=["corpus:kjv", "calibration/tokens.npy"])
    sequences: StrictInt = Field(default=64, ge=1, le=1_000_000, description="calibration blocks")
    seq_len: StrictInt = Field(default=1024, ge=2, le=1_048_576, description="tokens per block")
    seed: StrictInt = Field(default=0, ge=0, description="block-order seed")
    text_field: str = Field(default="text", min_length=1, max_length=100, description="text field of .jsonl / hf rows")
    skip_blocks: StrictInt = Field(default=0, ge=0, description="blocks to skip at the start of the stream")

    def tokens(self) -> int:
        return self.sequences * self.seq_len


class ExportSpec(_Strict):
    checkpoint: StrictBool = Field(default=True, description="the permuted Hugging Face checkpoint (checkpoint/*)")
    shards: StrictBool = Field(default=True, description="per-rank DTP shards and manifest (shards/*)")

    @property
    def any(self) -> bool:
        return self.checkpoint or self.shards


class JobSpec(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [EXAMPLE_SPEC, EXAMPLE_HUB_SPEC]})

    model: ModelRef
    devices: StrictInt = Field(ge=1, le=1024, description="number of DTP devices L (must divide the KV groups "
                                                          "and the FFN width)")
    delta: StrictInt = Field(default=1, ge=0, le=1024, description="delay δ in modules")
    calibration: CalibrationIn
    score: Literal["fo", "add"] = Field(default="fo", description="up-edge affinity score")
    random_layouts: StrictInt = Field(default=0, ge=0, le=64, description="K random layouts scored as baselines")
    ablations: StrictBool = Field(default=False, description="also anti-optimised, heads-only and neurons-only")
    export: ExportSpec = Field(default_factory=lambda: ExportSpec(),
                               description="what to export for the optimised layout; `false` for nothing")
    distill: Any = Field(default=None, description="reserved for distillation; must be null for now")
    batch_size: StrictInt = Field(default=4, ge=1, le=1024, description="calibration sequences per micro-batch")
    restarts: StrictInt = Field(default=4, ge=0, le=64,
                                description="extra optimiser starts from random head assignments")

    @field_validator("export", mode="before")
    @classmethod
    def _export_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return {"checkpoint": value, "shards": value}
        return value

    @field_validator("distill")
    @classmethod
    def _no_distill(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("distillation is not available yet: distill must be null")
        return value


class Links(BaseModel):
    self: str
    layouts: str
    artifacts: str
    cancel: str


class JobOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "id": "3f6c1d0e9a8b4c7d8e9f0a1b2c3d4e5f", "status": "running", "stage": "affinity", "progress": 0.42,
        "eta_s": 12.5, "stages_done": ["loading", "calibration"], "affinity_cached": False, "cancel_requested": False,
        "attempts": 1,
        "owner": None, "spec": EXAMPLE_SPEC, "fingerprint": "9c1e…", "error": None, "error_stage": None,
        "created_at": "2026-11-30T10:00:00Z", "started_at": "2026-11-30T10:00:01Z", "finished_at": None,
        "updated_at": "2026-11-30T10:00:09Z", "timings": {"loading": 3.1, "calibration": 0.4}, "summary": None,
        "links": {"self": "/v1/jobs/3f6c…", "layouts": "/v1/jobs/3f6c…/layouts",
                  "artifacts": "/v1/jobs/3f6c…/artifacts", "cancel": "/v1/jobs/3f6c…/cancel"}}]})

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
    fingerprint: str
    error: str | None
    error_stage: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    updated_at: datetime
    timings: dict[str, float]
    summary: dict[str, Any] | None = Field(
        default=None, description="tokens, random expectation, upper bound and J per layout once the job succeeded")
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
    up_fraction: list[float]
    down_fraction: list[float]
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
    items: list[ArtifactOut]


class ScoresOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "job_id": "3f6c1d0e9a8b4c7d8e9f0a1b2c3d4e5f", "model": "smollm2-135m", "revision": None, "devices": 3,
        "delta": 1, "score": "fo", "finished_at": "2026-11-30T10:01:00Z", "tokens": 2048,
        "random_expectation": 19.667, "upper_bound": 31.775,
        "layouts": {"optimised": 30.242, "contiguous": 19.993, "random-1000": 19.651}}]})

    job_id: str
    model: str
    revision: str | None
    devices: int
    delta: int
    score: str
    finished_at: datetime | None
    tokens: int | None
    random_expectation: float | None
    upper_bound: float | None
    layouts: dict[str, float] = Field(description="J per layout name")


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)
