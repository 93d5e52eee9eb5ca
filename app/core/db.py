"""SQLAlchemy 2 models and sessions. Postgres in production and CI, SQLite in the embedded default.

Times are naive UTC. The schema is created by the Alembic migrations in `migrations/`, never by
`create_all`, so that Postgres and SQLite run the same migration.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker
from sqlalchemy.sql.expression import FunctionElement

from app.core.jobstate import FINISHED, STAGES, STATUSES  # noqa: F401  (importable from here as before)
from models.schedules.grammar import MAX_SCHEDULE_CHARS, ScheduleError, parse_schedule

JSONType = JSON().with_variant(JSONB(), "postgresql")
# A JSON column whose Python None is SQL NULL (not the JSON `null`), so that `IS NULL` finds it.
NullableJSON = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
BigId = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER keys only



def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


class db_now(FunctionElement[datetime]):
    """The database server's clock as naive UTC, `seconds` ahead: leases and queue times are compared
    on one clock whatever the workers' clocks say. Postgres: clock_timestamp() (not the transaction's
    start); SQLite: strftime with milliseconds, in the text form SQLAlchemy stores DateTime in."""

    type = DateTime()
    inherit_cache = False  # `seconds` is rendered into the SQL text: never reuse a compiled statement

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = float(seconds)
        super().__init__()


@compiles(db_now, "postgresql")
def _db_now_pg(element: db_now, compiler: Any, **kw: Any) -> str:
    shift = f" + interval '{element.seconds!r} seconds'" if element.seconds else ""
    return f"((clock_timestamp() AT TIME ZONE 'UTC'){shift})"


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: Any, **kw: Any) -> str:
    shift = f", '{element.seconds:+.3f} seconds'" if element.seconds else ""
    return f"strftime('%Y-%m-%d %H:%M:%f', 'now'{shift})"


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_enqueued_at", "status", "enqueued_at"),)  # the queued sweeper

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)
    owner: Mapped[str | None] = mapped_column(String(100), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONType)
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    model_id: Mapped[str] = mapped_column(String(300), index=True)
    revision: Mapped[str | None] = mapped_column(String(128))
    devices: Mapped[int] = mapped_column(Integer)
    # The schedule the job runs, canonical (`dtp:1`, `pt:2`; migration 0008): what the filters compare.
    # δ is no column: `delta` reads it from the schedule (or, for a schedule without δ, from the spec).
    schedule: Mapped[str] = mapped_column(String(MAX_SCHEDULE_CHARS))
    score: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    stage: Mapped[str | None] = mapped_column(String(16))
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    eta_s: Mapped[float | None] = mapped_column(Float)
    stage_started_at: Mapped[datetime | None] = mapped_column(DateTime)
    stages_done: Mapped[list[str]] = mapped_column(JSONType, default=list)
    timings: Mapped[dict[str, float]] = mapped_column(JSONType, default=dict)
    error: Mapped[str | None] = mapped_column(Text)
    error_stage: Mapped[str | None] = mapped_column(String(16))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    affinity_cached: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime)  # by the database clock (db_now)
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime, default=utcnow)  # last sent to the broker
    requeues: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # sent again by a sweeper
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    # Set when the job's artifacts were removed from the store (migration 0006): by DELETE /v1/jobs/{id}
    # (`deleted`) or by the retention sweep (`retention`); the row, its layouts and scores stay.
    expired_at: Mapped[datetime | None] = mapped_column(DateTime)
    expired_reason: Mapped[str | None] = mapped_column(String(16))
    # The artifact bytes the job holds against its tenant's quota while queued or running (migration
    # 0007): estimated at submit, raised by the worker before it publishes more (app.core.services.usage).
    reserved_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")

    layouts: Mapped[list[LayoutRow]] = relationship(back_populates="job", cascade="all, delete-orphan",
                                                    passive_deletes=True)
    artifacts: Mapped[list[Artifact]] = relationship(back_populates="job", cascade="all, delete-orphan",
                                                     passive_deletes=True)

    @property
    def delta(self) -> int:
        """The δ of the job's layouts: a dtp schedule's δ; for the other schedules (which have none) the
        spec's `delta`, the δ the layouts were built for (1 where an old spec holds none readable)."""
        try:
            parsed = parse_schedule(self.schedule)
        except ScheduleError:
            parsed = None
        if parsed is not None and parsed.kind == "dtp":
            return parsed.delta
        delta = (self.spec or {}).get("delta") if isinstance(self.spec, dict) else None
        return delta if isinstance(delta, int) and not isinstance(delta, bool) else 1


class JobEvent(Base):
    """One thing that happened to a job (submitted, claimed, stage-start, stage-done, requeued,
    cancel-requested, succeeded, failed, cancelled), appended with an INSERT: the job's row is never
    rewritten to log. What is read back has a column (the device an attempt ran on, the request that
    submitted or cancelled the job, why it was requeued, a stage's seconds); the rest is `detail`.
    In order of `id` (migration 0005 moved the old `jobs.history` arrays here)."""

    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)  # naive UTC, the writer's clock
    kind: Mapped[str] = mapped_column(String(32))
    stage: Mapped[str | None] = mapped_column(String(32))
    attempt: Mapped[int | None] = mapped_column(Integer)
    device: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON)
    request_id: Mapped[str | None] = mapped_column(String(200))
    reason: Mapped[str | None] = mapped_column(Text)
    seconds: Mapped[float | None] = mapped_column(Float)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)

    def as_dict(self) -> dict[str, Any]:
        """The event as one flat dict, `event` its kind and `at` ISO 8601 with a Z (the shape the old
        `jobs.history` entries had; for logs, tests and benchmarks), without the columns left empty."""
        columns = {"stage": self.stage, "attempt": self.attempt, "device": self.device,
                   "request_id": self.request_id, "reason": self.reason, "seconds": self.seconds}
        return {"at": self.at.isoformat() + "Z", "event": self.kind, **(self.detail or {}),
                **{k: v for k, v in columns.items() if v is not None}}


class LayoutRow(Base):
    __tablename__ = "layouts"
    __table_args__ = (UniqueConstraint("job_id", "name", name="uq_layouts_job_name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    J: Mapped[float] = mapped_column(Float)
    random_expectation: Mapped[float] = mapped_column(Float)
    upper_bound: Mapped[float] = mapped_column(Float)
    upper_bound_exact: Mapped[bool] = mapped_column(Boolean, default=True)
    up_fraction: Mapped[list[float | None]] = mapped_column(JSONType)  # None: the schedule has no such edge
    down_fraction: Mapped[list[float | None]] = mapped_column(JSONType)
    kv_group_device: Mapped[list[list[int]]] = mapped_column(JSONType)
    neuron_device: Mapped[list[list[int]]] = mapped_column(JSONType)
    shape: Mapped[dict[str, Any]] = mapped_column(JSONType)
    score: Mapped[dict[str, Any] | None] = mapped_column(JSONType)

    job: Mapped[Job] = relationship(back_populates="layouts")


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "name", name="uq_artifacts_job_name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(32))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)

    job: Mapped[Job] = relationship(back_populates="artifacts")


class Metric(Base):
    """Per job, layout, seed and step: a named value (the distilling stage writes kl, ppl, loss, lr).

    One row per (job, layout, seed, step, name): a resumed run that evaluates a step again replaces
    the row (migration 0002 added `seed` and the unique constraint)."""

    __tablename__ = "metrics"
    __table_args__ = (UniqueConstraint("job_id", "layout", "seed", "step", "name",
                                       name="uq_metrics_job_layout_seed_step_name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    layout: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    step: Mapped[int] = mapped_column(Integer, default=0)
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Upload(Base):
    """A tenant's own model or data files (migration 0006): declared by POST /v1/uploads, sent file by
    file and part by part, `complete` once every file's sha256 matched. Its objects are in the store under
    `storage_prefix`; a job names it `upload:<id>`."""

    __tablename__ = "uploads"
    __table_args__ = (Index("ix_uploads_owner_status", "owner", "status"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner: Mapped[str | None] = mapped_column(String(100), index=True)
    kind: Mapped[str] = mapped_column(String(8))  # model | data
    name: Mapped[str] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(16), default="open")  # open | complete
    part_size: Mapped[int] = mapped_column(BigInteger)
    size: Mapped[int] = mapped_column(BigInteger)  # the declared bytes of every file
    # What it counts against the quota (migration 0007): each file at least DTP_LAYOUT_UPLOAD_MIN_FILE_BYTES.
    charged: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    completing_at: Mapped[datetime | None] = mapped_column(DateTime)  # one `complete` call at a time
    storage_prefix: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON)  # a model's config, checked at completion
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime)

    files: Mapped[list[UploadFile]] = relationship(back_populates="upload", cascade="all, delete-orphan",
                                                   passive_deletes=True, order_by="UploadFile.index")


class UploadFile(Base):
    """One declared file of an upload: its relative path, size and the sha256 the client sent; `multipart`
    the store's multipart upload while its parts arrive (None once assembled, or for a local store)."""

    __tablename__ = "upload_files"

    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(String(255))
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    multipart: Mapped[str | None] = mapped_column(String(1024))
    done: Mapped[bool] = mapped_column(Boolean, default=False)

    upload: Mapped[Upload] = relationship(back_populates="files")


class UploadPart(Base):
    """A part of an upload's file that arrived whole (its size checked, its sha256 computed while it
    streamed); `etag`: the store's tag for it (S3 multipart), when it has one."""

    __tablename__ = "upload_parts"

    upload_id: Mapped[str] = mapped_column(ForeignKey("uploads.id", ondelete="CASCADE"), primary_key=True)
    file_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    etag: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class DerivedData(Base):
    """Data made from a tenant's upload or job and kept for its later jobs (migration 0007): a converted
    model (`converted`), an affinity cache entry (`affinity`), under `prefix` in the store. Counted in
    its owner's usage; removed with the last upload or job that needs it (DerivedNeed)."""

    __tablename__ = "derived_data"
    __table_args__ = (UniqueConstraint("prefix", name="uq_derived_data_prefix"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    owner: Mapped[str | None] = mapped_column(String(100), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    prefix: Mapped[str] = mapped_column(String(300))
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class DerivedNeed(Base):
    """An upload or a job (`upload:<id>`, `job:<id>`) that keeps a DerivedData entry alive."""

    __tablename__ = "derived_needs"

    derived_id: Mapped[int] = mapped_column(ForeignKey("derived_data.id", ondelete="CASCADE"), primary_key=True)
    needer: Mapped[str] = mapped_column(String(40), primary_key=True, index=True)


class ApiKey(Base):
    """An API key by its sha256 digest (the key itself is shown once by `dtp-layout keys create` and
    never stored). Revoked keys keep their row, so a name is never reused and revoking the last key
    never reopens the API (migration 0003)."""

    __tablename__ = "api_keys"
    __table_args__ = (UniqueConstraint("name", name="uq_api_keys_name"),
                      UniqueConstraint("digest", name="uq_api_keys_digest"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100))
    tenant: Mapped[str] = mapped_column(String(100), index=True)
    digest: Mapped[str] = mapped_column(String(64))
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime)


WRITE = "dtp_layout_write"  # execution option: this connection's transactions will write


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """An engine. SQLite gets WAL, a busy timeout and foreign keys; its write transactions (sessions of
    `Database.transaction()` and `write_transaction`) begin IMMEDIATE, because two processes write the
    embedded database and a deferred transaction that later writes can fail at once with SQLITE_BUSY.
    Reads begin deferred: under WAL they never take the write lock, so a GET never waits behind a
    worker's write transaction.

    `pool_size`: the connections a process may hold at once; an API process holds one per worker thread
    (plus a few for the key table and /metrics), so that no thread ever waits for a connection."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               pool_size=pool_size, max_overflow=4)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # SQLAlchemy's begin event below issues BEGIN
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Any) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE) else "BEGIN")

        return engine
    # connect_timeout: a database host that does not answer is a 503 within seconds, not a hung request.
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=max(5, pool_size // 4),
                         pool_timeout=10, connect_args={"connect_timeout": 5} if url.startswith("postgresql") else {})


class Database:
    def __init__(self, url: str, *, pool_size: int = 5) -> None:
        self.url = url
        self.engine = make_engine(url, pool_size=pool_size)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(self.engine.execution_options(**{WRITE: True}), expire_on_commit=False)

    def session(self) -> Session:
        """A session for reading (on SQLite its transactions begin deferred: no write lock)."""
        return self._sessions()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A write transaction, committed at the end (on SQLite it holds the write lock throughout:
        keep slow work such as hashing out of it)."""
        with self._write_sessions() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


@contextmanager
def write_transaction(session: Session) -> Iterator[Session]:
    """`session.begin()` for a transaction that writes: on SQLite it begins IMMEDIATE (the write lock
    at once, waiting for it under the busy timeout) instead of failing at its first write."""
    with session.begin():
        session.connection(execution_options={WRITE: True})
        yield session


_databases: dict[str, Database] = {}


def database(url: str, *, pool_size: int = 5) -> Database:
    """One Database (engine and pool) per URL and process (`pool_size` applies when it is made)."""
    db = _databases.get(url)
    if db is None:
        db = _databases[url] = Database(url, pool_size=pool_size)
    return db
