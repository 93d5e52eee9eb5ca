"""The workers' Celery application, made from the configuration in `app/queue.py` (which the API
uses to enqueue by task name without importing this package)."""

from __future__ import annotations

from app.queue import TASK_NAME, celery_config, enqueue, make_celery
from app.settings import get_settings

__all__ = ["TASK_NAME", "app", "celery_config", "enqueue", "make_celery"]

# `celery -A worker.celery_app worker` (and `dtp-layout worker`) use this instance.
app = make_celery(get_settings(), include=("worker.tasks",))
