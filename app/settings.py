"""Service settings: one pydantic-settings class, every field from a `DTP_LAYOUT_*` environment variable.

The defaults are the embedded setup of `dtp-layout serve`: everything under `./var` (SQLite database,
a SQLite-backed Celery transport, artifacts, model and data roots), no other server needed.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DTP_LAYOUT_", extra="ignore")

    var_dir: Path = Field(default=Path("var"), description="base for the embedded defaults below")
    database_url: str = Field(default="", description="SQLAlchemy URL; default sqlite:///VAR_DIR/dtp-layout.db")
    broker_url: str = Field(default="", description="Celery broker; default sqla+sqlite:///VAR_DIR/broker.db")
    broker_key_prefix: str = Field(default="", description="Redis only: a prefix for every broker key")
    storage_root: Path | None = Field(default=None, description="artifacts and caches; default VAR_DIR/storage")
    model_root: Path | None = Field(default=None, description="models a job may name; default VAR_DIR/models")
    data_root: Path | None = Field(default=None, description="calibration files a job may name; default VAR_DIR/data")
    queue: str = Field(default="gpu", description="Celery queue the jobs go to")
    api_keys: str = Field(default="", description="name:key pairs, comma-separated; empty: the API is open")
    device: str = Field(default="auto", description="worker torch device: auto | cpu | cuda | cuda:N")
    cuda_memory_fraction: float | None = Field(
        default=None, gt=0, le=1, description="cap each worker's share of its GPU's memory (e.g. 0.5 for two "
                                              "workers on one GPU); a job that needs more fails with the sizes")
    visibility_timeout_s: int = Field(default=86400, ge=60,
                                      description="Redis visibility timeout, above the longest job")
    lease_s: float = Field(default=60.0, gt=0, description="a running job's lease; a worker silent for longer has died")
    max_attempts: int = Field(default=3, ge=1, description="runs of one job before it is failed")
    stage_delay_s: float = Field(default=0.0, ge=0, description="TEST ONLY: sleep between micro-batches")
    public_url: str = Field(default="", description="base URL printed in links (default: the request's)")

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        var = self.var_dir.expanduser().absolute()
        self.var_dir = var
        if not self.database_url:
            self.database_url = f"sqlite:///{var / 'dtp-layout.db'}"
        if not self.broker_url:
            self.broker_url = f"sqla+sqlite:///{var / 'broker.db'}"
        self.storage_root = (self.storage_root or var / "storage").expanduser().absolute()
        self.model_root = (self.model_root or var / "models").expanduser().absolute()
        self.data_root = (self.data_root or var / "data").expanduser().absolute()
        return self

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

    def api_key_table(self) -> dict[str, str]:
        """key → owner name. Raises ValueError for a malformed DTP_LAYOUT_API_KEYS."""
        table: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in self.api_keys.split(","))):
            name, sep, key = item.partition(":")
            if not sep or not name.strip() or not key.strip():
                raise ValueError("DTP_LAYOUT_API_KEYS must be comma-separated name:key pairs")
            table[key.strip()] = name.strip()
        return table

    def worker_env(self) -> dict[str, str]:
        """The settings as environment variables, for a worker subprocess."""
        env = {
            "DATABASE_URL": self.database_url,
            "BROKER_URL": self.broker_url,
            "BROKER_KEY_PREFIX": self.broker_key_prefix,
            "STORAGE_ROOT": str(self.storage),
            "MODEL_ROOT": str(self.models_dir),
            "DATA_ROOT": str(self.data_dir),
            "QUEUE": self.queue,
            "DEVICE": self.device,
            "VISIBILITY_TIMEOUT_S": str(self.visibility_timeout_s),
            "LEASE_S": str(self.lease_s),
            "MAX_ATTEMPTS": str(self.max_attempts),
            "STAGE_DELAY_S": str(self.stage_delay_s),
            "VAR_DIR": str(self.var_dir),
        }
        if self.cuda_memory_fraction is not None:
            env["CUDA_MEMORY_FRACTION"] = str(self.cuda_memory_fraction)
        return {f"DTP_LAYOUT_{k}": v for k, v in env.items()}


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
