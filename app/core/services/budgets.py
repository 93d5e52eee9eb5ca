"""Work budgets: how much one job may ask for (422 past it) and how much one tenant may have in flight
(429 with Retry-After past it).

Every unit of work a spec can ask for is counted at submit, in work tokens (`job_work`):

- calibration: `sequences × seq_len` (the affinity pass), twice with `stability` (one more pass, over
  the two halves of the blocks);
- distillation training: `steps × batch_size × seq_len × layouts × seeds`;
- distillation evaluation: `(runs × evaluations per run + 1) × eval sequences × eval seq_len`, every
  evaluation of every run (at step 0, every eval_every and the last) and the dense model's once;
- the training probe (`probe` > 0, models/probe): its candidates' training (`candidates × probe_steps × 4 ×
  calibration seq_len`) and evaluation tokens, and each candidate's optimiser starts (1 + restarts);
- layout work: each optimiser start (the optimised layout and each ablation, 1 + restarts each; with
  `stability` the optimised layout of each half too) charged as LAYOUT_START_TOKENS and each layout
  scored (random, contiguous, …; with `stability` each half's layout on each half) as LAYOUT_SCORE_TOKENS.

Per job, each part is held under its setting, and so are the data a job loads (training and
evaluation blocks), the blocks it skips and the number of evaluations (each writes four metric
rows); the job's whole count under DTP_LAYOUT_MAX_ACTIVE_TOKENS (a job past it could never start).
Per tenant, the queued and running jobs are held under DTP_LAYOUT_MAX_ACTIVE_JOBS and their work
tokens together under DTP_LAYOUT_MAX_ACTIVE_TOKENS: a submission past either is a 429, and succeeds
once earlier jobs end. The worker's time limit grows with the same count (Settings.time_limits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from app.core.db import Job
from app.core.errors import TooManyRequests
from app.core.jobstate import ACTIVE
from app.core.schemas.jobs import JobSpec
from app.core.settings import Settings
from models.distill.recipe import DistillRecipe
from models.probe.spec import probe_of
from models.variants.set import Variant, ablation_variants, restarts_used

RETRY_ACTIVE_S = 30  # Retry-After when a tenant's active jobs are at the limit: jobs take minutes
# Layout work in work tokens, at the time limit's default pace (600 s per million: 0.6 ms a token).
# One optimiser start measured 0.14 s on Qwen3-0.6B's shape (N=28, G=8, I=3072, L=4), 0.86 s at
# N=48, I=13 824, L=4 and 10 s at N=40, I=27 648, L=8 (2 shared CPU cores): 16 384 tokens is ~10 s.
# Scoring a layout in both units, bounds included, took at most 0.31 s: 1024 tokens is ~0.6 s.
LAYOUT_START_TOKENS = 1 << 14
LAYOUT_SCORE_TOKENS = 1 << 10


@dataclass(frozen=True)
class JobWork:
    """What one job asks the worker to do; `tokens` is its work-token count."""

    calibration: int  # calibration sequences × seq_len (twice with stability)
    training: int  # steps × batch_size × seq_len × runs
    evaluation: int  # (evaluations + 1) × eval sequences × eval seq_len
    optimiser_starts: int
    layouts_scored: int
    runs: int = 0  # (layout, seed) pairs distilled
    evaluations: int = 0  # over all runs
    probe: int = 0  # the training probe's training and evaluation tokens

    @property
    def layouts(self) -> int:
        return self.optimiser_starts * LAYOUT_START_TOKENS + self.layouts_scored * LAYOUT_SCORE_TOKENS

    @property
    def tokens(self) -> int:
        return self.calibration + self.training + self.evaluation + self.probe + self.layouts

    def parts(self) -> dict[str, int]:
        """Work tokens per part, with the spec field that asks for most of each."""
        return {"calibration.sequences": self.calibration, "distill.steps": self.training,
                "distill.eval.sequences": self.evaluation, "probe_steps": self.probe, "restarts": self.layouts}

    def largest_field(self) -> str:
        parts = self.parts()
        return max(parts, key=lambda field: parts[field])

    def describe(self) -> str:
        return (f"calibration {self.calibration:,} + distillation training {self.training:,} + evaluation "
                f"{self.evaluation:,} + training probe {self.probe:,} + layout work {self.layouts:,} "
                f"({self.optimiser_starts} optimiser starts × "
                f"{LAYOUT_START_TOKENS:,} + {self.layouts_scored} layouts scored × {LAYOUT_SCORE_TOKENS:,})")


def _distill_numbers(spec: JobSpec) -> dict[str, Any]:
    assert spec.distill is not None
    recipe = spec.distill.effective_recipe()
    train, evaluation = spec.distill.data_specs(spec.calibration)
    runs = len(spec.distill.layouts) * len(spec.distill.seeds)
    evaluations = runs * DistillRecipe.from_dict(spec.distill.recipe_fields()).evaluations()
    return {"recipe": recipe, "train": train, "eval": evaluation, "runs": runs,
            "training_tokens": recipe["steps"] * recipe["batch_size"] * train["seq_len"] * runs,
            "evaluations": evaluations,
            "eval_tokens": (evaluations + 1) * evaluation["sequences"] * evaluation["seq_len"]}


def job_work(spec: JobSpec) -> JobWork:
    """Every unit of work the spec asks for (see the module's docstring)."""
    # As models.variants.set.build_layouts: each optimised variant starts 1 + restarts_used times.
    variants = [Variant("optimised"), *(ablation_variants(spec.score, spec.restarts) if spec.ablations else [])]
    starts = sum(1 + restarts_used(v, spec.restarts) for v in variants)
    calibration, scored = spec.calibration.sequences * spec.calibration.seq_len, len(spec.layout_names())
    if spec.stability:  # models.variants.stability: a pass over the two halves, each half optimised and cross-scored
        calibration, starts, scored = 2 * calibration, starts + 2 * (1 + spec.restarts), scored + 4
    probe = probe_of(spec)
    probe_tokens = 0
    if probe is not None:  # models.probe.candidates: up to K optimised candidates, each scored
        probe_tokens = probe.cost(spec.calibration.seq_len).tokens
        starts, scored = starts + probe.candidates * (1 + max(spec.restarts, 1)), scored + probe.candidates
    work = JobWork(calibration=calibration, training=0, evaluation=0, optimiser_starts=starts, layouts_scored=scored,
                   probe=probe_tokens)
    if spec.distill is None:
        return work
    d = _distill_numbers(spec)
    return JobWork(calibration=work.calibration, training=d["training_tokens"], evaluation=d["eval_tokens"],
                   optimiser_starts=starts, layouts_scored=work.layouts_scored, runs=d["runs"],
                   evaluations=d["evaluations"], probe=probe_tokens)


def work_tokens(spec: JobSpec) -> int:
    """The job's work tokens: every part of `job_work`."""
    return job_work(spec).tokens


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
    problems += _probe_problems(spec, settings)
    work = job_work(spec)
    if work.tokens > settings.max_active_tokens:  # no tenant may hold this much: waiting cannot help
        problems.append((work.largest_field(), f"this job's work tokens ({work.describe()}) = {work.tokens:,} are "
                                               f"over DTP_LAYOUT_MAX_ACTIVE_TOKENS={settings.max_active_tokens:,}, "
                                               "the most a tenant may have in flight: it could never start"))
    if spec.distill is None:
        return problems
    if spec.distill.world_size > settings.max_world_size:  # no worker owns that many GPUs: it could never start
        problems.append(("distill.world_size", f"distill.world_size = {spec.distill.world_size} is over the most "
                         f"GPUs any worker of this server owns, {settings.max_world_size} (DTP_LAYOUT_MAX_WORLD_SIZE)"))
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
    elif d["eval_tokens"] > settings.max_eval_tokens:
        problems.append(_over("distill.eval.sequences",
                              f"evaluation tokens ((runs × evaluations per run + 1) × sequences × seq_len: "
                              f"({d['evaluations']:,} + 1) × {evaluation['sequences']:,} × {evaluation['seq_len']:,})",
                              d["eval_tokens"], settings.max_eval_tokens, "DTP_LAYOUT_MAX_EVAL_TOKENS"))
    for part, data in (("train", train), ("eval", evaluation)):
        if data["skip_blocks"] * data["seq_len"] > settings.max_skip_tokens:
            problems.append(_over(f"distill.{part}.skip_blocks", "skip_blocks × seq_len",
                                  data["skip_blocks"] * data["seq_len"], settings.max_skip_tokens,
                                  "DTP_LAYOUT_MAX_SKIP_TOKENS"))
    if d["evaluations"] > settings.max_evaluations:
        problems.append(_over("distill.recipe.eval_every", "evaluations (runs × evaluations per run: step 0, every "
                              "eval_every and the last)", d["evaluations"], settings.max_evaluations,
                              "DTP_LAYOUT_MAX_EVALUATIONS"))
    return problems


def _probe_problems(spec: JobSpec, settings: Settings) -> list[tuple[str, str]]:
    """The training probe under the distillation's budgets: its training tokens under DTP_LAYOUT_MAX_DISTILL_TOKENS,
    its held-out blocks under DTP_LAYOUT_MAX_CALIBRATION_TOKENS (as a distillation's evaluation blocks)."""
    probe = probe_of(spec)
    if probe is None:
        return []
    cost, problems = probe.cost(spec.calibration.seq_len), []
    if cost.training_tokens > settings.max_distill_tokens:
        problems.append(_over("probe_steps", "the probe's training tokens (probe × probe_steps × 4 × calibration "
                              "seq_len)", cost.training_tokens, settings.max_distill_tokens,
                              "DTP_LAYOUT_MAX_DISTILL_TOKENS"))
    held_out = cost.eval_sequences * cost.seq_len
    if held_out > settings.max_calibration_tokens:
        problems.append(_over("probe_eval_sequences", "the probe's held-out blocks (probe_eval_sequences × "
                              "calibration seq_len)", held_out, settings.max_calibration_tokens,
                              "DTP_LAYOUT_MAX_CALIBRATION_TOKENS"))
    return problems


def _stored_tokens(spec: dict[str, Any], settings: Settings) -> int:
    """The work tokens of a stored spec; one that no longer validates counts as the most a job may ask
    (its worker fails it at its next run, which frees the place)."""
    try:
        return work_tokens(JobSpec.model_validate(spec))
    except ValidationError:
        return settings.max_active_tokens


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
    work = job_work(spec)
    if in_flight + work.tokens > settings.max_active_tokens:
        raise TooManyRequests(f"{who} has {in_flight:,} work tokens in queued or running jobs; with this job's "
                              f"{work.tokens:,} ({work.describe()}) that is over DTP_LAYOUT_MAX_ACTIVE_TOKENS="
                              f"{settings.max_active_tokens:,}: retry when a job finishes, or ask for less",
                              field=work.largest_field(), retry_after_s=RETRY_ACTIVE_S, code="work_budget")
