"""What a cancelled job leaves running (issue 41): its work measured after the cancel, in this process.

    .venv/bin/python bench/cancel_work.py [--cancel-after 1.5] [--observe 10]

Two jobs, each run in this process by `worker.entry.run_job` (SQLite, CPU, a fresh STORAGE_ROOT: no
converted copy to reuse) and cancelled `--cancel-after` s into a stage whose work does not poll for a
cancel:

1. `loading` of the packaged SmolLM2-135M GGUF (its dequantisation into the converted copy);
2. `calibration` with a tokenizer whose pre-tokenizer splits on `b*b*\\d`, over lines of 2,000 `b`s
   (minutes of CPU per chunk, in the sandbox's child process).

For each: seconds from the cancel request to the job's `cancelled` event (from the job's events); to
the stage's thread gone (`loading-<job>` / `calibration-<job>`); to the tokenizer's child process gone;
then, for `--observe` s after the job ended, the CPU this process (and its children) used, in cores,
and its resident memory against before the job. Each figure on this machine's shared cores: what
stands for anything is whether the work went on, not the exact seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.core.caller import OPEN
from app.core.db import Job, database
from app.core.events import job_events
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import cancel_job, submit_job
from tests.service_kit import make_settings, provision, spec


def cpu_seconds() -> float:
    """CPU seconds of this process and its children, the living ones included."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    alive = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            alive += sum(child.cpu_times()[:2])
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + alive


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def run_cancelled(settings: Any, body: dict[str, Any], stage: str, *, cancel_after: float,
                  observe: float) -> dict[str, Any]:
    from worker.entry import run_job

    db = database(settings.database_url)
    with db.session() as session:
        job_id = submit_job(session=session, settings=settings, spec=JobSpec.model_validate(body), caller=OPEN,
                            enqueue=lambda _jid: None).id
    rss_before = rss_mib()
    runner = threading.Thread(target=run_job, args=(job_id,),
                              kwargs={"settings": settings, "db": db, "worker": "bench:1"}, daemon=True)
    runner.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with db.session() as session:
            job = session.get(Job, job_id)
            assert job is not None
            if job.stage == stage or job.status not in ("queued", "running"):
                break
        time.sleep(0.02)
    assert job is not None
    assert job.stage == stage and job.status == "running", (job.status, job.stage, job.error)
    time.sleep(cancel_after)
    children = psutil.Process().children(recursive=True)
    with db.session() as session:
        cancel_job(session=session, job_id=job_id, caller=OPEN)
    t0 = time.monotonic()
    thread_prefix = f"{stage}-{job_id[:8]}"
    thread_gone = child_gone = ended_s = None
    cpu0 = w0 = 0.0
    while ended_s is None or time.monotonic() - t0 < ended_s + observe:
        now = time.monotonic() - t0
        if thread_gone is None and not threads_named(thread_prefix):
            thread_gone = now
        if child_gone is None and not any(_alive(c) for c in children):
            child_gone = now
        if ended_s is None and (not runner.is_alive() or now > 120):
            ended_s, cpu0, w0 = now, cpu_seconds(), time.monotonic()
        time.sleep(0.02)
    cores = (cpu_seconds() - cpu0) / (time.monotonic() - w0)
    with db.session() as session:
        at = {e.kind: e.at for e in job_events(session, job_id)}
        status = session.scalar(select(Job.status).where(Job.id == job_id))
    latency = (at["cancelled"] - at["cancel-requested"]).total_seconds() if "cancelled" in at else None
    return {"status": status, "cancel_to_cancelled_s": None if latency is None else round(latency, 2),
            "run_job_returned_s": round(ended_s, 2) if not runner.is_alive() else None,
            "thread_gone_s": None if thread_gone is None else round(thread_gone, 2),
            "children_at_cancel": len(children),
            "child_gone_s": None if child_gone is None or not children else round(child_gone, 2),
            f"cores_busy_in_the_{observe:g}_s_after": round(cores, 2),
            "rss_mib_before_job": round(rss_before), "rss_mib_after": round(rss_mib())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cancel-after", type=float, default=1.5)
    parser.add_argument("--observe", type=float, default=10.0)
    args = parser.parse_args()
    from models.io.assets import smollm2_gguf
    from tests.tiny import backtracking_tokenizer, tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        settings = make_settings(root, device="cpu", max_calibration_tokens=1 << 30)
        upgrade(settings.database_url)
        provision(settings)
        shutil.copyfile(smollm2_gguf(), settings.models_dir / "smol.gguf")
        slow = settings.models_dir / "slow-tokenizer"
        backtracking_tokenizer().save_pretrained(slow)
        tiny_model("llama", vocab_size=257).save_pretrained(slow)
        (settings.data_dir / "bs.txt").write_text(("b" * 2000 + "\n") * 64)
        gguf_body = spec(model={"id": "smol.gguf"}, devices=3, random_layouts=0, ablations=False, export=False,
                         calibration={"source": "corpus:shakespeare", "sequences": 8, "seq_len": 256})
        slow_body = spec(model={"id": "slow-tokenizer"}, random_layouts=0, ablations=False, export=False,
                         calibration={"source": "bs.txt", "sequences": 8, "seq_len": 32})
        for name, body, stage in (("gguf loading", gguf_body, "loading"),
                                  ("slow tokenizer", slow_body, "calibration")):
            result = run_cancelled(settings, body, stage, cancel_after=args.cancel_after, observe=args.observe)
            print(f"{name}, cancelled {args.cancel_after:g} s into {stage}: {result}", flush=True)


if __name__ == "__main__":
    main()
