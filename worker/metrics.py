"""The distillation's evaluations in the `metrics` table: read back from a run's metrics.csv and upserted, one
row per (job, layout, seed, step, name), in batches that stay under the databases' bind-parameter limits.
Torch-free."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from app.core.db import Metric, utcnow
from app.core.schemas.jobs import METRIC_NAMES


def read_metrics_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a distillation metrics.csv (layout, seed, step, kl, ppl, loss, lr); [] when absent."""
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except FileNotFoundError:
        return []


METRIC_BATCH = 1000  # rows per query: the IN lists and inserts stay far below the bind-parameter limits
# (SQLite 32766, Postgres 65535) however long the distillation


def upsert_metrics(session: Session, job_id: str, rows: list[dict[str, Any]]) -> None:
    """One `metrics` row per (job, layout, seed, step, name): an existing row is updated, a missing one
    inserted; empty and non-finite values (the loss at step 0) are not written. In batches of
    METRIC_BATCH rows, flushed one by one (same transaction)."""
    for i in range(0, len(rows), METRIC_BATCH):
        _upsert_metric_batch(session, job_id, rows[i:i + METRIC_BATCH])
        session.flush()


def _upsert_metric_batch(session: Session, job_id: str, rows: list[dict[str, Any]]) -> None:
    """Existing rows read back by key, then the new ones inserted and the changed ones updated, each
    as one executemany (no ORM object per row: a long distillation has hundreds of thousands)."""
    if not rows:
        return
    keyed = [(str(r["layout"]), int(r["seed"]), int(r["step"]), r) for r in rows]
    steps = [k[2] for k in keyed]  # a range, not a list of steps: few parameters, the unique index serves it
    query = select(Metric.id, Metric.layout, Metric.seed, Metric.step, Metric.name, Metric.value).where(
        Metric.job_id == job_id, Metric.layout.in_({k[0] for k in keyed}), Metric.seed.in_({k[1] for k in keyed}),
        Metric.step.between(min(steps), max(steps)))
    existing: dict[tuple[str | None, int, int, str], tuple[int | None, float]] = {
        (m.layout, m.seed, m.step, m.name): (m.id, m.value) for m in session.execute(query)}
    inserts: dict[tuple[str | None, int, int, str], dict[str, Any]] = {}
    updates: dict[int, float] = {}
    for layout, seed, step, row in keyed:
        for name in METRIC_NAMES:
            raw = row.get(name)
            if raw is None or raw == "":
                continue
            value = float(raw)
            if not math.isfinite(value):
                continue
            key = (layout, seed, step, name)
            have = existing.get(key)
            if have is None:
                inserts[key] = {"job_id": job_id, "layout": layout, "seed": seed, "step": step, "name": name,
                                "value": value, "created_at": utcnow()}
            elif have[0] is not None and have[1] != value:
                updates[have[0]] = value
    if inserts:
        session.execute(insert(Metric), list(inserts.values()))
    if updates:
        session.execute(update(Metric), [{"id": i, "value": v} for i, v in updates.items()])
