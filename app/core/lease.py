"""A worker's hold on a job: the lease and the fence, written once.

A run holds a job while the row says so: the same worker, still `running`, still at the run's attempt.
`attempts` is the fence: each claim increments it, so a worker presumed dead (its lease expired, the
job claimed again, perhaps by a process of the same name) finds its attempt superseded and every
write it tries (stage rows, layouts, artifacts, metrics, the affinity cache, the lease itself) is
refused in the same transaction that would have made it. Leases are compared on the database clock
(`db_now`), so workers whose clocks disagree still agree on which lease expired. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, or_, update
from sqlalchemy.orm import Session

from app.core.db import Job, db_now, utcnow


class LeaseLost(RuntimeError):
    """Another worker took the job over (this one was presumed dead): stop without writing."""


def claimable() -> tuple[ColumnElement[bool], ...]:
    """A job a worker may take: queued, or running with no live lease (its worker presumed dead)."""
    return (Job.status.in_(("queued", "running")), or_(Job.lease_until.is_(None), Job.lease_until < db_now()))


@dataclass(frozen=True)
class Lease:
    """`worker` holds job `job_id` at `attempt` (the value of `attempts` its claim set)."""

    job_id: str
    worker: str
    attempt: int

    @classmethod
    def claim(cls, session: Session, job_id: str, *, worker: str, lease_s: float) -> Lease | None:
        """Atomically take the job if it is claimable (one guarded UPDATE: of several workers that get
        the same message exactly one wins); None when there is nothing to take."""
        result = session.execute(
            update(Job).where(Job.id == job_id, *claimable())
            .values(status="running", worker=worker, lease_until=db_now(lease_s), attempts=Job.attempts + 1,
                    updated_at=utcnow())
            .returning(Job.attempts)
            .execution_options(synchronize_session=False))
        attempt = result.scalar_one_or_none()
        return None if attempt is None else cls(job_id, worker, int(attempt))

    def holds(self) -> tuple[ColumnElement[bool], ...]:
        """The condition, as SQL, that this lease still holds the job's row."""
        return (Job.id == self.job_id, Job.worker == self.worker, Job.status == "running",
                Job.attempts == self.attempt)

    def held(self, session: Session) -> Job | None:
        """The job's row, locked for this transaction, if this lease still holds it; else None."""
        job = session.get(Job, self.job_id, with_for_update=True, populate_existing=True)
        if job is None or job.worker != self.worker or job.status != "running" or job.attempts != self.attempt:
            return None
        return job

    def fence(self, session: Session) -> Job:
        """`held`, or LeaseLost: what every write of a run checks first, in the transaction it writes in."""
        job = self.held(session)
        if job is None:
            raise LeaseLost(f"job {self.job_id}: attempt {self.attempt} of {self.worker} no longer holds it")
        return job

    def renew(self, session: Session, lease_s: float, **values: Any) -> bool:
        """Extend the lease by `lease_s` on the database clock (and write `values` with it) if still held."""
        result = session.execute(
            update(Job).where(*self.holds())
            .values(lease_until=db_now(lease_s), updated_at=utcnow(), **values)
            .execution_options(synchronize_session=False))
        return bool(result.rowcount == 1)  # type: ignore[attr-defined]
