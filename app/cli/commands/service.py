"""`dtp-layout serve`, `dtp-layout worker` and `dtp-layout migrate`.

Nothing here imports torch: `serve` runs the API in this process and the worker as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from app.cli.extras import missing_worker_packages, needs_worker_extra, worker_extra_message
from app.cli.supervisor import WorkerSupervisor
from models.run.jobspec import MAX_WORLD_SIZE

PACKAGED_MODEL = "smollm2-135m"


def _settings(args: argparse.Namespace) -> Any:
    from app.core.settings import settings_for_var_dir

    return settings_for_var_dir(getattr(args, "var_dir", None))


def broker_refusal(settings: Any) -> str | None:
    """Why this service must not start on its broker (it serves another database), or None."""
    from app.core.broker_owner import mark_broker

    try:
        return mark_broker(settings)
    except Exception as exc:  # a database or broker not up yet: the workers' own checks still apply
        print(f"dtp-layout: warning: could not check which database the broker serves ({type(exc).__name__}: "
              f"{str(exc)[:200]}); starting anyway", file=sys.stderr)
        return None


def worker_command(settings: Any, *, name: str, loglevel: str = "INFO") -> list[str]:
    """One Celery worker process: solo pool (the job runs in this process; nothing else touches its
    device), one message at a time, on the service's queues of every world size up to the GPUs it owns
    (DTP_LAYOUT_WORKER_GPUS)."""
    from app.core.queue import queues_served

    return [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker", "-Q",
            ",".join(queues_served(settings)),
            "--pool", "solo", "--concurrency", "1", "--prefetch-multiplier", "1", "-n", f"{name}@%h",
            "--loglevel", loglevel, "--without-gossip", "--without-mingle"]


def provision_packaged_model(settings: Any) -> dict[str, Any] | None:
    """Put the packaged SmolLM2-135M GGUF under the model root (hard link, else copy) so that a job can
    name it; returns the model spec to submit, or None when the asset package is missing."""
    from models.io.assets import AssetNotFoundError, smollm2_gguf

    try:
        source = smollm2_gguf()
    except AssetNotFoundError:
        return None
    target = settings.models_dir / PACKAGED_MODEL / source.name
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        tmp.replace(target)
    return {"id": PACKAGED_MODEL, "gguf_file": source.name}


def example_curl(url: str, model: dict[str, Any] | None, api_keys: bool) -> str:
    spec = {"model": model or {"id": "NAME_UNDER_MODEL_ROOT"}, "devices": 3, "delta": 1,
            "calibration": {"source": "corpus:shakespeare", "sequences": 8, "seq_len": 1024},
            "random_layouts": 2, "export": {"checkpoint": True, "shards": True}}
    key = " -H 'X-API-Key: YOUR_KEY'" if api_keys else ""
    return (f"curl -s -X POST {url}/v1/jobs -H 'Content-Type: application/json'{key} \\\n"
            f"     -d {shlex.quote(json.dumps(spec))}")


def _wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def cmd_serve(args: argparse.Namespace) -> int:
    if not args.no_worker and (missing := missing_worker_packages()):
        # the local worker would die at its first import and be restarted for ever
        print(f"dtp-layout serve: error: the local worker {worker_extra_message(missing)}; or pass --no-worker to "
              "run the API alone", file=sys.stderr)
        return 2
    import uvicorn

    from app.api.main import create_app
    from app.core.migrate import upgrade

    settings = _settings(args)
    for d in (settings.var_dir, settings.storage, settings.models_dir, settings.data_dir):
        d.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    if refusal := broker_refusal(settings):
        print(f"dtp-layout serve: error: {refusal}", file=sys.stderr)
        return 2
    from app.api.auth import bind_refusal
    from app.cli.commands.keys import keys_exist

    keyed = keys_exist(settings)
    if refusal := bind_refusal(args.host, keyed=keyed, insecure_open=args.insecure_open):
        print(f"dtp-layout serve: {refusal}", file=sys.stderr)
        return 2
    model = provision_packaged_model(settings)
    log_path = settings.var_dir / "worker.log"
    host_shown = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host_shown}:{args.port}"
    worker: WorkerSupervisor | None = None

    def banner() -> None:
        if not _wait_for_port(host_shown, args.port, 60):
            return
        pid = worker.pid if worker is not None else None
        lines = [
            f"dtp-layout service: {url}   (dashboard: {url}/ui   API docs: {url}/docs)",
            f"  database {settings.database_url}",
            f"  broker   {settings.broker_url}",
            f"  storage  {settings.storage_url or settings.storage}   models {settings.models_dir}   "
            f"data {settings.data_dir}",
            f"  worker   {f'pid {pid}, log {log_path} (restarted if it dies)' if worker else 'none (--no-worker)'}",
            "",
            "submit a job on the corpus" + (" with the packaged SmolLM2-135M:" if model else ":"),
            "",
            example_curl(url, model, keyed),
            "",
            f"then: curl -s {url}/v1/jobs/JOB_ID   (status, stage, progress, ETA)",
            f"      curl -s {url}/v1/jobs/JOB_ID/layouts ;  curl -s {url}/v1/jobs/JOB_ID/artifacts",
        ]
        print("\n".join(lines), flush=True)

    # SIGTERM (systemd, docker, a supervisor) must end here like Ctrl-C does: uvicorn shuts down
    # gracefully, then re-raises the signal it caught; this handler turns it into SystemExit, so that
    # the `finally` below stops the worker instead of the default action killing this process alone.
    def exit_on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if not args.no_worker:
            worker = WorkerSupervisor(worker_command(settings, name="local"), env={**os.environ,
                                      **settings.worker_env()}, log_path=log_path).start()
        threading.Thread(target=banner, daemon=True).start()
        # The app's own access log (app/api/request_context.py) carries the X-Request-ID: uvicorn's is off;
        # with DTP_LAYOUT_LOG_FORMAT=json uvicorn's loggers go through the app's JSON handler, with text
        # uvicorn's formatters are wrapped so that a record stays one line (app/core/logs.py). The protocol
        # closes connections whose headers do not arrive in time (app/api/http_timeouts.py).
        from uvicorn.config import LOGGING_CONFIG

        from app.api import http_timeouts
        from app.core import logs
        uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    log_config=None if settings.log_format == "json" else logs.one_line_config(LOGGING_CONFIG),
                    http=http_timeouts.protocol(settings.header_timeout_s))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        return 0 if code in (128 + signal.SIGTERM, 128 + signal.SIGHUP) else code
    finally:
        if worker is not None:
            worker.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def worker_groups(gpus: list[str], per_worker: int) -> list[list[str]]:
    """The GPU ids cut into workers of `per_worker` devices each (the last may own fewer)."""
    return [gpus[i : i + per_worker] for i in range(0, len(gpus), per_worker)]


def cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.gpus_per_worker is not None:
        settings = settings.model_copy(update={"worker_gpus": args.gpus_per_worker})
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else []
    if refusal := broker_refusal(settings):
        print(f"dtp-layout worker: error: {refusal}", file=sys.stderr)
        return 2
    if not gpus:
        # One worker: replace this process, so that signals (and SIGKILL) reach the worker itself.
        cmd = worker_command(settings, name=args.name, loglevel=args.loglevel)
        os.execve(sys.executable, cmd, {**os.environ, **settings.worker_env()})
    procs = []
    for group in worker_groups(gpus, settings.worker_gpus):
        # The parent never touches CUDA; each child sees exactly its devices and takes jobs up to their count.
        own = settings.model_copy(update={"worker_gpus": len(group)})
        env = {**os.environ, **own.worker_env(), "CUDA_VISIBLE_DEVICES": ",".join(group)}
        procs.append(subprocess.Popen(worker_command(own, name=f"{args.name}-gpu{'-'.join(group)}",
                                                     loglevel=args.loglevel), env=env))

    def forward(signum: int, _frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [p.wait() for p in procs]
    return max(codes, default=0)


def cmd_migrate(args: argparse.Namespace) -> int:
    from app.core.migrate import downgrade, upgrade

    settings = _settings(args)
    if settings.database_url.startswith("sqlite"):
        settings.var_dir.mkdir(parents=True, exist_ok=True)
    if args.downgrade:
        downgrade(settings.database_url, args.downgrade)
    else:
        upgrade(settings.database_url)
    print(f"database {settings.database_url}: migrated", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="the layout service: HTTP API + one local worker (default: SQLite under ./var)",
                       description="Runs `alembic upgrade head`, starts one local Celery worker and the API. "
                                   "Settings come from DTP_LAYOUT_* variables (docs/settings.md); by default "
                                   "everything lives under ./var and no other server is needed.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1); any other address needs "
                                                        "API keys (`dtp-layout keys create`) or --insecure-open")
    p.add_argument("--insecure-open", action="store_true",
                   help="listen off loopback without any API key: anyone who reaches the port can submit jobs and "
                        "read every result")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--var-dir", help="base directory of the embedded defaults (DTP_LAYOUT_VAR_DIR; default ./var)")
    p.add_argument("--no-worker", action="store_true",
                   help="run the API only (all a base install can: the local worker needs the worker extra)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default: info)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("worker", help="a Celery worker for the job queue (one process per GPU)",
                       description="Consumes the job queue (DTP_LAYOUT_QUEUE, default gpu) with one job at a time. "
                                   "With --gpus 0,1 it starts one worker process per device (per --gpus-per-worker "
                                   "devices), each with its own CUDA_VISIBLE_DEVICES; this parent process never "
                                   "touches CUDA.")
    p.add_argument("--gpus", help="comma-separated CUDA device ids, one worker process each (default: one worker, "
                                  "CUDA_VISIBLE_DEVICES as set)")
    p.add_argument("--gpus-per-worker", type=int, metavar="N", choices=range(1, MAX_WORLD_SIZE + 1),
                   help="GPUs each worker process owns (DTP_LAYOUT_WORKER_GPUS, default 1): with --gpus 0,1,2,3 and "
                        "2, two workers of two GPUs each; a worker takes the jobs whose distill.world_size is at most "
                        "its GPUs (without --gpus: the gloo rank processes a CPU worker may start)")
    p.add_argument("--name", default="worker", help="Celery node name prefix (default: worker)")
    p.add_argument("--var-dir", help="base directory of the embedded defaults (DTP_LAYOUT_VAR_DIR)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=cmd_worker)
    needs_worker_extra(p)

    p = sub.add_parser("migrate", help="apply the database migrations (alembic upgrade head)")
    p.add_argument("--var-dir", help="base directory of the embedded defaults (DTP_LAYOUT_VAR_DIR)")
    p.add_argument("--downgrade", metavar="REVISION", help="downgrade to REVISION (e.g. base) instead")
    p.set_defaults(func=cmd_migrate)
