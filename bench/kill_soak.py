"""Kill soak: jobs on a tiny model against Postgres + Redis, the worker SIGKILLed once in each.

One uninterrupted job first (the reference: its stage windows and its distillation curves). Then N
trials: a job is submitted, the worker is SIGKILLed at a random moment of it — trial i aims at
i mod 7 of: the claim (the worker dies holding the job's message, before claiming it: a fault of
tests/faults.py), loading, calibration, affinity, optimising, exporting, distilling (once the database
shows that stage, after a uniform part of its length in the reference run; distilling: up to its last
evaluation) — and a new worker is started, as a supervisor would. Every
trial must end with the job `succeeded` exactly once, one artifact set (one row per name, the files
on disk exactly the rows, every sha256 verified), the reference's layouts, and distillation curves
equal to the reference's within 1e-6. The affinity cache is emptied before each job so that every
stage runs. Prints the trials, the kills per stage (the stage the database showed at the kill) and
the time to recover (kill → the job claimed again by the new worker; kill → succeeded).

    .venv/bin/python bench/kill_soak.py [--trials 21] [--seed 0] [--stage-delay 0.15]

Postgres and Redis from DTP_LAYOUT_TEST_POSTGRES_URL / DTP_LAYOUT_TEST_REDIS_URL (default the local
servers); a database and a Redis key prefix of its own, dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import func, select

from app.core.caller import OPEN
from app.core.db import Artifact, Job, LayoutRow, Metric, database
from app.core.events import job_events
from app.core.jobstate import STAGES
from app.core.queue import JobQueue
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import submit_job
from app.core.settings import Settings
from app.core.storage.root import Storage, sha256_file
from tests.faults import Faults
from tests.service_kit import TINY_DISTILL, WorkerProcess, spec
from worker.sweeps.store import sweep_store

BODY = spec(random_layouts=0, ablations=False, export={"checkpoint": False, "shards": True}, distill=TINY_DISTILL)
TOLERANCE = 1e-6


@dataclass
class Trial:
    job_id: str
    target: str
    delay_s: float
    killed_in: str = ""
    reclaimed_s: float | None = None
    finished_s: float | None = None
    attempts: int = 0
    problems: list[str] = field(default_factory=list)


def _job(db: Any, job_id: str) -> Job:
    with db.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _wait(db: Any, job_id: str, until: Any, timeout: float, what: str) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(db, job_id)
        if until(job):
            return job
        time.sleep(0.02)
    raise TimeoutError(f"job {job_id}: not {what} after {timeout:g} s (status {job.status}, stage {job.stage})")


def _submit(settings: Settings, queue: JobQueue) -> str:
    shutil.rmtree(settings.storage / "affinity", ignore_errors=True)  # every stage runs
    with database(settings.database_url).session() as session:
        job = submit_job(session=session, settings=settings, spec=JobSpec.model_validate(BODY), caller=OPEN,
                         enqueue=queue.enqueue)
    return job.id


def _history(db: Any, job_id: str) -> list[dict[str, Any]]:
    """The job's events, oldest first, as flat dicts (`event`, `at`, `stage`, …)."""
    with db.session() as session:
        return [e.as_dict() for e in job_events(session, job_id)]


def _at(entry: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(entry["at"].rstrip("Z")).replace(tzinfo=UTC).timestamp()


def stage_windows(db: Any, job_id: str) -> dict[str, tuple[float, float]]:
    """Seconds after the loading stage started (a fresh worker imports torch first, for a time that
    varies) at which each stage started and finished, from the job's events."""
    history = _history(db, job_id)
    t0 = _loading_started(db, job_id)
    assert t0 is not None
    start = {e["stage"]: _at(e) - t0 for e in history if e["event"] == "stage-start"}
    done = {e["stage"]: _at(e) - t0 for e in history if e["event"] == "stage-done"}
    return {s: (start[s], done[s]) for s in STAGES if s in start and s in done}


def _reached(stage: str) -> Any:
    """The job shows `stage` or a later one, or has finished."""
    at = STAGES.index(stage)
    return lambda j: j.status not in ("queued", "running") or (j.stage in STAGES and STAGES.index(j.stage) >= at)


def _loading_started(db: Any, job_id: str) -> float | None:
    return next((_at(e) for e in _history(db, job_id) if e["event"] == "stage-start" and e["stage"] == "loading"),
                None)


def curves(db: Any, job_id: str) -> dict[tuple[str | None, int, int, str], float]:
    with db.session() as session:
        rows = session.execute(select(Metric.layout, Metric.seed, Metric.step, Metric.name, Metric.value)
                               .where(Metric.job_id == job_id)).all()
    return {(r.layout, r.seed, r.step, r.name): r.value for r in rows}


def layouts(db: Any, job_id: str) -> dict[str, float]:
    with db.session() as session:
        return {r.name: r.J for r in session.scalars(select(LayoutRow).where(LayoutRow.job_id == job_id))}


def verify(settings: Settings, job_id: str, reference: dict[str, Any], *, cache: bool = True) -> list[str]:
    """What is wrong with a finished trial's job ([] when nothing). cache=False: the affinity row is not
    checked (the soak empties the shared cache before each job; a later job rewrites the file)."""
    db = database(settings.database_url)
    job = _job(db, job_id)
    problems = []
    events = Counter(e["event"] for e in _history(db, job_id))
    if job.status != "succeeded" or events["succeeded"] != 1:
        problems.append(f"status {job.status}, {events['succeeded']} succeeded events ({job.error})")
    storage = Storage(settings.storage)
    with db.session() as session:
        rows = session.scalars(select(Artifact).where(Artifact.job_id == job_id)).all()
    names = [r.name for r in rows]
    if len(names) != len(set(names)) or sorted(names) != reference["artifacts"]:
        problems.append(f"artifacts {sorted(names)} (reference {reference['artifacts']})")
    for r in rows:
        if r.kind == "affinity" and not cache:
            continue
        path = storage.path(r.storage_key)
        if not path.is_file() or path.stat().st_size != r.size or sha256_file(path) != r.sha256:
            problems.append(f"artifact {r.name}: the file does not match its row")
    # Each attempt publishes under its own keys (artifacts/, artifacts-2/, …); a killed attempt's objects no
    # row lists are the store sweep's to remove: sweep, then the files left must be exactly the rows' keys.
    sweep_store(db, storage.objects, stale_s=0)
    on_disk = sorted(str(p.relative_to(storage.root)) for d in storage.job_dir(job_id).glob("artifacts*")
                     for p in d.rglob("*") if p.is_file())
    if on_disk != sorted(r.storage_key for r in rows):
        problems.append(f"files on disk {on_disk} are not the artifact rows")
    if layouts(db, job_id) != reference["layouts"]:
        problems.append("layouts differ from the reference run's")
    have, want = curves(db, job_id), reference["curves"]
    if have.keys() != want.keys():
        problems.append(f"metric rows: {len(have)} (reference {len(want)})")
    else:
        worst = max((abs(have[k] - want[k]) / max(1.0, abs(want[k])) for k in want), default=0.0)
        reference["worst"] = max(reference.get("worst", 0.0), worst)
        if worst > TOLERANCE:
            problems.append(f"curves differ from the reference by {worst:.3g} (relative)")
    return problems


PRE_CLAIM = "before-claim"  # the window between a worker taking a job's message and claiming the job
TARGETS = (PRE_CLAIM, *STAGES)


def run_soak(settings: Settings, *, trials: int, seed: int = 0, log_path: Path, targets: tuple[str, ...] = TARGETS,
             say: Any = print, stage_delay_s: float = 0.15) -> dict[str, Any]:
    """Runs the reference job and `trials` killed jobs, trial i aimed at targets[i mod len(targets)], on
    workers that sleep `stage_delay_s` per unit of work (tests/faults.py); returns the report (see the
    module doc)."""
    rng = random.Random(seed)
    db = database(settings.database_url)
    queue = JobQueue(settings)
    slow = Faults(stage_delay_s=stage_delay_s)
    worker = WorkerProcess(settings, log_path, name="soak0", faults=slow).start()
    results: list[Trial] = []
    restarts: list[float] = []
    try:
        ref_id = _submit(settings, queue)
        ref = _wait(db, ref_id, lambda j: j.status not in ("queued", "running"), 300, "finished")
        if ref.status != "succeeded":
            raise RuntimeError(f"the reference job {ref.status}: {ref.error}\n{worker.log()[-3000:]}")
        windows = stage_windows(db, ref_id)
        with db.session() as session:  # distilling: up to its last evaluation (the plot after it is slow cold)
            last_eval = session.scalar(select(func.max(Metric.created_at)).where(Metric.job_id == ref_id))
        if last_eval is not None and "distilling" in windows:
            t0 = _loading_started(db, ref_id) or 0.0
            windows["distilling"] = (windows["distilling"][0], last_eval.replace(tzinfo=UTC).timestamp() - t0)
        with db.session() as session:
            ref_artifacts = sorted(session.scalars(select(Artifact.name).where(Artifact.job_id == ref_id)))
        reference: dict[str, Any] = {"curves": curves(db, ref_id), "layouts": layouts(db, ref_id),
                                     "artifacts": ref_artifacts}
        say(f"reference job {ref_id}: {sum(b - a for a, b in windows.values()):.1f} s of stages; windows (s "
            f"after loading started): " + ", ".join(f"{s} {a:.2f}-{b:.2f}" for s, (a, b) in windows.items()))

        for i in range(trials):
            target = targets[i % len(targets)]
            if target == PRE_CLAIM:
                # A worker that kills itself at its next claim, holding the message; the job stays unclaimed.
                worker.stop()
                dying = Faults(stage_delay_s=stage_delay_s, die_before_claim=str(log_path.parent / f"claim-{i}"))
                worker = WorkerProcess(settings, log_path, name=f"soak{i}-claim", faults=dying).start()
                job_id = _submit(settings, queue)
                trial = Trial(job_id=job_id, target=target, delay_s=0.0)
                assert worker.proc is not None
                worker.proc.wait(timeout=120)
                t_kill = time.time()
                now = _job(db, job_id)
                trial.killed_in = PRE_CLAIM if now.status == "queued" and now.attempts == 0 else f"after {now.status}"
            else:
                lo, hi = windows[target]
                delay = rng.uniform(0.0, 0.8 * (hi - lo))
                job_id = _submit(settings, queue)
                trial = Trial(job_id=job_id, target=target, delay_s=delay)
                # Wait for the target stage (or anything past it) to show, then a uniform part of its length.
                _wait(db, job_id, _reached(target), 120, target)
                time.sleep(delay)
                now = _job(db, job_id)
                trial.killed_in = (now.stage or "?") if now.status == "running" else f"after {now.status}"
                t_kill = time.time()
                worker.kill9()
            t0 = time.monotonic()
            worker = WorkerProcess(settings, log_path, name=f"soak{i + 1}", faults=slow).start()
            restarts.append(time.monotonic() - t0)
            done = _wait(db, job_id, lambda j: j.status not in ("queued", "running"), 300, "finished")
            history = _history(db, job_id)
            claims = [_at(e) for e in history if e["event"] == "claimed"]
            later = [t for t in claims if t > t_kill]
            trial.reclaimed_s = later[0] - t_kill if later else None
            if done.status == "succeeded" and not trial.killed_in.startswith("after"):
                trial.finished_s = _at(next(e for e in reversed(history) if e["event"] == "succeeded")) - t_kill
            trial.attempts = done.attempts
            trial.problems = verify(settings, job_id, reference)
            results.append(trial)
            say(f"trial {i + 1:2d}/{trials}: aimed at {target:12s} (+{trial.delay_s:5.2f} s) "
                f"killed in {trial.killed_in:12s} attempts {trial.attempts}  "
                f"reclaimed after {_fmt(trial.reclaimed_s)}  succeeded after "
                f"{_fmt(trial.finished_s)}  {'ok' if not trial.problems else '; '.join(trial.problems)}")
        time.sleep(max(2.0, settings.lease_s * 1.5))  # nothing runs any job again
        for trial in results:
            trial.problems += [p for p in verify(settings, trial.job_id, reference, cache=False)
                               if p not in trial.problems]
    finally:
        worker.stop()
    reclaimed = [t.reclaimed_s for t in results if t.reclaimed_s is not None]
    finished = [t.finished_s for t in results if t.finished_s is not None]
    return {
        "trials": len(results),
        "ok": sum(1 for t in results if not t.problems),
        "kills_per_stage": dict(Counter(t.killed_in for t in results)),
        "worker_restart_s": _stats(restarts),
        "reclaimed_after_kill_s": _stats(reclaimed),
        "succeeded_after_kill_s": _stats(finished),
        "worst_curve_difference": reference.get("worst", 0.0),
        "problems": {t.job_id: t.problems for t in results if t.problems},
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:5.1f} s"


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"mean": round(statistics.fmean(values), 2), "median": round(statistics.median(values), 2),
            "max": round(max(values), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=21)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stage-delay", type=float, default=0.15,
                    help="the workers sleep this long per micro-batch / step and at each stage's start, so "
                         "that stages last a while")
    ap.add_argument("--lease", type=float, default=2.0, help="DTP_LAYOUT_LEASE_S (default 2 s)")
    args = ap.parse_args()

    import psycopg
    import redis
    from sqlalchemy.engine import make_url

    from app.core.migrate import upgrade
    from tests.service_kit import provision

    admin = os.environ.get("DTP_LAYOUT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    redis_url = os.environ.get("DTP_LAYOUT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    name = f"dtp_soak_{uuid.uuid4().hex[:10]}"
    prefix = f"dtp-soak-{uuid.uuid4().hex[:10]}:"
    conn = psycopg.connect(make_url(admin).set(drivername="postgresql").render_as_string(hide_password=False),
                           autocommit=True)
    conn.execute(f'CREATE DATABASE "{name}"')
    root = Path(tempfile.mkdtemp(prefix="dtp-soak-"))
    try:
        url = make_url(admin).set(database=name).render_as_string(hide_password=False)
        upgrade(url)
        settings = Settings(var_dir=root, database_url=url, broker_url=redis_url, broker_key_prefix=prefix,
                            device="cpu", lease_s=args.lease)
        provision(settings)
        t0 = time.monotonic()
        report = run_soak(settings, trials=args.trials, seed=args.seed, log_path=root / "workers.log",
                          stage_delay_s=args.stage_delay)
        report["wall_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(report, indent=1))
        return 0 if report["ok"] == report["trials"] else 1
    finally:
        database(url).dispose()
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
