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

from models.stages import STAGE_NAMES

JSONType = JSON().with_variant(JSONB(), "postgresql")
BigId = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER keys only

STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED = ("succeeded", "failed", "cancelled")
STAGES = STAGE_NAMES  # declared with the stages themselves (models.stages)


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
    delta: Mapped[int] = mapped_column(Integer)
    score: Mapped[str] = mapped_column(String(8))
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    stage: Mapped[str | None] = mapped_column(String(16))
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    eta_s: Mapped[float | None] = mapped_column(Float)
    stage_started_at: Mapped[datetime | None] = mapped_column(DateTime)
    stages_done: Mapped[list[str]] = mapped_column(JSONType, default=list)
    timings: Mapped[dict[str, float]] = mapped_column(JSONType, default=dict)
    history: Mapped[list[dict[str, Any]]] = mapped_column(JSONType, default=list)
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

    layouts: Mapped[list[LayoutRow]] = relationship(back_populates="job", cascade="all, delete-orphan",
                                                    passive_deletes=True)
    artifacts: Mapped[list[Artifact]] = relationship(back_populates="job", cascade="all, delete-orphan",
                                                     passive_deletes=True)


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
    up_fraction: Mapped[list[float]] = mapped_column(JSONType)
    down_fraction: Mapped[list[float]] = mapped_column(JSONType)
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
