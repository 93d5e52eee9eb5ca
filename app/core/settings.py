"""Service settings: one pydantic-settings class, every field from a `DTP_LAYOUT_*` environment variable.

The defaults are the embedded setup of `dtp-layout serve`: everything under `./var` (SQLite database,
a SQLite-backed Celery transport, artifacts, model and data roots), no other server needed.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from models.io.gguf_header import GGUFLimits
from models.io.sandbox import ChildLimits, TokenizerLimits
from models.run.jobspec import MAX_WORLD_SIZE

# Key and tenant names: what `keys create` accepts and the jobs' `owner` column (String(100)) holds.
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DTP_LAYOUT_", extra="ignore")

    var_dir: Path = Field(default=Path("var"), description="base of the embedded defaults below (`serve --var-dir`)")
    database_url: str = Field(default="", description="SQLAlchemy URL, e.g. postgresql+psycopg://user:pw@host/db; "
                                                      "default sqlite:///VAR_DIR/dtp-layout.db")
    broker_url: str = Field(default="", description="Celery broker, e.g. redis://host:6379/0; default: a "
                                                    "SQLite broker derived from the database's location "
                                                    "(VAR_DIR/broker.db for the default database, DB.broker.db "
                                                    "beside another SQLite database, VAR_DIR/broker-HASH.db for "
                                                    "a server database), so that two services never share one")
    broker_key_prefix: str = Field(default="", description="Redis only: a prefix for every broker key (several "
                                                           "services on one Redis)")
    storage_root: Path | None = Field(default=None, description="artifacts, per-job work directories and the affinity "
                                                                "cache (a volume the API and workers share); default "
                                                                "VAR_DIR/storage")
    storage_url: str = Field(default="", max_length=1024,
                             description="s3://BUCKET/PREFIX: artifacts, the affinity cache, converted models and "
                                         "uploads live in this S3-compatible store (endpoint and credentials from "
                                         "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION); "
                                         "empty: the STORAGE_ROOT directory, shared by the API and its workers "
                                         "(app/core/storage/object_store.py)")
    storage_redirect: bool = Field(default=False, description="S3 store only: artifact downloads answer 307 to a "
                                                              "presigned URL of the object (expiring after "
                                                              "PRESIGN_EXPIRY_S) instead of streaming it through "
                                                              "the API; the URL shows the tenant the store's "
                                                              "endpoint, bucket, object key and access-key id "
                                                              "(docs/security.md)")
    presign_expiry_s: int = Field(default=300, ge=10, le=3600, description="lifetime of a presigned download URL "
                                                                           "(STORAGE_REDIRECT)")
    multipart_stale_s: float = Field(default=86400.0, ge=60, description="the workers' sweeper aborts multipart "
                                                                         "uploads begun longer ago than this (and "
                                                                         "removes a job's objects no artifact row "
                                                                         "lists once the job has ended)")
    model_root: Path | None = Field(default=None, description="the models a job may name (directories or .gguf "
                                                              "files); default VAR_DIR/models")
    data_root: Path | None = Field(default=None, description="the calibration files a job may name; default "
                                                             "VAR_DIR/data")
    queue: str = Field(default="gpu", description="Celery queue the jobs go to")
    api_keys: str = Field(default="", description="keys by digest, comma-separated NAME:sha256:HEX[:admin]"
                                               "[:tenant=T] entries (`dtp-layout keys create NAME --settings` prints "
                                               "one); the api_keys table holds the others")
    require_keys: bool = Field(default=False, description="never run open: with no key at all every /v1 call is 401 "
                                                          "(docker-compose.yml sets it)")
    key_cache_s: float = Field(default=2.0, ge=0, le=300, description="seconds the API caches the api_keys table "
                                                                       "(a revoked key stops working within this)")
    max_body_bytes: int = Field(default=65536, ge=1024, le=1 << 30, description="larger request bodies get 413 "
                                                                                "before they are read")
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600, description="a request's headers must arrive within "
                                                                            "this from the connection's start or the "
                                                                            "previous response; else the connection "
                                                                            "is closed (`serve`; "
                                                                            "app/api/http_timeouts.py)")
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600, description="a request's body must arrive within this "
                                                                          "from the end of its headers; else 408 and "
                                                                          "the connection is closed")
    rate_limit_per_min: int = Field(default=600, ge=0, description="requests per minute per key (per client address "
                                                                   "without a valid key); 0 turns the limit off")
    rate_limit_burst: int = Field(default=120, ge=1, description="requests a key may make at once before the rate "
                                                                 "limit applies")
    max_active_jobs: int = Field(default=4, ge=1, description="queued + running jobs per tenant; more is 429 with "
                                                              "Retry-After")
    max_active_tokens: int = Field(default=1 << 29, ge=1, description="work tokens "
                                   "(app.core.services.budgets: calibration, "
                                                                      "distillation training and evaluation, layout "
                                                                      "work) of a tenant's active jobs; more is 429 "
                                                                      "(one job alone past it: 422)")
    max_calibration_tokens: int = Field(default=1 << 20, ge=2, description="calibration sequences × seq_len per job "
                                                                           "(also the evaluation set of a distill); "
                                                                           "more is 422")
    max_skip_tokens: int = Field(default=1 << 26, ge=0, description="skip_blocks × seq_len of any data spec")
    max_distill_tokens: int = Field(default=1 << 28, ge=1, description="steps × batch_size × seq_len × layouts × "
                                                                       "seeds of a job's distillation (and the "
                                                                       "training blocks it loads)")
    max_evaluations: int = Field(default=10_000, ge=1, description="distillation evaluations of a job over all its "
                                                                   "runs (4 metric rows each)")
    max_eval_tokens: int = Field(default=1 << 26, ge=1, description="distillation evaluation tokens of a job: "
                                                                    "(evaluations + 1) × evaluation sequences × "
                                                                    "seq_len, every run's and the dense model's")
    max_model_params: int = Field(default=10_000_000_000, ge=1, description="parameter count of a model, estimated "
                                                                            "from its config, that a job may load")
    # Tenant content is parsed with bounds (docs/security.md, "Parsing what a tenant sends"): each limit
    # is far above what a real model's files hold.
    gguf_max_metadata_bytes: int = Field(default=GGUFLimits.max_metadata_bytes, ge=1 << 16,
                                         description="a GGUF file's header (metadata and tensor table) may be "
                                                     "this long; longer is 422")
    gguf_max_array_items: int = Field(default=GGUFLimits.max_array_items, ge=1,
                                      description="elements of one GGUF metadata array (a vocabulary's tokens); "
                                                  "more is 422 before any element is read")
    gguf_max_entries: int = Field(default=GGUFLimits.max_entries, ge=1,
                                  description="metadata entries of a GGUF file; more is 422")
    gguf_max_tensors: int = Field(default=GGUFLimits.max_tensors, ge=1,
                                  description="tensors a GGUF file may declare; more is 422")
    gguf_max_metadata_items: int = Field(default=GGUFLimits.max_metadata_items, ge=1,
                                         description="elements of all a GGUF file's metadata arrays together "
                                                     "(the worker's loader makes objects of each: 40-150 µs and "
                                                     "~1.7 KiB a string); more is 422 before they are read")
    tokenizer_vocab_max_bytes: int = Field(default=8 << 20, ge=1 << 10,
                                           description="a model's vocab.json, merges.txt, vocab.txt or "
                                                       "added_tokens.json may be this long (a slow tokenizer holds "
                                                       "~28× it in the worker); longer is 422 before it is read")
    tokenizer_model_max_bytes: int = Field(default=8 << 20, ge=1 << 10,
                                           description="a model's tokenizer.model (sentencepiece) may be this "
                                                       "long; longer is 422 before it is read")
    tokenizer_config_max_bytes: int = Field(default=4 << 20, ge=1 << 10,
                                            description="a model's tokenizer_config.json, special_tokens_map.json, "
                                                        "chat_template.json or chat_template.jinja may be this "
                                                        "long; longer is 422 before it is read")
    safetensors_max_header_bytes: int = Field(default=16 << 20, ge=1 << 10, description="a .safetensors file's "
                                                                                        "JSON header may be this "
                                                                                        "long; longer is 422 "
                                                                                        "before it is read")
    json_max_bytes: int = Field(default=64 << 20, ge=1 << 10, description="a tenant's JSON file (tokenizer.json, "
                                                                          "an index; config.json: 1 MiB; the "
                                                                          "tokenizer's side files: their "
                                                                          "TOKENIZER_*_MAX_BYTES) may be this long")
    json_max_depth: int = Field(default=64, ge=4, le=10_000, description="arrays and objects in a tenant's JSON file "
                                                                         "(and a safetensors header) may nest this "
                                                                         "deep; deeper is 422")
    upload_checks_max: int = Field(default=4, ge=1, le=256, description="upload completions checked at once per API "
                                                                        "process (each in a child process, off the "
                                                                        "threads that answer requests); more is 503 "
                                                                        "with Retry-After")
    upload_checks_per_tenant: int = Field(default=2, ge=1, le=256, description="one tenant's upload completions "
                                                                               "checked at once; more is 429 with "
                                                                               "Retry-After")
    upload_check_memory_bytes: int = Field(default=2 << 30, ge=256 << 20, description="address space the child "
                                                                                      "process checking an upload "
                                                                                      "may use (RLIMIT_AS); past it "
                                                                                      "the upload is 422")
    upload_check_cpu_s: int = Field(default=60, ge=1, le=3600, description="CPU seconds the child checking an upload "
                                                                           "may use at most, whatever it reads "
                                                                           "(RLIMIT_CPU); past it 422")
    # What one check may cost scales with what it reads (issue 41): a few KB may not buy a minute of CPU.
    upload_check_cpu_s_base: int = Field(
        default=5, ge=1, le=3600,
        description="CPU seconds of that child for an upload of a few bytes; plus UPLOAD_CHECK_CPU_S_PER_MIB per MiB "
                    "it reads, up to UPLOAD_CHECK_CPU_S")
    upload_check_cpu_s_per_mib: float = Field(
        default=2.0, ge=0, le=3600,
        description="CPU seconds added to UPLOAD_CHECK_CPU_S_BASE per MiB the check reads (a JSON file whole, a "
                    "header up to its limit)")
    upload_check_timeout_s: float = Field(default=120.0, gt=0, le=3600, description="wall-clock seconds a child "
                                                                                    "checking an upload may take; "
                                                                                    "then it is killed and the "
                                                                                    "upload is 422")
    tokenizer_memory_bytes: int = Field(default=TokenizerLimits.memory_bytes, ge=256 << 20,
                                        description="the worker tokenises text in a child process: address "
                                                    "space it may add to what it inherits, plus 32 bytes per "
                                                    "token asked (RLIMIT_AS); past it the job fails once, "
                                                    "naming the data")
    tokenizer_cpu_s: int = Field(default=TokenizerLimits.cpu_s, ge=1,
                                 description="CPU seconds of that child, plus TOKENIZER_CPU_S_PER_MTOKEN per "
                                             "million tokens asked (RLIMIT_CPU; twice it, wall clock)")
    tokenizer_cpu_s_per_mtoken: float = Field(default=TokenizerLimits.cpu_s_per_mtoken, ge=0,
                                              description="CPU seconds added to TOKENIZER_CPU_S per million "
                                                          "tokens a job tokenises")
    hub_models: str = Field(default="*", description="hub models a job may name: * (any), empty (none: hub ids are "
                                                     "422) or comma-separated owners and owner/name ids")
    hub_max_model_bytes: int = Field(default=48 << 30, ge=1 << 20,
                                     description="what a job fetches of one hub model (its safetensors, JSON and "
                                                 "tokenizer files, or its GGUF file), from the sizes the hub "
                                                 "lists before any download; more is a failed job naming it")
    hub_cache_max_bytes: int = Field(default=256 << 30, ge=1 << 20,
                                     description="the worker's hub model cache (huggingface_hub's) in all: before a "
                                                 "fetch, cached models unused for an hour are deleted, least "
                                                 "recently used first, to make room; a fetch that still does not "
                                                 "fit is a failed job naming it")
    hub_datasets: str = Field(default="*", description="hf: calibration datasets a job may name: * (any), empty "
                                                       "(none) or comma-separated owners and names")
    corpora: str = Field(default="auto", description="corpus:NAME sources a job may name: auto (those this API "
                                                     "process can read: right where the API and its workers share "
                                                     "a machine, as `dtp-layout serve` does) or the comma-separated "
                                                     "names the workers have (an API whose workers run elsewhere)")
    upload_part_bytes: int = Field(default=16 << 20, ge=5 << 20, le=1 << 30,
                                   description="the part size of uploads (PUT /v1/uploads/{id}/files/{path}/parts/{n}; "
                                               "every part but a file's last is this long; at least 5 MiB, S3's "
                                               "floor)")
    upload_max_bytes: int = Field(default=64 << 30, ge=1, description="the most bytes one upload may declare (all its "
                                                                      "files); more is 413")
    upload_part_timeout_s: float = Field(default=600.0, gt=0, le=86400, description="an upload part's body must arrive "
                                                                                   "within this (instead of "
                                                                                   "BODY_TIMEOUT_S); else 408")
    upload_max_files: int = Field(default=64, ge=1, le=256, description="the most files one upload may declare; "
                                                                        "more is 422 `files`")
    upload_max_open: int = Field(default=8, ge=1, le=10_000, description="a tenant's open (declared, not complete) "
                                                                         "uploads; one more is 429 `too_many_open_"
                                                                         "uploads` (complete or delete one)")
    upload_min_file_bytes: int = Field(default=4096, ge=0, le=1 << 30, description="a declared file counts at least "
                                                                                   "this many bytes against the "
                                                                                   "quota (an empty file still costs "
                                                                                   "a row, a multipart upload and a "
                                                                                   "store object)")
    upload_open_ttl_s: float = Field(default=86400.0, ge=60, le=30 * 86400, description="an upload still open this "
                                                                                       "long after it was declared "
                                                                                       "is removed by the workers' "
                                                                                       "sweeper (its parts, rows and "
                                                                                       "quota released)")
    storage_quota_bytes: int = Field(default=100 << 30, ge=0, description="bytes a tenant may keep in the store: its "
                                                                          "uploads (declared sizes, open ones too) "
                                                                          "and its jobs' artifacts; an upload past it "
                                                                          "is 429 (413 when it alone is larger), a "
                                                                          "job submitted at or past it is 429; 0: no "
                                                                          "quota")
    storage_quotas: str = Field(default="", description="per-tenant quotas over STORAGE_QUOTA_BYTES, comma-separated "
                                                        "TENANT=BYTES entries (0: no quota for that tenant)")
    retention_days: float = Field(default=0.0, ge=0, le=36500, description="finished jobs' artifacts are removed "
                                                                          "from the store this many days after the "
                                                                          "job finished, by the workers' sweeper "
                                                                          "(the job row, layouts and scores stay, "
                                                                          "marked expired); 0 keeps them forever")
    device: str = Field(default="auto", description="worker torch device: auto | cpu | cuda | cuda:N")
    worker_gpus: int = Field(default=1, ge=1, le=MAX_WORLD_SIZE,
                             description="GPUs a worker process owns (`dtp-layout worker --gpus-per-worker`; on a "
                                         "CPU worker: the gloo rank processes it may start); it takes the jobs whose "
                                         "distill.world_size is at most this (one Celery queue per world size)")
    max_world_size: int = Field(default=1, ge=1, le=MAX_WORLD_SIZE,
                                description="the largest distill.world_size a job may ask: the most GPUs any worker "
                                            "owns (DTP_LAYOUT_WORKER_GPUS); more is 422 at submit (it could never "
                                            "start)")
    max_memory: str = Field(default="", description="worker memory limit of a job that gives no max_memory (e.g. "
                                                    "16GiB; empty: none): a model that would not fit is streamed "
                                                    "layer by layer, a job that cannot fit even so is refused")
    cuda_memory_fraction: float | None = Field(
        default=None, gt=0, le=1, description="cap each worker's share of its GPU's memory (e.g. 0.5 for two "
                                              "workers on one GPU); a job that needs more fails with the sizes")
    visibility_timeout_s: int | None = Field(
        default=None, ge=10, description="Redis visibility timeout: a message a worker took and never "
                                         "acknowledged (it died, perhaps before claiming the job) is delivered "
                                         "again after it; default 2 × LEASE_S, at least 10 s (a redelivery of a "
                                         "running job's message is a no-op: the job is leased)")
    lease_s: float = Field(default=60.0, gt=0, description="a running job's lease, renewed every second by its "
                                                            "worker; once it expires the worker is presumed dead")
    max_attempts: int = Field(default=3, ge=1, description="runs of one job (worker deaths, stalls) before it is "
                                                           "failed (`gave up after N attempts: REASON`)")
    requeue_after_s: float = Field(default=300.0, gt=0, description="a job still queued this long after it was "
                                                                     "sent (no worker took it: a crash between insert "
                                                                     "and enqueue, message lost, broker purged, a "
                                                                     "claim that failed) is sent again by the "
                                                                     "workers' sweeper, every period until a worker "
                                                                     "takes it")
    stall_s: float = Field(default=1800.0, gt=0, description="a running job that reports no progress for this long "
                                                              "(e.g. a hung download, a stuck stage) stops renewing "
                                                              "its lease and is retried; after MAX_ATTEMPTS runs it "
                                                              "fails with `stalled in stage X for N s`")
    time_limit_s: float = Field(default=3600.0, gt=0, description="soft time limit of one run of a job: this, plus "
                                                                   "TIME_LIMIT_PER_MTOKEN_S per million work tokens, "
                                                                   "at most TIME_LIMIT_MAX_S; past it the job fails "
                                                                   "with the reason. The hard limit is 10% + "
                                                                   "TIME_LIMIT_GRACE_S more (the worker process is "
                                                                   "then killed and restarted)")
    time_limit_per_mtoken_s: float = Field(
        default=600.0, ge=0, description="seconds added to a job's time limit per million work tokens "
                                         "(app.core.services.budgets: every unit of work the spec asks for)")
    time_limit_max_s: float = Field(default=172800.0, gt=0, description="upper bound of a job's soft time limit "
                                                                        "(48 h)")
    time_limit_grace_s: float = Field(default=60.0, ge=0, description="the hard time limit is the soft one + 10% + "
                                                                      "this: a run that never reaches a check by "
                                                                      "then (stuck in native code) is failed and its "
                                                                      "worker process killed (`serve`, or the service "
                                                                      "manager, restarts it)")
    public_url: str = Field(default="", description="base URL of the links in responses (default: relative links)")
    api_threads: int = Field(default=16, ge=1, le=256, description="worker threads per API process for blocking "
                                                                   "work (database, files); its database pool "
                                                                   "holds as many connections")
    log_format: Literal["text", "json"] = Field(default="text", description="text (readable lines) or json (one "
                                                                            "object per line: request id, job id, "
                                                                            "tenant, stage), API and workers")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="level of this "
                                                                                                "project's loggers")
    access_log: bool = Field(default=True, description="one log line per HTTP request (with its X-Request-ID)")
    metrics_cache_s: float = Field(default=2.0, ge=0, le=300, description="/metrics reads the jobs table at most "
                                                                          "this often")

    @field_validator("corpora")
    @classmethod
    def _corpora(cls, value: str) -> str:
        from models.io.assets import CORPORA

        names = [n.strip() for n in value.split(",") if n.strip()]
        if value.strip().lower() not in ("", "auto") and any(n not in CORPORA for n in names):
            raise ValueError(f"DTP_LAYOUT_CORPORA must be auto or comma-separated names among {', '.join(CORPORA)}, "
                             f"got {value!r}")
        return value

    @field_validator("storage_quotas")
    @classmethod
    def _quotas(cls, value: str) -> str:
        quota_entries(value)
        return value

    @field_validator("storage_url")
    @classmethod
    def _storage_url(cls, value: str) -> str:
        """A malformed s3:// URL stops the process at start, naming the accepted form."""
        from app.core.storage.object_store import parse_url

        value = value.strip()
        if value:
            parse_url(value)
        return value
    @field_validator("max_memory")
    @classmethod
    def _max_memory(cls, value: str) -> str:
        if value.strip():
            from models.io.sizes import parse_size

            parse_size(value)  # a SizeError (a ValueError) names what is accepted
        return value.strip()

    def memory_limit(self, requested: str | None) -> int | None:
        """A job's memory limit in bytes: its own max_memory, else this setting, else None."""
        from models.io.sizes import parse_size

        text = requested or self.max_memory
        return parse_size(text) if text else None

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _case(cls, value: object, info: ValidationInfo) -> object:
        if not isinstance(value, str):
            return value
        return value.strip().lower() if info.field_name == "log_format" else value.strip().upper()

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        self.key_entries()  # a malformed DTP_LAYOUT_API_KEYS stops the process at start
        var = self.var_dir.expanduser().absolute()
        self.var_dir = var
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{embedded_broker_path(var, self.database_url)}"
        if not self.database_url:
            self.database_url = f"sqlite:///{var / 'dtp-layout.db'}"
        self.storage_root = (self.storage_root or var / "storage").expanduser().absolute()
        self.model_root = (self.model_root or var / "models").expanduser().absolute()
        self.data_root = (self.data_root or var / "data").expanduser().absolute()
        return self

    def gguf_limits(self) -> GGUFLimits:
        return GGUFLimits(max_metadata_bytes=self.gguf_max_metadata_bytes, max_array_items=self.gguf_max_array_items,
                          max_entries=self.gguf_max_entries, max_tensors=self.gguf_max_tensors,
                          max_metadata_items=self.gguf_max_metadata_items)

    def tokenizer_limits(self) -> TokenizerLimits:
        return TokenizerLimits(memory_bytes=self.tokenizer_memory_bytes, cpu_s=self.tokenizer_cpu_s,
                               cpu_s_per_mtoken=self.tokenizer_cpu_s_per_mtoken)

    def upload_check_limits(self) -> ChildLimits:
        return ChildLimits(memory_bytes=self.upload_check_memory_bytes, cpu_s=self.upload_check_cpu_s,
                           timeout_s=self.upload_check_timeout_s,
                           memory_setting="DTP_LAYOUT_UPLOAD_CHECK_MEMORY_BYTES",
                           cpu_setting="DTP_LAYOUT_UPLOAD_CHECK_CPU_S",
                           timeout_setting="DTP_LAYOUT_UPLOAD_CHECK_TIMEOUT_S", nice=10)

    def time_limits(self, work_tokens: int) -> tuple[float, float]:
        """(soft, hard) seconds for one run of a job of `work_tokens` (app.core.services.budgets.work_tokens)."""
        soft = min(self.time_limit_max_s, self.time_limit_s + self.time_limit_per_mtoken_s * work_tokens / 1e6)
        return soft, soft * 1.1 + self.time_limit_grace_s

    @property
    def redis_visibility_timeout_s(self) -> int:
        """VISIBILITY_TIMEOUT_S, or its default: twice the lease, so that a job whose worker died holding
        its message waits about as long as one whose worker died while running it."""
        if self.visibility_timeout_s is not None:
            return self.visibility_timeout_s
        return max(10, math.ceil(2 * self.lease_s))

    @property
    def storage(self) -> Path:
        assert self.storage_root is not None
        return self.storage_root

    @property
    def models_dir(self) -> Path:
        assert self.model_root is not None
        return self.model_root

    @property
    def data_dir(self) -> Path:
        assert self.data_root is not None
        return self.data_root

    def quota_of(self, tenant: str | None) -> int:
        """The tenant's storage quota in bytes (0: none): its STORAGE_QUOTAS entry, else STORAGE_QUOTA_BYTES."""
        return quota_entries(self.storage_quotas).get(tenant or "", self.storage_quota_bytes)

    def key_entries(self) -> list[tuple[str, str, bool, str]]:
        """(name, sha256 hex digest, admin, tenant) of every DTP_LAYOUT_API_KEYS entry. Raises ValueError
        for a malformed entry, or a plain key (only digests are accepted: a leaked settings file leaks no key)."""
        entries = []
        for item in filter(None, (part.strip() for part in self.api_keys.split(","))):
            name, *rest = item.split(":")
            if len(rest) < 2 or rest[0] != "sha256" or not KEY_NAME.fullmatch(name) \
                    or not re.fullmatch(r"[0-9a-f]{64}", rest[1]):
                raise ValueError(f"DTP_LAYOUT_API_KEYS entry {name + ':…'!r} is not NAME:sha256:HEX[:admin]"
                                 "[:tenant=TENANT] (plain keys are refused: only their sha256 digest goes in the "
                                 "settings; `dtp-layout keys create NAME --settings` prints an entry)")
            admin, tenant = False, name
            for flag in rest[2:]:
                if flag == "admin":
                    admin = True
                elif flag.startswith("tenant=") and KEY_NAME.fullmatch(flag[7:]):
                    tenant = flag[7:]
                else:
                    raise ValueError(f"DTP_LAYOUT_API_KEYS entry {name!r}: unknown flag {flag!r} (admin, tenant=NAME)")
            entries.append((name, rest[1], admin, tenant))
        return entries

    def worker_env(self) -> dict[str, str]:
        """Every setting as its DTP_LAYOUT_* environment variable, for a worker subprocess: derived from
        the fields, so a new setting reaches the workers with nothing to keep in step (unset ones, None,
        are left out: the worker's default is the same None)."""
        env = {}
        for name, value in self.model_dump(mode="json").items():
            if value is not None:
                env[f"{self.model_config.get('env_prefix', '')}{name.upper()}"] = _env_text(value)
        return env


def quota_entries(value: str) -> dict[str, int]:
    """DTP_LAYOUT_STORAGE_QUOTAS as tenant → bytes; ValueError naming a malformed entry."""
    quotas = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        tenant, _, number = item.partition("=")
        if not KEY_NAME.fullmatch(tenant.strip()) or not number.strip().isdigit():
            raise ValueError(f"DTP_LAYOUT_STORAGE_QUOTAS entry {item[:120]!r} is not TENANT=BYTES")
        quotas[tenant.strip()] = int(number.strip())
    return quotas


def _env_text(value: object) -> str:
    """A setting's value as pydantic-settings reads it back from the environment."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return repr(value)  # the shortest text that reads back as the same number
    return json.dumps(value)  # lists and dicts: pydantic-settings parses complex values as JSON


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def settings_for_var_dir(var_dir: str | Path | None) -> Settings:
    """The settings from the environment, with `--var-dir` (the commands' option) over them when given:
    `serve`, `worker` and `keys` read the same service this way."""
    return Settings(var_dir=Path(var_dir)) if var_dir else Settings()


def redacted_url(url: str) -> str:
    """A database or broker URL fit for a log line: the password masked."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("://", 1)[0] + "://…"


def embedded_broker_path(var_dir: Path, database_url: str) -> Path:
    """The embedded broker's file for a database: services with different databases never share a broker
    by accident (a worker would take the other's messages). The default database keeps VAR_DIR/broker.db."""
    if not database_url:
        return var_dir / "broker.db"
    if database_url.startswith("sqlite:///") and len(database_url) > len("sqlite:///"):
        db_file = Path(database_url[len("sqlite:///"):]).expanduser()
        db_file = db_file if db_file.is_absolute() else Path.cwd() / db_file
        if db_file == var_dir / "dtp-layout.db":
            return var_dir / "broker.db"
        return db_file.with_name(db_file.name + ".broker.db")
    digest = hashlib.sha256(redacted_url(database_url).encode()).hexdigest()[:12]
    return var_dir / f"broker-{digest}.db"
