"""What a distillation job whose evaluation dwarfs its training costs: the answer at submit, the
worker's peak memory, and how long a cancel takes while it evaluates.

The spec is the hostile tenant's of issue 17 scaled down to run in seconds on the tiny test model
(tests/tiny.py): 2 training steps of one 16-token sequence, evaluated after every step on
`--eval-sequences` blocks of 16 tokens, all in one forward (`eval_batch_size` = the block count). At
full scale (65 536 blocks, 10 000 evaluations) the same shape asks for 10¹⁰ evaluation tokens.

    .venv/bin/python bench/job_cost.py [--eval-sequences 16384] [--cancel-after 1.0]

1. the submit check with the default budgets (422 and the limit it names, or accepted, and its
   work tokens), in ms;
2. the job run in this process with the budgets raised until it is accepted (SQLite, CPU): wall time
   and peak RSS (ru_maxrss) before and after the run;
3. the same job again, cancelled `--cancel-after` s into its distilling stage (in its evaluations):
   seconds from the cancel request to the job's `cancelled` event, from the job's own events.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.core.caller import OPEN
from app.core.db import Job, database
from app.core.errors import SpecError
from app.core.events import job_events
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import cancel_job, check_spec, submit_job
from tests.service_kit import CALIB, make_settings, provision, spec

EVAL_DATA = "eval/ids.npy"
SEQ_LEN = 16
RAISED = {"max_calibration_tokens": 1 << 30, "max_active_tokens": 1 << 62, "max_evaluations": 1 << 30,
          "max_eval_tokens": 1 << 62}


def hostile_spec(eval_sequences: int, steps: int = 2) -> dict[str, Any]:
    return spec(random_layouts=0, ablations=False, export=False, calibration={"sequences": 8, "seq_len": 32},
                distill={"layouts": ["optimised"], "seeds": [0], "steps": steps,
                         "train": {"source": CALIB, "seq_len": SEQ_LEN},
                         "eval": {"source": EVAL_DATA, "sequences": eval_sequences, "seq_len": SEQ_LEN},
                         "recipe": {"batch_size": 1, "micro_batch_size": 1, "eval_every": 1, "warmup_steps": 0,
                                    "eval_batch_size": min(eval_sequences, 65_536), "logit_chunk": 256}})


def settings_in(root: Path, eval_sequences: int, **overrides: Any) -> Any:
    from app.core.settings import Settings

    known = {k: v for k, v in overrides.items() if k in Settings.model_fields}  # an older tree has fewer
    settings = make_settings(root, device="cpu", **known)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    provision(settings)
    data = settings.data_dir / EVAL_DATA
    data.parent.mkdir(parents=True, exist_ok=True)
    np.save(data, np.random.default_rng(1).integers(0, 97, size=eval_sequences * SEQ_LEN))
    return settings


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def submit_answer(settings: Any, body: dict[str, Any]) -> str:
    from app.core.services.budgets import work_tokens

    parsed = JobSpec.model_validate(body)
    t0 = time.perf_counter()
    try:
        check_spec(settings=settings, spec=parsed)
        answer = f"accepted: {work_tokens(parsed):,} work tokens"
    except SpecError as exc:
        answer = "422 " + "; ".join(f"{field}: {msg}" for field, msg in exc.problems)
    return f"{answer} ({(time.perf_counter() - t0) * 1e3:.1f} ms)"


def submitted(settings: Any, body: dict[str, Any]) -> str:
    with database(settings.database_url).session() as session:
        return submit_job(session=session, settings=settings, spec=JobSpec.model_validate(body), caller=OPEN,
                          enqueue=lambda _jid: None).id


def event_time(session: Any, job: Job, kind: str) -> datetime:
    return next(e.at for e in job_events(session, job.id) if e.kind == kind)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-sequences", type=int, default=16_384)
    ap.add_argument("--cancel-after", type=float, default=1.0, help="seconds into distilling")
    args = ap.parse_args()
    from worker.jobs import run_job

    body = hostile_spec(args.eval_sequences)
    full = hostile_spec(65_536, steps=9_998)
    with tempfile.TemporaryDirectory() as tmp:
        settings = settings_in(Path(tmp) / "default", args.eval_sequences)
        print(f"full-scale spec (65 536 × 16 eval tokens, 10 000 evaluations): {submit_answer(settings, full)}")
        print(f"this spec ({args.eval_sequences} × 16 eval tokens, 3 evaluations): {submit_answer(settings, body)}")

        raised = settings_in(Path(tmp) / "raised", args.eval_sequences, **RAISED)
        job_id = submitted(raised, body)
        import torch  # noqa: F401  (imported before the baseline: it is not the job's memory)

        before = peak_rss_mib()
        t0 = time.perf_counter()
        result = run_job(job_id, settings=raised, db=database(raised.database_url), worker="bench:1")
        print(f"run: {result} in {time.perf_counter() - t0:.1f} s; peak RSS {before:.0f} MiB before the run, "
              f"{peak_rss_mib():.0f} MiB after")

        db = database(raised.database_url)
        job_id = submitted(raised, body)
        outcome: list[str] = []
        runner = threading.Thread(target=lambda: outcome.append(run_job(job_id, settings=raised, db=db,
                                                                        worker="bench:2")))
        runner.start()
        while True:
            with db.session() as session:
                job = session.get(Job, job_id)
                assert job is not None
                if job.stage == "distilling" or job.status in ("succeeded", "failed", "cancelled"):
                    break
            time.sleep(0.02)
        time.sleep(args.cancel_after)
        with db.session() as session:
            cancel_job(session=session, job_id=job_id, caller=OPEN)
        runner.join()
        with db.session() as session:
            job = session.get(Job, job_id)
            assert job is not None
            latency = (event_time(session, job, job.status)
                       - event_time(session, job, "cancel-requested")).total_seconds() \
                if job.status == "cancelled" else float("nan")
        print(f"cancel {args.cancel_after:g} s into distilling: {outcome[0]} in stage {job.stage}, "
              f"{latency:.2f} s after the request")


if __name__ == "__main__":
    main()
