"""Helpers for the service tests: settings over temporary roots, a tiny model under MODEL_ROOT,
token ids under DATA_ROOT, real Celery worker subprocesses, and polling a job."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from app.cli.supervisor import share_priority
from app.core.settings import Settings
from tests.faults import Faults
from tests.patience_kit import Deadline
from tests.xdist_kit import free_port  # this xdist worker's own port range (the kits import it from here)

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = "tiny"  # a llama with 4 KV groups, FFN width 96, 3 layers, vocabulary 97 (tests/tiny.py)
CALIB = "calib/ids.npy"
# The tiny llama shaped to run the API's examples as they are, with only the model swapped: 3 KV groups
# (L=3 divides them, as SmolLM2-135M's), 1024 positions, and a byte tokenizer, so it reads the corpora.
TEXT_MODEL = "tiny-text"


def importable_from_anywhere(env: dict[str, str]) -> dict[str, str]:
    """`env` with this checkout first on PYTHONPATH: a process started in another working directory
    imports the same code."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH"))))}


def make_settings(root: Path, **overrides: Any) -> Settings:
    # Settings ignores unknown names (a stray variable in a deployment's environment must not stop
    # it); a test's misspelt or retired setting must not pass silently.
    unknown = sorted(set(overrides) - set(Settings.model_fields))
    if unknown:
        raise TypeError(f"no such settings: {', '.join(unknown)} (faults: tests/faults.py)")
    return Settings(var_dir=root, **overrides)


def worker_settings(root: Path, postgres_server: Any, redis_broker: tuple[str, str], name: str,
                    **overrides: Any) -> Settings:
    """Settings for a real-worker test: its own migrated Postgres database, its own Redis key prefix,
    the tiny model and token ids provisioned under `root`, CPU."""
    from app.core.migrate import upgrade

    url = postgres_server.create_database(f"dtp_{name}")
    upgrade(url)
    broker = redis_broker[0]
    settings = make_settings(root, database_url=url, broker_url=broker,
                             broker_key_prefix=own_prefix(redis_broker, name), device="cpu", **overrides)
    provision(settings)
    return settings


def own_prefix(redis_broker: tuple[str, str], name: str) -> str:
    """A broker key prefix no other database of this session uses. The API marks its broker as its
    database's (app/api/readiness.py), and a module-scoped fixture is built again whenever xdist hands
    this worker the module's tests in more than one run: the new database needs a new prefix."""
    import uuid

    return f"{redis_broker[1]}{name}-{uuid.uuid4().hex[:8]}:"


def provision(settings: Settings) -> None:
    """The tiny model under MODEL_ROOT and 4096 random token ids under DATA_ROOT."""
    from tests.tiny import tiny_model

    model_dir = settings.models_dir / TINY_MODEL
    if not (model_dir / "config.json").is_file():
        tiny_model("llama").save_pretrained(model_dir)
    data = settings.data_dir / CALIB
    if not data.is_file():
        data.parent.mkdir(parents=True, exist_ok=True)
        np.save(data, np.random.default_rng(0).integers(0, 97, size=4096))
    settings.storage.mkdir(parents=True, exist_ok=True)


def provision_text_model(settings: Settings) -> None:
    """TEXT_MODEL under MODEL_ROOT (the tokenizer first: the model counts as there once config.json is)."""
    from tests.tiny import byte_tokenizer, tiny_model

    model_dir = settings.models_dir / TEXT_MODEL
    if not (model_dir / "config.json").is_file():
        byte_tokenizer().save_pretrained(model_dir)
        tiny_model("llama", num_attention_heads=6, num_key_value_heads=3, vocab_size=257,
                   max_position_embeddings=1024).save_pretrained(model_dir)


def job_history(settings: Settings, job_id: str) -> list[dict[str, Any]]:
    """The job's events, oldest first, each as one flat dict (`event`: its kind; `at`: ISO 8601 with a Z)."""
    from app.core.db import database
    from app.core.events import job_events

    with database(settings.database_url).session() as session:
        return [event.as_dict() for event in job_events(session, job_id)]


def seed_finished_job(settings: Settings, *, model_id: str, owner: str | None = None,
                      schedule: str = "dtp:1") -> tuple[str, bytes]:
    """A succeeded job written straight to the database (no worker), owned by `owner`, run under `schedule`
    (canonical; dtp:1 is the spec's default, another one its `schedule` with δ 1), with the layouts
    optimised (J 3.5) and contiguous (2.4) and the artifacts report.json and shards/blob.bin (5000
    random bytes, returned with the job id)."""
    import hashlib

    from app.core.db import Artifact, Job, LayoutRow, database, utcnow
    from app.core.storage.root import Storage

    db = database(settings.database_url)
    storage = Storage.from_settings(settings)  # the storage root, or the S3 store DTP_LAYOUT_STORAGE_URL names
    job = Job(spec=spec(**({} if schedule == "dtp:1" else {"schedule": schedule})), fingerprint="f" * 64,
              model_id=model_id, revision=None, devices=2, schedule=schedule, score="fo", status="succeeded",
              progress=1.0, stages_done=[], timings={}, owner=owner,
              cancel_requested=False, affinity_cached=False, attempts=1, finished_at=utcnow(),
              summary={"tokens": 256, "random_expectation": 2.5, "upper_bound": 4.0,
                       "layouts": {"optimised": 3.5, "contiguous": 2.4}})
    payload = os.urandom(5000)
    with db.transaction() as session:
        session.add(job)
        session.flush()
        for name, data in (("report.json", b'{"format": "dtp-layout-report/1"}'), ("shards/blob.bin", payload)):
            key = Storage.artifact_key(job.id, name)
            path = storage.path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            if not storage.local:
                storage.objects.put_file(path, key)
            session.add(Artifact(job_id=job.id, name=name, kind="test", size=len(data),
                                 sha256=hashlib.sha256(data).hexdigest(), storage_key=key))
        for name, value in (("optimised", 3.5), ("contiguous", 2.4)):
            session.add(LayoutRow(job_id=job.id, name=name, J=value, random_expectation=2.5, upper_bound=4.0,
                                  upper_bound_exact=True, up_fraction=[0.5, 0.5, 0.5], down_fraction=[0.5, 0.5],
                                  kv_group_device=[[0, 0, 1, 1]] * 3, neuron_device=[[0] * 48 + [1] * 48] * 3,
                                  shape={"model_type": "llama", "num_layers": 3, "num_kv_groups": 4,
                                         "num_query_heads": 8, "intermediate_size": 96, "hidden_size": 48,
                                         "head_dim": 6},
                                  score={"J": value}))
    return job.id, payload


def seed_job(settings: Settings, *, status: str, model_id: str = TINY_MODEL, owner: str | None = None) -> str:
    """A job in `status` written straight to the database (no worker), owned by `owner`: queued (sent
    just now, so no sweeper re-sends it for DTP_LAYOUT_REQUEUE_AFTER_S), running (in the affinity stage,
    its lease held for an hour), failed (in loading, with an error) or cancelled; for a succeeded one
    with layouts and artifacts, `seed_finished_job`. Remove them with `delete_jobs`."""
    from datetime import timedelta

    from app.core.db import Job, database, utcnow
    from app.core.events import SUBMITTED, record

    now = utcnow()
    fields: dict[str, Any] = {
        "queued": {},
        "running": {"stage": "affinity", "progress": 0.4, "started_at": now, "attempts": 1, "worker": "seeded",
                    "stages_done": ["loading", "calibration"], "lease_until": now + timedelta(hours=1)},
        "failed": {"stage": "loading", "error_stage": "loading", "attempts": 1, "started_at": now, "finished_at": now,
                   "error": "ModelLoadError: the checkpoint could not be read (seeded)"},
        "cancelled": {"finished_at": now, "error": "cancelled before it started", "cancel_requested": True},
    }[status]
    job = Job(spec=spec(), fingerprint="e" * 64, model_id=model_id, revision=None, devices=2, schedule="dtp:1",
              score="fo",
              status=status, owner=owner, enqueued_at=now, **fields)
    with database(settings.database_url).transaction() as session:
        session.add(job)
        session.flush()
        record(session, job.id, SUBMITTED)
        return job.id


def delete_jobs(settings: Settings, job_ids: list[str]) -> None:
    from sqlalchemy import delete

    from app.core.db import Artifact, Job, LayoutRow, database

    with database(settings.database_url).transaction() as session:
        for table in (Artifact, LayoutRow):
            session.execute(delete(table).where(table.job_id.in_(job_ids)))
        session.execute(delete(Job).where(Job.id.in_(job_ids)))


# A distillation of the tiny model that takes seconds: 4 steps of 2 sequences of 16 tokens, evaluated
# every 2 steps on 4 blocks.
TINY_DISTILL: dict[str, Any] = {
    "layouts": ["optimised", "contiguous"],
    "seeds": [0],
    "steps": 4,
    "train": {"source": CALIB, "seq_len": 16},
    "eval": {"source": CALIB, "sequences": 4, "seq_len": 16},
    "recipe": {"batch_size": 2, "micro_batch_size": 1, "eval_every": 2, "checkpoint_every": 1, "warmup_steps": 1,
               "lr": 1e-3, "min_lr": 1e-4, "logit_chunk": 64, "eval_batch_size": 4},
}


def spec(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": {"id": TINY_MODEL},
        "devices": 2,
        "delta": 1,
        "calibration": {"source": CALIB, "sequences": 8, "seq_len": 32},
        "random_layouts": 2,
        "ablations": True,
        "export": {"checkpoint": True, "shards": True},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def stop_process(proc: subprocess.Popen[Any] | None, sig: int, *, grace: float, group: bool) -> None:
    """Send `sig`; after `grace` seconds SIGKILL the process (or its whole process group). `group` (a
    process started with start_new_session=True, leading its own group): whatever of the group is left
    once the process has ended is killed too — a child it started and did not stop (a Celery worker of
    `dtp-layout worker --gpus`, a check's forked child) would otherwise run on with parent PID 1."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait(timeout=10)
    if proc is not None and group:
        with contextlib.suppress(ProcessLookupError):  # none left: the usual case
            os.killpg(proc.pid, signal.SIGKILL)


class WorkerProcess:
    """A real Celery worker (`celery -A worker.celery_app worker`, solo pool) in a subprocess; `faults`:
    slow or hung stages (tests/faults.py)."""

    def __init__(self, settings: Settings, log_path: Path, *, name: str = "test", cwd: Path | None = None,
                 faults: Faults | None = None, **env: str) -> None:
        from app.cli.commands.service import worker_command

        self.log_path, self.cwd = log_path, cwd
        self.env = {**os.environ, **settings.worker_env(), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", **env}
        if faults is not None:
            self.env.update(faults.env(self.env))
        self.cmd = worker_command(settings, name=name)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> WorkerProcess:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the subprocess)
        env = importable_from_anywhere(self.env) if self.cwd is not None else self.env
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=self.cwd)
        share_priority(self.proc.pid)  # a session of its own: keep this test process's priority (xdist_kit)
        log.close()
        deadline = Deadline(timeout)  # a wait on readiness: longer on a busy machine (tests/patience_kit.py)
        while not deadline.expired():
            text = self.log_path.read_bytes()[offset:].decode(errors="replace")
            if " ready." in text:
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"worker not ready after {deadline.bound()}:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, grace: float = 15) -> None:
        """SIGTERM (Celery's warm shutdown), SIGKILL after `grace` s; then whatever is left of its process
        group (issue 41: `dtp-layout worker --gpus` killed after the grace left its Celery child orphaned)."""
        stop_process(self.proc, signal.SIGTERM, grace=grace, group=True)


def wait_for(client: Any, job_id: str, statuses: tuple[str, ...] = ("succeeded", "failed", "cancelled"),
             timeout: float = 60.0, until: Any = None, worker: WorkerProcess | None = None) -> dict[str, Any]:
    """Poll GET /v1/jobs/{id} until the status is one of `statuses` (or `until(job)` holds); `timeout` is
    stretched by the machine's load (tests/patience_kit.py)."""
    deadline = Deadline(timeout)
    job: dict[str, Any] = {}
    while not deadline.expired():
        job = client.get(f"/v1/jobs/{job_id}").json()
        if (until(job) if until is not None else job["status"] in statuses):
            return job
        time.sleep(0.1)
    tail = worker.log()[-4000:] if worker is not None else ""
    raise TimeoutError(f"job {job_id} still {job.get('status')}/{job.get('stage')} after {deadline.bound()}: {job}\n"
                       f"{tail}")


class ServeProcess:
    """`dtp-layout serve` (API + its local worker, none with `no_worker`) in a subprocess on a free port,
    its var dir under `var`, run from `cwd` (default: the caller's); `env` adds DTP_LAYOUT_* settings (API
    keys, a Postgres database, a Redis broker, …). `program` is how to run `dtp-layout` (default: this
    interpreter on this checkout) and `options` (or `serve_args`) more `serve` options; `faults`: its
    workers' slow or hung stages (tests/faults.py)."""

    def __init__(self, var: Path, *, cwd: Path | None = None, no_worker: bool = False,
                 program: Sequence[str] = (sys.executable, "-m", "app.cli.main"), options: Sequence[str] = (),
                 serve_args: Sequence[str] = (), faults: Faults | None = None,
                 **env: str) -> None:
        self.var, self.cwd = var, cwd
        self.program = list(program)
        self.options = [*options, *serve_args, *(["--no-worker"] if no_worker and "--no-worker" not in options else [])]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DTP_LAYOUT_")}
        self.env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                        DTP_LAYOUT_DEVICE="cpu", **env)
        if faults is not None:
            self.env.update(faults.env(self.env))
        self.output: list[str] = []
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 60.0) -> ServeProcess:
        """Starts it and reads its banner up to the example curl (the API is listening by then); `timeout`
        is stretched by the machine's load (tests/patience_kit.py)."""
        env = importable_from_anywhere(self.env) if self.cwd is not None else self.env
        self.proc = subprocess.Popen([*self.program, "serve", "--port", str(self.port), "--var-dir", str(self.var),
                                      *self.options], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=self.cwd)
        share_priority(self.proc.pid)  # a session of its own: keep this test process's priority (xdist_kit)
        assert self.proc.stdout is not None
        self._drain()  # a thread reads the output: a start-up that prints nothing still meets the deadline
        deadline = Deadline(timeout)
        while not deadline.expired():
            if any(line.startswith("then: curl") for line in list(self.output)):
                return self
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the reader's last lines
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"dtp-layout serve did not come up (waited {deadline.bound()}):\n{self.banner()}")

    def _drain(self) -> None:
        """Keep reading the output (the banner, then uvicorn's access log) so that the pipe never fills."""
        import threading

        def read() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                del self.output[:-2000]

        threading.Thread(target=read, daemon=True).start()

    def banner(self) -> str:
        return "".join(self.output[:40])

    def worker_log(self) -> str:
        path = self.var / "worker.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        """SIGINT (as Ctrl-C), then SIGKILL of its process group if it does not stop."""
        stop_process(self.proc, signal.SIGINT, grace=30, group=True)
