"""A job's stage timeline, read off its events (what the dashboard draws as a Gantt bar).

The worker records `claimed`, `stage-start`, `stage-done`, `requeued` and a final `succeeded` /
`failed` / `cancelled` event in `job_events` (app/core/events.py); a stage interrupted by a dead
worker shows as an `interrupted` segment followed by the resumed attempt's segment. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from app.core.db import JobEvent
from app.core.jobstate import FINISHED

FINAL_EVENTS = FINISHED  # a run's last event is named after the status it leaves the job in


def _at(event: JobEvent) -> datetime | None:
    return None if event.at is None else event.at.replace(tzinfo=UTC)


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round(max(0.0, (end - start).total_seconds()), 3)


def stage_timeline(events: Sequence[JobEvent], *, status: str, created_at: datetime | None,
                   now: datetime | None = None) -> list[dict[str, Any]]:
    """One entry per time span: `queued` (waiting for a worker) and then each stage attempt, with
    `started_at`, `finished_at` (null while running), `seconds` (so far, while running) and `state`
    (`done`, `running`, `failed`, `cancelled`, `interrupted`)."""
    now = now or datetime.now(UTC)
    created = None if created_at is None else created_at.replace(tzinfo=UTC)
    entries: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None

    def close(at: datetime | None, state: str, seconds: float | None = None) -> None:
        nonlocal current
        if current is None:
            return
        current["finished_at"] = at
        current["state"] = state
        current["seconds"] = seconds if seconds is not None else _seconds(current["started_at"], at)
        current = None

    first_claim = next((_at(e) for e in events if e.kind == "claimed"), None)
    if created is not None:
        queued_until = first_claim or (None if status == "queued" else _at(events[-1]) if events else None)
        entries.append({"stage": "queued", "attempt": 0, "started_at": created, "finished_at": queued_until,
                        "seconds": _seconds(created, queued_until or now),
                        "state": "running" if status == "queued" else "done"})
    for event in events:
        kind, at = event.kind, _at(event)
        if kind == "stage-start":
            close(at, "interrupted")
            current = {"stage": str(event.stage), "attempt": int(event.attempt or 1),
                       "started_at": at, "finished_at": None, "seconds": None, "state": "running"}
            entries.append(current)
        elif kind == "stage-done" and current is not None and current["stage"] == event.stage:
            close(at, "done", event.seconds)
        elif kind in ("claimed", "requeued"):
            close(at, "interrupted")
        elif kind in FINAL_EVENTS:
            close(at, "done" if kind == "succeeded" else str(kind))
    if current is not None:
        if status == "running":
            current["seconds"] = _seconds(current["started_at"], now)
        else:
            close(None, "interrupted" if status == "queued" else status)
    return entries
