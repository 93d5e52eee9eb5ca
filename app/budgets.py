"""Work budgets: how much one job may ask for (422 past it) and how much one tenant may have in flight
(429 with Retry-After past it).

A job's work is counted in tokens: calibration `sequences × seq_len`, and for a distillation
`steps × batch_size × seq_len × layouts × seeds` training tokens. Per job, each is held under its
setting, and so are the data a job loads (training and evaluation blocks), the blocks it skips and
the number of evaluations (each writes four metric rows). Per tenant, the queued and running jobs
are held under DTP_LAYOUT_MAX_ACTIVE_JOBS and their work tokens together under
DTP_LAYOUT_MAX_ACTIVE_TOKENS: a submission past either is a 429, and succeeds once earlier jobs end.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from app.db import Job
from app.errors import TooManyRequests
from app.schemas import JobSpec
from app.settings import Settings

ACTIVE = ("queued", "running")
RETRY_ACTIVE_S = 30  # Retry-After when a tenant's active jobs are at the limit: jobs take minutes


def _distill_numbers(spec: JobSpec) -> dict[str, Any]:
    assert spec.distill is not None
    recipe = spec.distill.effective_recipe()
    train, evaluation = spec.distill.data_specs(spec.calibration)
    runs = len(spec.distill.layouts) * len(spec.distill.seeds)
    return {"recipe": recipe, "train": train, "eval": evaluation, "runs": runs,
            "training_tokens": recipe["steps"] * recipe["batch_size"] * train["seq_len"] * runs,
            "evaluations": runs * (recipe["steps"] // recipe["eval_every"] + 2)}


def work_tokens(spec: JobSpec) -> int:
    """Calibration tokens plus distillation training tokens."""
    tokens = spec.calibration.sequences * spec.calibration.seq_len
    if spec.distill is not None:
        tokens += _distill_numbers(spec)["training_tokens"]
    return tokens


def _over(field: str, what: str, value: int, limit: int, setting: str) -> tuple[str, str]:
    return field, f"{what} = {value:,} is over this server's budget of {limit:,} ({setting})"


def job_problems(spec: JobSpec, settings: Settings) -> list[tuple[str, str]]:
    """(field, message) for every per-job budget the spec exceeds."""
    cal = spec.calibration
    problems = []
    if cal.sequences * cal.seq_len > settings.max_calibration_tokens:
        problems.append(_over("calibration.sequences", "calibration sequences × seq_len", cal.sequences * cal.seq_len,
                              settings.max_calibration_tokens, "DTP_LAYOUT_MAX_CALIBRATION_TOKENS"))
    if cal.skip_blocks * cal.seq_len > settings.max_skip_tokens:
        problems.append(_over("calibration.skip_blocks", "skip_blocks × seq_len", cal.skip_blocks * cal.seq_len,
                              settings.max_skip_tokens, "DTP_LAYOUT_MAX_SKIP_TOKENS"))
    if spec.distill is None:
        return problems
    d = _distill_numbers(spec)
    if d["training_tokens"] > settings.max_distill_tokens:
        problems.append(_over("distill.steps", "distillation steps × batch_size × seq_len × layouts × seeds",
                              d["training_tokens"], settings.max_distill_tokens, "DTP_LAYOUT_MAX_DISTILL_TOKENS"))
    train, evaluation = d["train"], d["eval"]
    if train["sequences"] * train["seq_len"] > settings.max_distill_tokens:
        problems.append(_over("distill.train.sequences", "training blocks loaded (sequences × seq_len)",
                              train["sequences"] * train["seq_len"], settings.max_distill_tokens,
                              "DTP_LAYOUT_MAX_DISTILL_TOKENS"))
    if evaluation["sequences"] * evaluation["seq_len"] > settings.max_calibration_tokens:
        problems.append(_over("distill.eval.sequences", "evaluation blocks (sequences × seq_len)",
                              evaluation["sequences"] * evaluation["seq_len"], settings.max_calibration_tokens,
                              "DTP_LAYOUT_MAX_CALIBRATION_TOKENS"))
    for part, data in (("train", train), ("eval", evaluation)):
        if data["skip_blocks"] * data["seq_len"] > settings.max_skip_tokens:
            problems.append(_over(f"distill.{part}.skip_blocks", "skip_blocks × seq_len",
                                  data["skip_blocks"] * data["seq_len"], settings.max_skip_tokens,
                                  "DTP_LAYOUT_MAX_SKIP_TOKENS"))
    if d["evaluations"] > settings.max_evaluations:
        problems.append(_over("distill.recipe.eval_every", "evaluations (runs × (steps // eval_every + 2))",
                              d["evaluations"], settings.max_evaluations, "DTP_LAYOUT_MAX_EVALUATIONS"))
    return problems


def _stored_tokens(spec: dict[str, Any], settings: Settings) -> int:
    """The work tokens of a stored spec; one that no longer validates counts as the most a job may ask."""
    try:
        return work_tokens(JobSpec.model_validate(spec))
    except ValidationError:
        return settings.max_calibration_tokens + (settings.max_distill_tokens if spec.get("distill") else 0)


def check_capacity(session: Session, *, tenant: str | None, spec: JobSpec, settings: Settings) -> None:
    """429 when the tenant's active jobs, with this one, would pass either limit. Call it inside the
    transaction that inserts the job: on Postgres a per-tenant advisory lock serialises the check and
    the insert (SQLite transactions are serialised already)."""
    bind = session.get_bind()
    if bind.dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"dtp-layout:{tenant}"})
    owner = Job.owner.is_(None) if tenant is None else Job.owner == tenant
    active = session.scalars(select(Job.spec).where(owner, Job.status.in_(ACTIVE))).all()
    who = f"tenant {tenant!r}" if tenant is not None else "this server (open, no keys)"
    if len(active) >= settings.max_active_jobs:
        raise TooManyRequests(f"{who} has {len(active)} queued or running jobs, the most it may have "
                              f"(DTP_LAYOUT_MAX_ACTIVE_JOBS={settings.max_active_jobs}); retry when one finishes",
                              field="X-API-Key", retry_after_s=RETRY_ACTIVE_S, code="too_many_active_jobs")
    in_flight = sum(_stored_tokens(s, settings) for s in active)
    mine = work_tokens(spec)
    if in_flight + mine > settings.max_active_tokens:
        field = "distill.steps" if spec.distill is not None else "calibration.sequences"
        raise TooManyRequests(f"{who} has {in_flight:,} work tokens in queued or running jobs; with this job's "
                              f"{mine:,} that is over DTP_LAYOUT_MAX_ACTIVE_TOKENS={settings.max_active_tokens:,}: "
                              "retry when a job finishes, or ask for less", field=field, retry_after_s=RETRY_ACTIVE_S,
                              code="work_budget")
