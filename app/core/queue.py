"""The Celery client the API enqueues with: the task name, the Celery configuration and `enqueue`.

The API sends jobs by task name and never imports `worker/` (nor torch); `worker/celery_app.py`
builds the worker's Celery app from the same configuration, so the only arrow is worker → app.

Jobs are long and must survive a worker dying: late acknowledgement, one message prefetched per
worker, redelivery when a worker process is lost, and a Redis visibility timeout of about two leases:
a message whose worker died before claiming its job comes back then (a redelivery during a live job
is a no-op: the job row is leased by its worker, and the copy is acknowledged as nothing to do).
"""

from __future__ import annotations

import threading
from typing import Any

from celery import Celery

from app.core.settings import Settings

TASK_NAME = "dtp_layout.run_job"


# The API's publish to Redis: each socket operation and the whole send are bounded, so that a broker that
# is down (connection refused) or hung (accepts, never answers) is a 503 within about 2 × the socket timeout.
PUBLISH_SOCKET_TIMEOUT_S = 2.0
PUBLISH_RETRY = {"max_retries": 1, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 0.5}


def celery_config(settings: Settings, *, publisher: bool = False) -> dict[str, Any]:
    """The Celery configuration; `publisher` (the API's client) adds short socket timeouts on Redis (a
    worker keeps the defaults: its blocking reads wait longer than any publish should)."""
    transport: dict[str, Any] = {}
    if settings.broker_url.startswith(("redis://", "rediss://")):
        transport.update(visibility_timeout=settings.redis_visibility_timeout_s, socket_connect_timeout=5)
        if publisher:
            transport.update(socket_connect_timeout=PUBLISH_SOCKET_TIMEOUT_S, socket_timeout=PUBLISH_SOCKET_TIMEOUT_S)
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


def queue_for(settings: Settings, world_size: int) -> str:
    """The Celery queue of a job on `world_size` ranks: the service's queue for 1, `QUEUE-wW` beyond, so
    that only a worker with at least W GPUs (DTP_LAYOUT_WORKER_GPUS) takes it."""
    return settings.queue if world_size <= 1 else f"{settings.queue}-w{world_size}"


def queues_served(settings: Settings) -> list[str]:
    """The queues a worker consumes: those of every world size up to the GPUs it owns."""
    return [queue_for(settings, w) for w in range(1, settings.worker_gpus + 1)]


def world_size_of(spec: dict[str, Any] | None) -> int:
    """A stored job spec's distill.world_size (1 without a distillation)."""
    distill = (spec or {}).get("distill") or {}
    value = distill.get("world_size", 1)
    return value if isinstance(value, int) and value >= 1 else 1


def make_celery(settings: Settings, *, include: tuple[str, ...] = (), publisher: bool = False) -> Celery:
    app = Celery("dtp_layout", include=list(include))
    app.conf.update(celery_config(settings, publisher=publisher))
    return app


def enqueue(celery: Celery, settings: Settings, job_id: str, *, options: dict[str, Any] | None = None,
            world_size: int = 1) -> None:
    """Send the job to its world size's queue by task name (the sender never imports the task's code);
    `options` go to `send_task` (e.g. time limits)."""
    celery.send_task(TASK_NAME, args=[job_id], queue=queue_for(settings, world_size), retry=True,
                     retry_policy=PUBLISH_RETRY, **(options or {}))


class JobQueue:
    """The API's side of the broker: a Celery client made on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._celery: Celery | None = None
        self._lock = threading.Lock()

    @property
    def celery(self) -> Celery:
        with self._lock:
            if self._celery is None:
                self._celery = make_celery(self.settings, publisher=True)
            return self._celery

    def enqueue(self, job_id: str, options: dict[str, Any] | None = None, world_size: int = 1) -> None:
        enqueue(self.celery, self.settings, job_id, options=options, world_size=world_size)

    def ping(self) -> None:
        """Raises when the broker cannot be reached within a few seconds."""
        with self.celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2, timeout=3)
