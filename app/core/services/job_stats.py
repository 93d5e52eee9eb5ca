"""Aggregates over the `jobs` and `job_events` tables for /metrics: jobs per status, the age of the
oldest queued job, retries and requeues, and a histogram of stage durations. Read from the database at
scrape time, so they count what every worker and API process did, however many there are; aggregates
only (no job id, tenant or model leaves here). Three queries, each one pass over a table.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from app.core import events
from app.core.db import STAGES, STATUSES, Database, Job, utcnow

# Upper bounds (seconds) of the stage-duration buckets: a tiny model's stage takes under a second,
# a 7B model's affinity pass or distillation hours.
STAGE_BUCKETS = (0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0)


@dataclass
class StageHistogram:
    count: int = 0
    total: float = 0.0
    buckets: list[int] = field(default_factory=list)  # cumulative counts, one per STAGE_BUCKETS bound


@dataclass
class JobStats:
    by_status: dict[str, int]
    oldest_queued_age_s: float  # 0 when nothing is queued
    retries: int  # runs beyond each job's first (a worker died, a stalled attempt was retried, …)
    requeues: int  # `requeued` events of every job (sweeper re-enqueues and retried stalls)
    stages: dict[str, StageHistogram]


def _status_rows(session: Session, now: datetime) -> tuple[dict[str, int], float, int]:
    rows = session.execute(select(Job.status, func.count(), func.min(Job.created_at),
                                  func.coalesce(func.sum(case((Job.attempts > 1, Job.attempts - 1), else_=0)), 0))
                           .group_by(Job.status)).all()
    by_status = dict.fromkeys(STATUSES, 0)
    oldest = 0.0
    retries = 0
    for status, n, first, extra in rows:
        by_status[status] = int(n)
        retries += int(extra or 0)
        if status == "queued" and first is not None:
            first = first if isinstance(first, datetime) else datetime.fromisoformat(str(first))
            oldest = max(0.0, (now - first.replace(tzinfo=None)).total_seconds())
    return by_status, oldest, retries


def _stage_rows(session: Session) -> dict[str, StageHistogram]:
    columns = []
    for stage in STAGES:
        seconds = Job.timings[stage].as_float()
        columns += [func.count(seconds), func.coalesce(func.sum(seconds), 0.0)]
        columns += [func.count(case((seconds <= bound, 1))) for bound in STAGE_BUCKETS]
    row = session.execute(select(*columns)).one()
    width = 2 + len(STAGE_BUCKETS)
    out = {}
    for i, stage in enumerate(STAGES):
        values = row[i * width:(i + 1) * width]
        out[stage] = StageHistogram(count=int(values[0]), total=float(values[1] or 0.0),
                                    buckets=[int(v) for v in values[2:]])
    return out


def job_stats(*, db: Database) -> JobStats:
    now = utcnow()
    with db.session() as session:
        by_status, oldest, retries = _status_rows(session, now)
        stages = _stage_rows(session)
        requeues = events.count(session, events.REQUEUED)
    return JobStats(by_status=by_status, oldest_queued_age_s=oldest, retries=retries, requeues=requeues,
                    stages=stages)


class CachedStats:
    """`job_stats` recomputed at most every `max_age_s` seconds: /metrics needs no key, and a flood of
    scrapes must not become a flood of table scans."""

    def __init__(self, compute: Callable[[], JobStats], max_age_s: float) -> None:
        self.compute, self.max_age_s = compute, max_age_s
        self._lock = threading.Lock()
        self._value: JobStats | None = None
        self._at = -1e18

    def get(self) -> JobStats:
        with self._lock:
            now = time.monotonic()
            if self._value is None or now - self._at >= self.max_age_s:
                self._value = self.compute()
                self._at = now
            return self._value
