"""A job's status names and stage names, each defined once (the stages are models/run/stage_names.py's, the
order a run takes). The database, the API's models, the client, /metrics and (through GET /v1/spec) the
dashboard all read them from here."""

from __future__ import annotations

from typing import Literal, get_args

from models.run.files import DISTILL_SUMMARY  # the artifact a distilling job's summary points to
from models.run.stage_names import STAGES, Stage

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
STATUSES: tuple[str, ...] = get_args(Status)
ACTIVE: tuple[str, ...] = ("queued", "running")  # a worker has it, or will: counted against budgets
FINISHED: tuple[str, ...] = tuple(s for s in STATUSES if s not in ACTIVE)

__all__ = ["ACTIVE", "DISTILL_SUMMARY", "FINISHED", "STAGES", "STATUSES", "Stage", "Status"]
