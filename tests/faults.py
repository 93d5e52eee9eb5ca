"""Fault injection for the tests: a worker whose stages are slow, or one stage that hangs, with no
trace of it in the production settings or code paths.

`Faults(stage_delay_s=…, hang_stage=…)`:
- stage_delay_s: the worker sleeps this long at each stage's start and between micro-batches (a job
  slow on purpose, deterministically: kill, cancel and soak tests);
- hang_stage: that stage hangs without progress: loading, calibration, optimising, exporting or
  distilling (its data loading) in work that still reaches a safe point every 50 ms (a stuck download
  between retries: a cancel stops it there, models.base.progress.check_stop), affinity where only the
  hard time limit can (stuck in native code);
- hang_store_upload: the worker's S3 uploads go multipart from 1 KiB on (boto3's managed transfer, as
  for a large shard) and every part hangs before it is sent (a botocore `before-send` hook): a worker
  killed then has begun a multipart upload it never completes;
- die_before_claim: a file path; the first worker process to reach a claim creates the file and
  SIGKILLs itself there, holding the job's message (the crash window between receiving a message and
  claiming its job); the processes after it claim as usual.

In this process: the `inject_faults` fixture (tests/conftest.py) patches `worker.jobs.JobRun` for the
test. In a worker subprocess: `WorkerProcess(…, faults=…)` / `ServeProcess(…, faults=…)` start it
with `faults.env()`: DTP_TEST_FAULTS and tests/faults_site on PYTHONPATH, whose sitecustomize patches
`worker.jobs` (and `worker.claiming`) the moment a process imports it (an API process never does).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENV = "DTP_TEST_FAULTS"
REPO = Path(__file__).resolve().parents[1]
SITE = Path(__file__).resolve().parent / "faults_site"


@dataclass(frozen=True)
class Faults:
    stage_delay_s: float = 0.0
    hang_stage: str = ""
    hang_store_upload: bool = False
    die_before_claim: str = ""

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """What a subprocess's environment needs (added to `base`, default os.environ) for these faults."""
        base = dict(os.environ if base is None else base)
        path = os.pathsep.join(filter(None, (str(SITE), str(REPO), base.get("PYTHONPATH"))))
        return {ENV: json.dumps(asdict(self)), "PYTHONPATH": path}

    @classmethod
    def from_env(cls) -> Faults | None:
        text = os.environ.get(ENV)
        return cls(**json.loads(text)) if text else None


def _hang() -> None:
    threading.Event().wait()


def _hang_between_safe_points() -> None:
    from models.base.progress import check_stop

    while True:
        time.sleep(0.05)
        check_stop()


def _hang_store_uploads() -> Callable[[], None]:
    from app.core.storage import s3 as object_store
    threshold, init = object_store.MULTIPART_THRESHOLD, object_store.S3Store.__init__

    def patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.client.meta.events.register("before-send.s3.UploadPart", lambda **_: _hang())

    object_store.MULTIPART_THRESHOLD = 1024
    object_store.S3Store.__init__ = patched_init  # type: ignore[method-assign]

    def undo() -> None:
        object_store.MULTIPART_THRESHOLD = threshold
        object_store.S3Store.__init__ = init  # type: ignore[method-assign]

    return undo


def install_claim_faults(faults: Faults) -> Callable[[], None]:
    """Patch `worker.claiming.claim` with the faults; returns what undoes it."""
    from worker import claiming
    original = claiming.claim

    def claim(*args: Any, **kwargs: Any) -> Any:
        if faults.die_before_claim:
            marker = Path(faults.die_before_claim)
            try:
                marker.touch(exist_ok=False)
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    claiming.claim = claim  # type: ignore[assignment]

    def undo() -> None:
        claiming.claim = original

    return undo


def install(faults: Faults) -> Callable[[], None]:
    """Patch `worker.jobs.JobRun` with the faults; returns what undoes it."""
    from worker.jobs import JobRun

    names = ("enter", "should_stop", "abandonable")
    originals: dict[str, Any] = {name: JobRun.__dict__[name] for name in names}

    def enter(self: JobRun, stage: str, **note: Any) -> None:
        if faults.stage_delay_s:  # every stage lasts a while
            time.sleep(faults.stage_delay_s)
        originals["enter"](self, stage, **note)

    def should_stop(self: JobRun) -> bool:
        if faults.stage_delay_s:
            time.sleep(faults.stage_delay_s)
        if faults.hang_stage and faults.hang_stage == self.stage:
            _hang()  # stuck where no check can interrupt
        return bool(originals["should_stop"](self))

    def abandonable(self: JobRun, fn: Callable[[], Any]) -> Any:
        if faults.hang_stage and faults.hang_stage == self.stage:
            return originals["abandonable"](self, _hang_between_safe_points)  # a download that never returns
        return originals["abandonable"](self, fn)

    for name, patched in (("enter", enter), ("should_stop", should_stop), ("abandonable", abandonable)):
        setattr(JobRun, name, patched)
    undo_store = _hang_store_uploads() if faults.hang_store_upload else (lambda: None)

    def undo() -> None:
        for name, original in originals.items():
            setattr(JobRun, name, original)
        undo_store()

    return undo
