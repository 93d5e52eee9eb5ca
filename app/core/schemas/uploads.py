"""The request and response models of /v1/uploads and /v1/usage (pydantic): every field bounded."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from app.core.services.upload_files import FILE_NAME, MAX_FILES, UPLOAD_NAME, UploadKind

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$", min_length=64, max_length=64)]
FileName = Annotated[str, StringConstraints(min_length=1, max_length=200)]  # checked by upload_files, naming it

EXAMPLE_UPLOAD: dict[str, Any] = {
    "kind": "model", "name": "my-finetune",
    "files": [{"path": "config.json", "size": 689, "sha256": "3b1f" + "0" * 60},
              {"path": "model.safetensors", "size": 538_090_408, "sha256": "a7c2" + "0" * 60}]}


class UploadFileIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: FileName = Field(description=f"a plain file name ({FILE_NAME.pattern}): no directory part, no '..'")
    size: int = Field(ge=0, le=1 << 46, description="bytes")
    sha256: Sha256 = Field(description="the file's sha256, lower-case hex: the server computes it as the bytes "
                                       "arrive and keeps the file only when they match")


class UploadIn(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [EXAMPLE_UPLOAD]})

    kind: UploadKind = Field(description="model: a checkpoint directory (config.json, *.safetensors, tokenizer "
                                         "files) or one .gguf; data: one .jsonl or .npy of token ids, or .txt files")
    name: Annotated[str, StringConstraints(pattern=UPLOAD_NAME.pattern, max_length=100)] = Field(
        description="a label for people (the job names the upload by its id)")
    files: list[UploadFileIn] = Field(min_length=1, max_length=MAX_FILES)


class UploadFileOut(BaseModel):
    path: str
    size: int
    sha256: str
    parts: int = Field(description="parts to send: size / part_size, rounded up (one for an empty file)")
    parts_received: list[int] = Field(description="the part numbers the server has (a client resumes with the rest)")
    done: bool = Field(description="assembled and its sha256 verified")


class UploadOut(BaseModel):
    id: str
    ref: str = Field(description="what a job spec names it by: model.id or a data source, `upload:<id>`")
    kind: UploadKind
    name: str
    status: Literal["open", "complete"]
    owner: str | None
    size: int = Field(description="bytes of every declared file")
    charged: int = Field(description="what the upload counts against the quota: each file at least "
                                     "DTP_LAYOUT_UPLOAD_MIN_FILE_BYTES")
    part_size: int = Field(description="bytes of every part but a file's last")
    received_bytes: int
    created_at: datetime
    completed_at: datetime | None
    config: dict[str, Any] | None = Field(default=None, description="a model's architecture, from its config.json "
                                                                    "or GGUF metadata, checked at completion")
    files: list[UploadFileOut]
    links: dict[str, str]


class UploadList(BaseModel):
    items: list[UploadOut]
    total: int = Field(description="the caller's uploads in all")
    limit: int
    offset: int
    next: str | None = Field(description="the next page's URL; null on the last page")


class UsageOut(BaseModel):
    tenant: str | None
    quota_bytes: int = Field(description="the tenant's storage quota; 0: none")
    used_bytes: int = Field(description="the sum of `bytes`: what counts against the quota")
    bytes: dict[str, int] = Field(description="by kind: uploads_model, uploads_data (declared sizes, each file at "
                                              "least DTP_LAYOUT_UPLOAD_MIN_FILE_BYTES), artifacts (of jobs not "
                                              "expired), reserved (queued and running jobs' expected artifacts not "
                                              "yet published), converted (GGUF models' converted copies), affinity "
                                              "(affinity cache entries)")
    counts: dict[str, int] = Field(description="uploads (open, complete), jobs, jobs_expired, artifacts, derived "
                                               "(converted copies and affinity entries kept)")
    retention_days: float = Field(description="finished jobs' artifacts are removed after this many days; 0: never")
