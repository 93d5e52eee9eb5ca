"""The Celery application. The API imports this module only to enqueue by task name (no torch here).

Jobs are long and must survive a worker dying: late acknowledgement, one message prefetched per
worker, redelivery when a worker process is lost, and a Redis visibility timeout above the longest
job (a redelivery during a live job would be a no-op anyway: the job row is leased by its worker).
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from app.settings import Settings, get_settings

TASK_NAME = "dtp_layout.run_job"


def celery_config(settings: Settings) -> dict[str, Any]:
    transport: dict[str, Any] = {}
    if settings.broker_url.startswith(("redis://", "rediss://")):
        transport.update(visibility_timeout=settings.visibility_timeout_s, socket_connect_timeout=5)
        if settings.broker_key_prefix:
            transport["global_keyprefix"] = settings.broker_key_prefix
    elif settings.broker_url.startswith(("sqla+sqlite", "sqlalchemy+sqlite")):
        # kombu's SQLAlchemy transport passes these to create_engine: wait on the file lock.
        transport["connect_args"] = {"timeout": 30}
    return {
        "broker_url": settings.broker_url,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "broker_connection_timeout": 5,
        "task_default_queue": settings.queue,
        "task_routes": {"dtp_layout.*": {"queue": settings.queue}},
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_ignore_result": True,
        "task_serializer": "json",
        "accept_content": ["json"],
        "worker_send_task_events": False,
    }


def make_celery(settings: Settings, *, include_tasks: bool = False) -> Celery:
    app = Celery("dtp_layout", include=["worker.tasks"] if include_tasks else [])
    app.conf.update(celery_config(settings))
    return app


def enqueue(celery: Celery, settings: Settings, job_id: str) -> None:
    """Send the job to the queue by task name (the sender never imports the task's code)."""
    celery.send_task(TASK_NAME, args=[job_id], queue=settings.queue, retry=True,
                     retry_policy={"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5})


# `celery -A worker.celery_app worker` (and `dtp-layout worker`) use this instance.
app = make_celery(get_settings(), include_tasks=True)
